"""prime-rl's config shapes of today (its snapshot of 2026-08-21), translated into hpcrl's, one file at a time.

hpcrl.config.prime_names holds the older renames (`[orchestrator.sampling]`, the teacher's client);
this module holds the tables prime-rl grew since. Each is moved to the hpcrl field that does the same
thing, or kept with one printed note where it names something that exists only on Prime's platform.
Nothing is dropped silently (docs/prime-rl.md lists every key):

- `[monitors.wandb]` (and a role's `[trainer.monitors.wandb]` / `[orchestrator.monitors.wandb]`) is
  `[wandb]`; `[monitors.file]` is the run's metrics.jsonl, always written; `[monitors.prime]` is the
  platform's (a note).
- `[weight_broadcast]` is `[trainer.broadcast]`: type nccl / nixl -> transport collective, filesystem
  -> filesystem, timeout -> timeout_s.
- `[deployment] type` picks single_node / multi_node fields; `num_infer_replicas` multiplies the
  inference nodes (prime-rl: nodes per replica).
- `[resume]` (step, or none = the newest) is `ckpt.resume_step`; `resume.dir` forks another run's
  checkpoint: `ckpt.warm_start` with its optimizer. `clean` is `clean_output_dir`; `[run] name / dir`
  name the run and its directory under output_dir, as prime-rl does.
- `[orchestrator.concurrency]` is hpcrl's table of the same name; without `mode` it is adaptive, as in
  prime-rl (min_inflight = max_inflight: fixed at `orchestrator.max_concurrent` = max_inflight).
- `[[orchestrator.train.source]]` / `[[orchestrator.eval.source]]` are `[[orchestrator.<kind>.env]]`
  entries whose `env` table is verifiers 0.4's env config (taskset, agent harness / runtime / timeout,
  seats), handed to verifiers unchanged (hpcrl.envs.verifiers.v1_env).
- Split role files (prime-rl's k8s train.toml / orch.toml / infer.toml) put a role's keys at the top
  level: read by `hpcrl trainer|orchestrator|inference`, they move under that role (`split_role_file`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from hpcrl.config.dicts import deep_merge, get_path, set_path
from hpcrl.config.prime_model import fp8_served_copy
from hpcrl.config.prime_sources import sft_eval, source_to_env, sources
from hpcrl.errors import ConfigError

_BROADCAST_TYPES = {"filesystem": "filesystem", "nccl": "collective", "nixl": "collective"}

# (prime-rl's key, where it lands here): docs/config.md lists these beside the field aliases
TABLES = (
    ("monitors.wandb (and trainer. / orchestrator.monitors.wandb)", "wandb"),
    ("monitors.file", "metrics.jsonl, always written (a note when turned off)"),
    ("monitors.prime", "a note: a Prime platform monitor"),
    (
        "weight_broadcast.type (nccl, nixl / filesystem)",
        "trainer.broadcast.transport (collective / filesystem)",
    ),
    ("weight_broadcast.timeout", "trainer.broadcast.timeout_s"),
    ("deployment.type (single_node / multi_node)", "which deployment fields apply"),
    ("deployment.num_infer_replicas", "deployment.num_infer_nodes (x nodes per replica)"),
    ("resume, resume.step, --resume", "ckpt.resume_step (-1 = the newest)"),
    ("resume.dir", "ckpt.warm_start + ckpt.warm_start_optimizer"),
    ("clean, --clean", "clean_output_dir"),
    ("run.name, run.dir", "name, output_dir / (dir or name)"),
    ("orchestrator.concurrency (no mode)", "orchestrator.concurrency.mode = adaptive (min = max: fixed)"),
    (
        "orchestrator.train.source / orchestrator.eval.source",
        "orchestrator.train.env / orchestrator.eval.env (env: verifiers' table)",
    ),
    ("source.curriculum.gates.* (advantage_range 0..0)", "orchestrator.advantage.zero_advantage = drop"),
    ("orchestrator.model.lora.rank / alpha / name", "checked against trainer.model.lora; the name: a note"),
    ("trainer.model.seq_len (> the samples' seq_len)", "trainer.micro_batch_tokens"),
    ("SFT data.micro_batch_size", "micro_batch_tokens (rows x data.seq_len)"),
    ("SFT data.loss_mask", "loss_mask"),
    ("SFT data.fake", "data.type = fake"),
    ("evals: eval.client / eval.concurrency.max_inflight", "client / client.max_concurrent"),
    ("evals: eval.source / eval.group_size / eval.num_examples", "env / rollouts_per_example / num_examples"),
)


def translate(d: dict[str, Any], source: str, notes: list[str], sft: bool = False) -> None:
    """One file's dict, prime-rl's shapes moved to hpcrl's, in place."""
    _run_table(d, notes)
    _vlm(d, source, notes, sft)
    fp8_served_copy(d, source, notes)  # <trained>-FP8 served: the trained model, quantized online
    served = get_path(d, ["orchestrator", "model", "name"])
    trained = get_path(d, ["trainer", "model", "name"]) or get_path(d, ["model", "name"])
    if served is not None and trained is not None and served != trained:
        raise ConfigError(
            "orchestrator.model.name",
            f"{served!r} is not the trained model {trained!r}: hpcrl serves the trainer's own weights "
            f"(an FP8 copy is served as {trained!r} + inference.quantization; another model is not)",
        )
    if "clean" in d:
        _move(d, ["clean"], ["clean_output_dir"])
    _resume(d)
    for prefix in ([], ["trainer"], ["orchestrator"]):
        _monitors(d, prefix, source, notes)
    for prefix in ([], ["trainer"], ["orchestrator"]):
        _weight_broadcast(d, prefix, source, notes, sft)
    _deployment(d, notes)
    if not sft:
        _trainer_seq_len(d)
    if sft:
        _sft_data(d)
        sft_eval(d)
    if not sft:
        _orchestrator_lora(d, source, notes)
        _concurrency(d, source, notes)
        for kind in ("train", "eval"):
            sources(d, kind)


