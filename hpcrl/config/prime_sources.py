"""prime-rl's `[[orchestrator.<kind>.source]]` (verifiers 0.4 tasksets with their agent harness and
runtime) as hpcrl's `[[orchestrator.<kind>.env]]` entries: the source's `env` table goes to verifiers
unchanged (EnvConfig.env; hpcrl.envs.verifiers.v1_env.env_config), its name / ratio / num_examples /
group_size (eval) become the entry's, and the default zero-advantage admission gate is hpcrl's
zero_advantage = 'drop'. A taskset not installed here falls back at load time
(hpcrl.launch.checks._source_fallback)."""

from __future__ import annotations

from typing import Any

from hpcrl.config.dicts import get_path, set_path
from hpcrl.errors import ConfigError

_SOURCE_FIELDS = {
    "name",
    "ratio",
    "env",
    "group_size",
    "num_examples",
    "interval",
    "curriculum",
    "sampling",
    "algo",
    "serve",
}


def sources(d: dict[str, Any], kind: str) -> None:
    """[[orchestrator.<kind>.source]] -> [[orchestrator.<kind>.env]] entries."""
    path = ["orchestrator", kind, "source"]
    sources = get_path(d, path)
    if sources is None:
        return
    where = ".".join(path)
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise ConfigError(where, f"expected a list of tables ([[{where}]])")
    get_path(d, path[:-1]).pop("source")
    envs = get_path(d, ["orchestrator", kind, "env"])
    envs = list(envs) if isinstance(envs, list) else []
    for i, s in enumerate(sources):
        envs.append(source_to_env(s, f"{where}[{i}]", kind, d))
    set_path(d, ["orchestrator", kind, "env"], envs)


def source_to_env(s: dict[str, Any], where: str, kind: str, d: dict[str, Any]) -> dict[str, Any]:
    """One prime-rl source as an hpcrl env entry (its `env` table goes to verifiers unchanged)."""
    for k in s:
        if k not in _SOURCE_FIELDS:
            raise ConfigError(f"{where}.{k}", f"unknown field (allowed: {', '.join(sorted(_SOURCE_FIELDS))})")
    env = s.get("env")
    if not isinstance(env, dict):
        raise ConfigError(f"{where}.env", "required: the verifiers env table ([...env.taskset] id = ...)")
    taskset = env.get("taskset")
    env_id = env.get("id") or (taskset.get("id") if isinstance(taskset, dict) else None)
    if not isinstance(env_id, str) or not env_id:
        raise ConfigError(f"{where}.env.taskset.id", "required: the taskset (or env.id) to run")
    out: dict[str, Any] = {"id": env_id, "env": env}
    for k in ("name", "ratio", "num_examples"):
        if k in s:
            out[k] = s[k]
    chosen = get_path(env, ["agent", "runtime", "type"])
    if isinstance(chosen, str):  # the seat's runtime, chosen: hpcrl's checks of a runtime apply to it
        out["runtime"] = chosen
    timeout = get_path(env, ["agent", "timeout", "rollout"])
    if isinstance(timeout, (int, float)) and timeout > 0:
        out["rollout_timeout_s"] = float(timeout) + 60.0  # verifiers' own limit fires first
    if "group_size" in s:
        if kind == "eval":
            out["rollouts_per_example"] = s["group_size"]
        else:
            glob = get_path(d, ["orchestrator", "group_size"]) or get_path(
                d, ["orchestrator", "rollouts_per_example"]
            )
            if s["group_size"] != glob:
                raise ConfigError(
                    f"{where}.group_size",
                    "per-source group sizes are not supported: set orchestrator.group_size",
                )
    if kind == "eval" and "interval" in s:
        glob = get_path(d, ["orchestrator", "eval", "interval"])
        if glob is not None and glob != s["interval"]:
            raise ConfigError(
                f"{where}.interval", f"differs from orchestrator.eval.interval = {glob}: one interval here"
            )
        set_path(d, ["orchestrator", "eval", "interval"], s["interval"])
    if s.get("algo"):
        if kind != "train":
            raise ConfigError(f"{where}.algo", "an algorithm is for training sources only")
        out["algo"] = s["algo"]  # per-source algorithm (hpcrl.config.algo_checks.check_env_algos)
    for k in ("sampling", "serve"):
        if s.get(k):
            raise ConfigError(
                f"{where}.{k}",
                f"per-source {k} is not supported: set orchestrator.{kind}.{k}",
            )
    _curriculum(s.get("curriculum"), f"{where}.curriculum", d)
    return out


