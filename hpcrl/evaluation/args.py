"""Command lines of `hpcrl eval` and `hpcrl gepa run`: vf-eval / `prime gepa run` short flags and
positional environment ids on top of the ordinary config loader (files, `@`, dotted flags).

    hpcrl eval ENV_ID [ENV_ID ...] -m MODEL -n 8 -r 3 [-a JSON] [-b URL] [--sampling.temperature 0.7]
    hpcrl gepa run ENV_ID -m MODEL -M REFLECTION_MODEL -B 300 -n 50 -N 20 --state-columns answer

Short flags become a nested dict that the loader applies after the dotted flags; every mistake is a
ConfigError naming the field.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from hpcrl.config import fields
from hpcrl.config.dicts import set_path
from hpcrl.config.loader import Loaded
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load

# flag -> dotted field (value flags). Long forms that are already config fields need no entry.
COMMON = {
    "-m": "model",
    "-b": "client.base_url",
    "--api-base-url": "client.base_url",
    "-t": "sampling.max_tokens",
    "--max-tokens": "sampling.max_tokens",
    "-T": "sampling.temperature",
    "--temperature": "sampling.temperature",
    "-k": "client.api_key_var",
    "--api-key-var": "client.api_key_var",
}
EVAL_FLAGS = {**COMMON, "-n": "num_examples", "-r": "rollouts_per_example"}
GEPA_FLAGS = {
    **COMMON,
    "-M": "gepa.reflection_model",
    "--reflection-model": "gepa.reflection_model",
    "-B": "gepa.max_calls",
    "--max-calls": "gepa.max_calls",
    "-n": "gepa.num_train",
    "--num-train": "gepa.num_train",
    "-N": "gepa.num_val",
    "--num-val": "gepa.num_val",
    "--minibatch-size": "gepa.minibatch_size",
    "--perfect-score": "gepa.perfect_score",
    "--state-columns": "gepa.state_columns",
}
ENV_ARGS_FLAGS = ("-a", "--env-args")


def _is_value_flag(root: type, tok: str) -> bool:
    """Does the dotted flag `tok` (no `=`) take the next token as its value?"""
    name = tok[2:]
    if name.startswith("no-"):
        return False
    try:
        leaf = fields.resolve(root, [p.replace("-", "_") for p in name.split(".")])
    except ConfigError:
        return False  # the loader reports it
    return leaf.kind == "value"


def split_argv(argv: list[str], root: type, short: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """(argv for the loader, overrides from positionals and short flags)."""
    rest: list[str] = []
    extra: dict[str, Any] = {}
    envs: list[str] = []
    env_args: dict[str, Any] | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, inline = tok.partition("=")
        if name in short or name in ENV_ARGS_FLAGS:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                raise ConfigError(short.get(name, "env.args"), f"{name} needs a value")
            if name in ENV_ARGS_FLAGS:
                env_args = _json_args(value)
            else:
                set_path(extra, short[name].split("."), _value(short[name], value))
            continue
        if tok == "@" or (tok.startswith("--") and not eq and _is_value_flag(root, tok)):
            rest += argv[i : i + 2]
            i += 2
            continue
        if tok.startswith("-") or tok.startswith("@") or tok.endswith(".toml"):
            rest.append(tok)
        else:
            envs.append(tok)
        i += 1
    if env_args is not None and not envs:
        raise ConfigError("env.args", "-a applies to the ENV_IDs given on the command line; none was given")
    if envs:
        extra["env"] = [{"id": e, "args": dict(env_args or {})} for e in envs]
    return rest, extra


def _json_args(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("env.args", f"-a expects a JSON object, got {text!r} ({e.msg})") from None
    except RecursionError:  # json nests by recursion: a few thousand brackets exhaust the stack
        raise ConfigError(
            "env.args", "-a expects a JSON object nested at most a few hundred levels"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError("env.args", f"-a expects a JSON object, got {type(value).__name__}")
    return value


def _value(path: str, raw: str) -> Any:
    """Lists come comma-separated (--state-columns a,b); everything else is converted by the loader."""
    if path == "gepa.state_columns":
        return [c.strip() for c in raw.split(",") if c.strip()]
    return raw


def slug(text: str) -> str:
    """A directory-name-safe form of an env id or model name."""
    text = text.rstrip("/")
    if "/" in text and Path(text).exists():  # a local dir: its last parts (e.g. run/weights/step_8)
        text = "-".join(Path(text).parts[-2:])
    return re.sub(r"[^A-Za-z0-9._-]+", "--", text).strip("-") or "x"


def default_output_dir(command: str, cfg: Any, stamp: bool) -> str:
    envs = "+".join(slug(e.name or e.id) for e in cfg.env)
    out = f"outputs/{command}/{envs}--{slug(cfg.model)}"
    return out + time.strftime("/%Y%m%d-%H%M%S") if stamp else out


def load_run(argv: list[str], root: type, short: dict[str, str]) -> Loaded:
    """Resolve `hpcrl eval` / `hpcrl gepa` arguments into a typed config and check what the schema
    cannot: a model and at least one environment (exactly one for gepa), valid env arguments."""
    from hpcrl.envs import validate_env_spec

    rest, extra = split_argv(argv, root, short)
    loaded = load(rest, root, extra=extra)
    cfg = loaded.config
    if not cfg.model:
        raise ConfigError("model", "required: give -m MODEL (or model = ... in the config file)")
    if not cfg.env:
        raise ConfigError("env", "required: give an ENV_ID (or [[env]] tables in the config file)")
    names = [e.name or e.id.rsplit("/", 1)[-1] for e in cfg.env]
    if len(set(names)) != len(names):
        raise ConfigError("env", f"environment names must be unique, got {names} (set env[i].name)")
    for i, e in enumerate(cfg.env):
        if e.env:  # a prime-rl source: its taskset, or hpcrl's env of that name (hpcrl.envs.sources)
            from hpcrl.envs.registry import v1_module
            from hpcrl.envs.sources import source_fallback

            if v1_module(e.id) is None:
                cfg.env[i] = e = source_fallback(e, f"env[{i}]", loaded.notes)
        try:
            validate_env_spec(e.id, e.args)
        except ValueError as err:
            raise ConfigError(f"env[{i}]", str(err)) from None
    return loaded


def print_dry_run(loaded: Loaded) -> None:
    """`hpcrl eval --dry-run`: the model checks (hpcrl.launch.dry_run) and what the eval would run;
    writes nothing, starts no server and no environment."""
    from hpcrl.launch.dry_run import model_lines

    cfg = loaded.config
    checks = model_lines(cfg)  # before any line: a refusal is the only output
    inf = cfg.inference
    endpoint = cfg.client.base_url or (
        f"hpcrl inference started here for the model (backend {inf.backend}, dtype {inf.dtype}, "
        f"max_model_len {inf.max_model_len or cfg.seq_len})"
    )
    envs = ", ".join(e.name or e.id for e in cfg.env)
    out = cfg.output_dir or default_output_dir("evals", cfg, stamp=False) + "/<time>"
    lines = [
        "hpcrl eval: dry run OK",
        f"model:        {cfg.model}"
        + (f" (tokenizer {cfg.client.tokenizer})" if cfg.client.tokenizer else ""),
        f"endpoint:     {endpoint}",
        f"envs:         {envs}",
        f"rollouts:     {cfg.num_examples if cfg.num_examples >= 0 else 'all'} example(s) x {cfg.rollouts_per_example} "
        f"per env ({cfg.split} split), max_tokens {cfg.sampling.max_tokens}",
        f"output:       {out}",
        *checks,
        *(f"note:         {n}" for n in loaded.notes),
    ]
    print("\n".join(lines))