# ---------------------------------------------------------------------------------------------
def _vlm(d: dict[str, Any], source: str, notes: list[str], sft: bool) -> None:
    """[model.vlm]: hpcrl trains transformers' own vision-language class (`hpcrl sft`, and `hpcrl run`
    with multimodal rollouts), so prime-rl's `impl = "custom"` (its custom Qwen3.5 VLM) is read as
    auto, with a note."""
    del sft  # the same for SFT and RL
    for path in (["model", "vlm"], ["trainer", "model", "vlm"]):
        if get_path(d, path) is None:
            continue
        for impl in (path[:-1] + ["impl"], ["trainer", "model", "impl"]):
            if get_path(d, impl) == "custom":
                set_path(d, impl, "auto")
                notes.append(
                    f"{source}: {'.'.join(impl)} = 'custom' with [model.vlm]: prime-rl's custom VLM class; "
                    "hpcrl trains transformers' own class (impl = 'auto')"
                )


def _move(d: dict[str, Any], old: list[str], new: list[str]) -> None:
    """Move a value; the same value set both ways is fine, a different one is an error."""
    value = get_path(d, old[:-1]).pop(old[-1])
    current = get_path(d, new)
    if current is not None and current != value:
        raise ConfigError(".".join(old), f"conflicts with {'.'.join(new)} = {current!r} (the same setting)")
    set_path(d, new, value)