def _curriculum(cur: Any, where: str, d: dict[str, Any]) -> None:
    """prime-rl's default admission gate, advantage_range with reject_min = reject_max = 0 (a group whose
    advantages are all zero does not train), is hpcrl's orchestrator.advantage.zero_advantage = 'drop'."""
    if cur is None:
        return
    if not isinstance(cur, dict):
        raise ConfigError(where, "expected a table")
    for k, v in cur.items():
        if k == "sampler" and (v or {}).get("type", "standard") == "standard":
            continue  # prime-rl's default sampler: tasks in source order, as here
        if k != "gates":
            raise ConfigError(
                f"{where}.{k}", "not supported here (allowed: gates, sampler.type = 'standard')"
            )
        for name, gate in (v or {}).items():
            g = gate if isinstance(gate, dict) else {}
            if (
                g.get("type", "advantage_range") != "advantage_range"
                or g.get("reject_min", 0)
                or g.get("reject_max", 0)
            ):
                raise ConfigError(
                    f"{where}.gates.{name}",
                    "only the zero-advantage gate (type = 'advantage_range', reject_min = reject_max = 0) is supported",
                )
            current = get_path(d, ["orchestrator", "advantage", "zero_advantage"])
            if current not in (None, "drop"):
                raise ConfigError(
                    f"{where}.gates.{name}",
                    f"conflicts with orchestrator.advantage.zero_advantage = {current!r}",
                )
            set_path(d, ["orchestrator", "advantage", "zero_advantage"], "drop")


# prime-rl's SFT [eval] (its EvalsEvalConfig) -> hpcrl's SFT [eval] (hpcrl.config.sections.sft_eval)
_SFT_EVAL_SAME = ("interval", "skip_first_step", "retrigger_on_resume", "num_examples")


def sft_eval(d: dict[str, Any]) -> None:
    """prime-rl's SFT [eval]: group_size is rollouts_per_example, sampling.max_completion_tokens is
    max_tokens, [[eval.source]] are `env` entries (one interval for all), and the top-level [inference]
    (prime-rl's server for online evals) is the server each evaluation starts, eval.inference."""
    ev = d.get("eval")
    inference = d.pop("inference", None)
    if ev is None:
        if inference is not None:
            raise ConfigError(
                "inference", "is only used for online evals in an SFT config: add [eval] or drop it"
            )
        return
    if not isinstance(ev, dict):
        raise ConfigError("eval", "expected a table")
    out: dict[str, Any] = {}
    for k, v in ev.items():
        if k in _SFT_EVAL_SAME or k in ("env", "inference", "seq_len", "rollouts_per_example"):
            out[k] = v
        elif k == "group_size":
            out["rollouts_per_example"] = v
        elif k == "sampling":
            if not isinstance(v, dict):
                raise ConfigError("eval.sampling", f"expected a table, got {type(v).__name__}")
            sampling = dict(v)
            if "max_completion_tokens" in sampling:
                sampling["max_tokens"] = sampling.pop("max_completion_tokens")
            out["sampling"] = sampling
        elif k != "source":
            raise ConfigError(
                f"eval.{k}",
                "not supported in an SFT config here (allowed: interval, skip_first_step, retrigger_on_resume, "
                "num_examples, group_size, sampling, source): online evals score the trainer's own weights on "
                "a server each evaluation starts",
            )
    srcs = ev.get("source") or []
    if not isinstance(srcs, list) or not all(isinstance(s, dict) for s in srcs):
        raise ConfigError("eval.source", "expected a list of tables ([[eval.source]])")
    shim: dict[str, Any] = {"orchestrator": {"eval": {}}}
    envs = out.get("env") or []
    if not isinstance(envs, list):
        raise ConfigError("eval.env", f"expected a list of tables ([[eval.env]]), got {type(envs).__name__}")
    envs = list(envs)
    for i, s in enumerate(srcs):
        s = dict(s)
        own = s.pop("interval", None)
        if own is not None and own != out.setdefault("interval", own):
            raise ConfigError(f"eval.source[{i}].interval", f"differs from eval.interval = {out['interval']}")
        envs.append(source_to_env(s, f"eval.source[{i}]", "eval", shim))
    out["env"] = envs
    if isinstance(inference, dict) and inference:
        own = out.get("inference") or {}
        out["inference"] = {**inference, **own}
    d["eval"] = out