def _table(d: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    v = get_path(d, path)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ConfigError(".".join(path), f"expected a table ([{'.'.join(path)}])")
    return v


DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # prime-rl's default model.name


def default_model(merged: dict[str, Any], notes: list[str]) -> None:
    """No model named anywhere: the served one ([inference.vllm] model, in a prime-rl inference
    file), else prime-rl's default, said in a note (the dry run says whether it is cached)."""
    served = get_path(merged, ["inference", "vllm", "model"])
    set_path(merged, ["model", "name"], served or DEFAULT_MODEL)
    if not served:
        notes.append(f"model.name is unset: using prime-rl's default {DEFAULT_MODEL}")


DEFAULT_SFT_DATA = "PrimeIntellect/Reverse-Text-SFT"  # prime-rl's default SFT data.name


def sft_defaults(merged: dict[str, Any], notes: list[str]) -> None:
    """An SFT config without a model or data names prime-rl's defaults, said in notes."""
    if get_path(merged, ["model", "name"]) is None:
        default_model(merged, notes)
    if get_path(merged, ["data", "name"]) is None and get_path(merged, ["data", "type"]) != "fake":
        set_path(merged, ["data", "name"], DEFAULT_SFT_DATA)
        notes.append(f"data.name is unset: using prime-rl's default {DEFAULT_SFT_DATA}")


def _pop_table(d: dict[str, Any], prefix: list[str], key: str) -> tuple[dict[str, Any] | None, str]:
    """The table `prefix.key`, taken out of `d` (None when absent), and its dotted name."""
    table = _table(d, prefix + [key])
    if table is not None:
        (get_path(d, prefix) if prefix else d).pop(key)
    return table, ".".join(prefix + [key])


def _run_table(d: dict[str, Any], notes: list[str]) -> None:
    """prime-rl's [run]: name names the run; the run directory is output_dir / (dir or name)."""
    run = _table(d, ["run"])
    if run is None:
        return
    d.pop("run")
    for k in run:
        if k not in ("name", "dir"):
            raise ConfigError(f"run.{k}", "unknown field (allowed: name, dir)")
    if run.get("name") is not None:
        if d.get("name") not in (None, run["name"]):
            raise ConfigError("run.name", f"conflicts with name = {d['name']!r}")
        d["name"] = run["name"]
    sub = run.get("dir") or run.get("name")
    if sub:
        d["output_dir"] = str(PurePosixPath(d.get("output_dir", "outputs")) / str(sub))


def _resume(d: dict[str, Any]) -> None:
    """[resume] (a bare table = the newest complete checkpoint) -> ckpt.resume_step / ckpt.warm_start."""
    if "resume" not in d:
        return
    resume = d.pop("resume")
    if resume is True:  # `--resume` as a flag
        resume = {}
    if not isinstance(resume, dict):
        raise ConfigError(
            "resume", "expected a table ([resume] step = N, or an empty [resume] for the newest)"
        )
    for k in resume:
        if k not in ("step", "dir"):
            raise ConfigError(f"resume.{k}", "unknown field (allowed: step, dir)")
    step, where = resume.get("step"), resume.get("dir")
    if step is not None and where is not None:
        raise ConfigError("resume.dir", "excludes resume.step (the step is taken from the directory name)")
    ckpt = d.get("ckpt")
    ckpt = dict(ckpt) if isinstance(ckpt, dict) else {}
    if where is not None:
        name = PurePosixPath(str(where)).name
        if not (name.startswith("step_") and name[5:].isdigit()):
            raise ConfigError(
                "resume.dir", f"must be a checkpoint step directory (.../step_N), got {where!r}"
            )
        ckpt.setdefault("warm_start", str(where))
        ckpt.setdefault("warm_start_optimizer", True)
    else:
        value = -1 if step is None else step
        if ckpt.get("resume_step") not in (None, value):
            raise ConfigError("resume.step", f"conflicts with ckpt.resume_step = {ckpt['resume_step']!r}")
        ckpt["resume_step"] = value
    d["ckpt"] = ckpt


def _monitors(d: dict[str, Any], prefix: list[str], source: str, notes: list[str]) -> None:
    """[monitors] -> [wandb]; file: always on here; prime: the platform's."""
    mon, where = _pop_table(d, prefix, "monitors")
    if mon is None:
        return
    for k, v in mon.items():
        if k == "wandb":
            if v is None or v is False:
                continue
            if not isinstance(v, dict):
                raise ConfigError(f"{where}.wandb", "expected a table")
            own = _table(d, ["wandb"]) or {}
            for f, x in v.items():
                if f in own and own[f] != x:
                    raise ConfigError(f"{where}.wandb.{f}", f"conflicts with wandb.{f} = {own[f]!r}")
            d["wandb"] = deep_merge(own, v)
        elif k == "file":
            if isinstance(v, dict) and v.get("path") not in (None, "metrics.jsonl"):
                raise ConfigError(
                    f"{where}.file.path",
                    "hpcrl writes <output_dir>/metrics.jsonl (resume and status read it)",
                )
            if v is None or v is False:
                notes.append(
                    f"{source}: {where}.file off: hpcrl always writes metrics.jsonl (resume and status read it)"
                )
        elif k == "prime":
            notes.append(f"{source}: [{where}.prime] is a Prime platform monitor; ignored here")
        else:
            raise ConfigError(f"{where}.{k}", "unknown monitor (allowed: wandb, file, prime)")


def _weight_broadcast(d: dict[str, Any], prefix: list[str], source: str, notes: list[str], sft: bool) -> None:
    """[weight_broadcast] -> [trainer.broadcast] (an SFT run publishes no weights: a note)."""
    wb, where = _pop_table(d, prefix, "weight_broadcast")
    if wb is None:
        return
    if sft:
        notes.append(f"{source}: [{where}]: an SFT run has no inference servers to update; ignored")
        return
    out: dict[str, Any] = {}
    for k, v in wb.items():
        if k == "type":
            if v not in _BROADCAST_TYPES:
                raise ConfigError(f"{where}.type", f"invalid value {v!r} (allowed: filesystem, nccl, nixl)")
            out["transport"] = _BROADCAST_TYPES[v]
            if v == "nixl":
                notes.append(
                    f"{source}: {where}.type = 'nixl': hpcrl moves weights by NCCL point to point in rounds "
                    "(docs/weights.md), the same links NIXL would use"
                )
        elif k == "timeout":
            out["timeout_s"] = float(v)
        elif k in ("host", "port", "inference_world_size", "session_id"):
            notes.append(
                f"{source}: {where}.{k}: hpcrl's trainer and servers rendezvous through the run directory "
                "(addresses and world size are found, not configured)"
            )
        elif k == "quantize_in_weight_transfer":
            if v:
                notes.append(
                    f"{source}: {where}.quantize_in_weight_transfer: weights move in the policy dtype here "
                    "and the servers quantize them (inference.quantization, prime-rl #3581)"
                )
        else:
            raise ConfigError(f"{where}.{k}", "unknown field (allowed: type, timeout, host, port, ...)")
    own = _table(d, ["trainer", "broadcast"]) or {}
    for f, x in out.items():
        if f in own and own[f] != x:
            raise ConfigError(f"{where}", f"conflicts with trainer.broadcast.{f} = {own[f]!r}")
    set_path(d, ["trainer", "broadcast"], deep_merge(own, out))


_SINGLE = ("num_train_gpus", "num_infer_gpus")
_MULTI = ("num_train_nodes", "num_infer_nodes", "num_infer_replicas", "nodes_per_fsdp_group")


def _deployment(d: dict[str, Any], notes: list[str]) -> None:
    dep = _table(d, ["deployment"])
    if dep is None:
        return
    kind = dep.pop("type", None)
    if kind not in (None, "single_node", "multi_node"):
        raise ConfigError(
            "deployment.type",
            f"invalid value {kind!r} (allowed: single_node, multi_node; prime-rl's disaggregated "
            "prefill/decode serving is not supported here)",
        )
    wrong = _MULTI if kind == "single_node" else _SINGLE if kind == "multi_node" else ()
    for k in wrong:
        if k in dep:
            raise ConfigError(f"deployment.{k}", f"is not a field of deployment.type = {kind!r}")
    replicas = dep.pop("num_infer_replicas", None)
    if replicas is not None:
        if not isinstance(replicas, int) or replicas < 1:
            raise ConfigError("deployment.num_infer_replicas", f"expected an integer >= 1, got {replicas!r}")
        per = dep.get("num_infer_nodes")
        inf_dep = get_path(d, ["inference", "deployment"])
        if per is None and isinstance(inf_dep, dict):  # prime-rl: inferred from the inference deployment
            per = (
                sum(inf_dep.get(k, 0) or 0 for k in ("prefill_nodes_per_replica", "decode_nodes_per_replica"))
                or None
            )
        if per is None:
            raise ConfigError(
                "deployment.num_infer_replicas", "needs deployment.num_infer_nodes (nodes per replica)"
            )
        dep["num_infer_nodes"] = per * replicas  # hpcrl: inference nodes in all
    if "nodes_per_fsdp_group" in dep:
        raise ConfigError(
            "deployment.nodes_per_fsdp_group",
            "not supported: hpcrl shards the trainer over all its GPUs (FSDP)",
        )


def _trainer_seq_len(d: dict[str, Any]) -> None:
    """prime-rl's trainer.model.seq_len may exceed the samples' seq_len (it must be >= it): it is the
    trainer's packing length, hpcrl's trainer.micro_batch_tokens. Equal, or alone, it is seq_len."""
    for path in (["trainer", "model", "seq_len"], ["model", "seq_len"]):
        mine = get_path(d, path)
        sample = get_path(d, ["orchestrator", "seq_len"]) or d.get("seq_len")
        if mine is None or sample is None or mine == sample:
            continue
        if not isinstance(mine, int) or not isinstance(sample, int) or mine < sample:
            raise ConfigError(
                ".".join(path),
                f"{mine!r} must be >= the samples' seq_len ({sample!r}): the trainer packs them",
            )
        get_path(d, path[:-1]).pop("seq_len")
        own = get_path(d, ["trainer", "micro_batch_tokens"])
        if own not in (None, mine):
            raise ConfigError(".".join(path), f"conflicts with trainer.micro_batch_tokens = {own!r}")
        set_path(d, ["trainer", "micro_batch_tokens"], mine)


def _sft_data(d: dict[str, Any]) -> None:
    """prime-rl's SFT [data]: micro_batch_size (rows) is micro_batch_tokens = rows x the row length;
    type = 'sft' is the only loader here; [data.loss_mask] is [loss_mask]."""
    data = _table(d, ["data"])
    if data is None:
        return
    fake = data.pop("fake", None)
    if fake is not None:  # the trainer's [data.fake] table: SFT's data.type = 'fake' with its fields
        if not isinstance(fake, dict):
            raise ConfigError("data.fake", "expected a table")
        if data.get("type", "fake") != "fake":
            raise ConfigError("data.fake", f"conflicts with data.type = {data['type']!r}")
        data.update(fake)
        data["type"] = "fake"
    if "loss_mask" in data:
        _move(d, ["data", "loss_mask"], ["loss_mask"])
    rows = data.pop("micro_batch_size", None)
    if rows is not None:
        if not isinstance(rows, int) or rows < 1:
            raise ConfigError("data.micro_batch_size", f"expected an integer >= 1, got {rows!r}")
        row_len = data.get("seq_len") or d.get("seq_len") or 512
        tokens = rows * row_len
        if d.get("micro_batch_tokens") not in (None, tokens):
            raise ConfigError(
                "data.micro_batch_size", f"{rows} rows of {row_len} tokens conflicts with micro_batch_tokens"
            )
        d["micro_batch_tokens"] = tokens


def _orchestrator_lora(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """prime-rl's [orchestrator.model.lora]: the adapter's served name, and its rank / alpha, which
    must be the trainer's (the trainer makes the adapter: [trainer.model.lora] or [model.lora])."""
    lora = _table(d, ["orchestrator", "model", "lora"])
    if lora is None:
        return
    d["orchestrator"]["model"].pop("lora")
    trainer = _table(d, ["trainer", "model", "lora"]) or _table(d, ["model", "lora"])
    for k, v in lora.items():
        if k == "name":
            notes.append(
                f"{source}: orchestrator.model.lora.name = {v!r}: the adapter is served as 'policy-lora' "
                "here (hpcrl's orchestrator names it in every request)"
            )
        elif k in ("rank", "alpha"):
            if trainer is None:
                raise ConfigError(
                    f"orchestrator.model.lora.{k}",
                    "needs [trainer.model.lora] (the trainer makes the adapter)",
                )
            if k in trainer and trainer[k] != v:
                raise ConfigError(
                    f"orchestrator.model.lora.{k}",
                    f"{v!r} differs from trainer.model.lora.{k} = {trainer[k]!r}",
                )
        else:
            raise ConfigError(f"orchestrator.model.lora.{k}", "unknown field (allowed: name, rank, alpha)")


def _concurrency(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """`[orchestrator.concurrency]` is hpcrl's own table under prime-rl's names (issue 53). Written
    without `mode` (prime-rl's shape) it means what it means in prime-rl: an adaptive cap, or a fixed
    one at max_inflight when min_inflight = max_inflight (prime-rl's way to turn adaptation off)."""
    conc = _table(d, ["orchestrator", "concurrency"])
    if conc is None or "mode" in conc:
        return
    allowed = ("max_inflight", "min_inflight", "initial_inflight", "poll_interval_s")
    for k in conc:
        if k not in allowed:
            raise ConfigError(
                f"orchestrator.concurrency.{k}", f"unknown field (allowed: mode, {', '.join(allowed)})"
            )
    top = conc.get("max_inflight")
    if top is not None and conc.get("min_inflight") == top:
        own = get_path(d, ["orchestrator", "max_concurrent"])
        if own is not None and own != top:
            raise ConfigError(
                "orchestrator.concurrency.max_inflight",
                f"conflicts with orchestrator.max_concurrent = {own!r}",
            )
        d["orchestrator"]["max_concurrent"] = top
        conc["mode"] = "fixed"
    else:
        conc["mode"] = "adaptive"


# ---------------------------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------------------------
_FLAG_PREFIXES = (  # prime-rl's flag prefix -> hpcrl's (kebab-case)
    ("--monitors.wandb", "--wandb"),
    ("--no-monitors.wandb", "--no-wandb"),
    ("--orchestrator.monitors.wandb", "--wandb"),
    ("--trainer.monitors.wandb", "--wandb"),
    ("--weight-broadcast.timeout", "--trainer.broadcast.timeout-s"),
    ("--clean", "--clean-output-dir"),
)
_NOTE_FLAGS = ("--monitors.prime", "--orchestrator.monitors.prime", "--no-monitors.file", "--monitors.file")


def rewrite_argv(argv: list[str], notes: list[str]) -> list[str]:
    """prime-rl's flags (--resume, --resume.step N, --clean, --monitors.*, --weight-broadcast.*) as hpcrl's."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        key = name.replace("_", "-")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        has_value = bool(eq) or (nxt is not None and not nxt.startswith("--") and nxt != "@")
        value = val if eq else nxt
        step = 1 if eq or not has_value else 2
        if not key.startswith("--") or tok == "@":
            out.append(tok)
            i += 1
        elif key == "--resume":
            out += ["--ckpt.resume-step", "-1"]
            i += 1
        elif key == "--resume.step":
            out += ["--ckpt.resume-step", str(value)]
            i += step
        elif key == "--resume.dir":
            out += ["--ckpt.warm-start", str(value), "--ckpt.warm-start-optimizer"]
            i += step
        elif key == "--weight-broadcast.type":
            if value not in _BROADCAST_TYPES:
                raise ConfigError(
                    "weight_broadcast.type", f"invalid value {value!r} (allowed: filesystem, nccl, nixl)"
                )
            out += ["--trainer.broadcast.transport", _BROADCAST_TYPES[str(value)]]
            i += step
        elif any(key == f or key.startswith(f + ".") for f in _NOTE_FLAGS):
            notes.append(
                f"{name}: "
                + (
                    "metrics.jsonl is always written here"
                    if "file" in key
                    else "a Prime platform monitor; ignored here"
                )
            )
            i += 1 if any(key == f for f in _NOTE_FLAGS) else step  # a bare table flag takes no value
        else:
            for old, new in _FLAG_PREFIXES:
                if key == old or key.startswith(old + "."):
                    tok = new + key[len(old) :] + (f"={val}" if eq else "")
                    break
            out.append(tok)
            i += 1
    return out


# ---------------------------------------------------------------------------------------------
# split role files
# ---------------------------------------------------------------------------------------------
# prime-rl's top-level tables that stay at the top (translated by `translate`), besides hpcrl's own.
_PRIME_TOP = ("monitors", "weight_broadcast", "env_vars", "resume", "clean", "run")
# In an inference role file, these are the inference section's (prime-rl's InferenceConfig).
_INFERENCE_TOP = {"vllm": "vllm", "server": "server"}


def split_role_file(
    d: dict[str, Any], role: str, top_fields: tuple[str, ...], source: str, notes: list[str]
) -> dict[str, Any]:
    """A prime-rl role file (its keys at the top level, as in k8s's train.toml / orch.toml /
    infer.toml) read by `hpcrl <role>`: every key that is not a run-wide field moves under [role].
    A file already in hpcrl's shape (run-wide fields and role tables only) comes back unchanged."""
    if role not in ("trainer", "orchestrator", "inference"):
        return d
    keep = set(top_fields) | set(_PRIME_TOP)
    moved = [k for k in d if k not in keep and k not in ("trainer", "orchestrator", "inference")]
    if role == "inference":
        dep = d.get("deployment")
        if isinstance(dep, dict) and dep.get("type") not in (None, "single_node", "multi_node"):
            moved.append("deployment")  # prime-rl's inference deployment (prefill / decode)
    if not moved:
        return d
    out = {k: v for k, v in d.items() if k not in moved}
    section = dict(out.get(role) or {})
    for k in moved:
        target = _INFERENCE_TOP.get(k, k) if role == "inference" else k
        if target in section and section[target] != d[k]:
            raise ConfigError(f"{role}.{target}", f"set twice in {source} (top level and [{role}])")
        section[target] = d[k]
    out[role] = section
    notes.append(f"{source}: a prime-rl {role} file: {', '.join(moved)} read as [{role}] fields")
    return out


# ---------------------------------------------------------------------------------------------
# `evals` configs (prime-rl's EvalsConfig) for `hpcrl eval`
# ---------------------------------------------------------------------------------------------
_EVAL_DROPPED = ("interval", "skip_first_step", "retrigger_on_resume", "env_server_base_port")


def translate_eval(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """prime-rl's evals shape: `model = "..."`, [eval.client], [eval.concurrency], [[eval.source]],
    eval.num_examples / group_size / sampling, as `hpcrl eval`'s fields."""
    mon = d.pop("monitors", None)
    if mon:
        notes.append(f"{source}: [monitors]: hpcrl eval writes results.jsonl and summary.json (no monitors)")
    ev = _table(d, ["eval"])
    if ev is None:
        return
    d.pop("eval")
    for k, v in ev.items():
        if k == "client":
            d["client"] = deep_merge(_table(d, ["client"]) or {}, v)
        elif k == "concurrency":
            top = (v or {}).get("max_inflight")
            if top is not None:
                set_path(d, ["client", "max_concurrent"], top)
        elif k == "num_examples":
            d["num_examples"] = v
        elif k == "group_size":
            d["rollouts_per_example"] = v
        elif k == "sampling":
            sampling = dict(v or {})
            if "max_completion_tokens" in sampling:
                sampling["max_tokens"] = sampling.pop("max_completion_tokens")
            d["sampling"] = deep_merge(_table(d, ["sampling"]) or {}, sampling)
        elif k == "source":
            if not isinstance(v, list) or not all(isinstance(s, dict) for s in v):
                raise ConfigError("eval.source", "expected a list of tables ([[eval.source]])")
            shim = {"orchestrator": {"eval": {}}}
            d["env"] = list(d.get("env") or []) + [
                source_to_env(s, f"eval.source[{i}]", "eval", shim) for i, s in enumerate(v)
            ]
        elif k in _EVAL_DROPPED:
            notes.append(f"{source}: eval.{k}: for evaluations during training; a standalone eval runs once")
        else:
            raise ConfigError(f"eval.{k}", "unknown field of prime-rl's evals config here")
