"""Translate the hosted (flat) config shape and the `type = "full_finetune"` shape into the native shape.

Hosted shape (seed 002): top-level `model = "id"`, batch_size, rollouts_per_example, learning_rate,
lora_alpha, ..., `[sampling]`, `[[env]]`, `[eval]` + `[[eval.env]]`, `[val]`, `[buffer]`, `[checkpoints]`,
`[adapters]`, `[wandb]`. Hosted runs train a LoRA adapter, so the translation enables `model.lora`.
Platform-only fields are accepted and reported as ignored, never dropped silently.
"""

from __future__ import annotations

from typing import Any

from hpcrl.config import fields, selfhosted
from hpcrl.config.dicts import deep_merge
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError, nearest, show_key

# Top-level keys only the hosted platform understands: accepted, reported, ignored.
PLATFORM_ONLY = ("tailscale", "infrastructure", "image_tag")
_HOSTED_MARKERS = (
    "batch_size",
    "rollouts_per_example",
    "env",
    "sampling",
    "learning_rate",
    "lora_alpha",
    "oversampling_factor",
    "trajectory_strategy",
    "checkpoints",
    "adapters",
    "env_file",
    "checkpoint_id",
    "buffer",
    "val",
    "eval",
    "max_async_level",
)
HOSTED_KEYS = ("model", "max_steps", "wandb", "max_off_policy_steps") + _HOSTED_MARKERS + PLATFORM_ONLY


# Defaults the hosted docs state for fields whose native default differs (applied when absent).
HOSTED_DEFAULTS = {"learning_rate": 1e-4, "oversampling_factor": 2.0, "max_async_level": 2}
# The hosted shape has no seq_len; a run translated from it gets prime-rl's default (see loader).
HOSTED_SEQ_LEN = 2048
# Where hosted paths land in the native shape (for error messages that name both).
_NATIVE_TO_HOSTED = (
    ("orchestrator.train.sampling", "sampling"),
    ("orchestrator.train.env", "env"),
    ("orchestrator.eval", "eval"),
    ("orchestrator.val", "val"),
    ("orchestrator.buffer", "buffer"),
    ("orchestrator.batch_size", "batch_size"),
    ("orchestrator.rollouts_per_example", "rollouts_per_example"),
    ("orchestrator.oversampling_factor", "oversampling_factor"),
    ("orchestrator.max_async_level", "max_async_level"),
    ("orchestrator.trajectory_strategy", "trajectory_strategy"),
    ("trainer.optim.lr", "learning_rate"),
    ("model.lora.alpha", "lora_alpha"),
    ("model.name", "model"),
    ("env_files", "env_file"),
    ("ckpt.warm_start", "checkpoint_id"),
    ("ckpt.interval", "checkpoints.interval"),
    ("ckpt.adapter_interval", "adapters.interval"),
)


def hosted_path(native: str) -> str | None:
    """The hosted-shape spelling of a native dotted path, or None when it has none."""
    for nat, host in _NATIVE_TO_HOSTED:
        if native == nat or native.startswith(nat + ".") or native.startswith(nat + "["):
            return host + native[len(nat) :]
    return None


def apply_defaults(merged: dict[str, Any], notes: list[str]) -> None:
    """Fill the hosted docs' defaults into a merged native dict where nothing (file or flag) set them."""
    orch = merged.setdefault("orchestrator", {})
    trainer = merged.setdefault("trainer", {})
    if not isinstance(orch, dict) or not isinstance(trainer, dict):
        return  # a scalar where a table belongs: conversion names it
    for key in ("oversampling_factor", "max_async_level"):
        orch.setdefault(key, HOSTED_DEFAULTS[key])
    optim = trainer.setdefault("optim", {})
    if isinstance(optim, dict):
        optim.setdefault("lr", HOSTED_DEFAULTS["learning_rate"])
    if "seq_len" not in merged and not any(
        isinstance(merged.get(s), dict) and "seq_len" in merged[s]
        for s in ("trainer", "orchestrator", "inference")
    ):
        train = orch.get("train")
        sampling = train.get("sampling") if isinstance(train, dict) else None
        max_tokens = sampling.get("max_tokens", 0) if isinstance(sampling, dict) else 0
        merged["seq_len"] = max(HOSTED_SEQ_LEN, max_tokens if isinstance(max_tokens, int) else 0)
        notes.append(f"seq_len not set (the hosted shape has none): using {merged['seq_len']}")


def is_hosted(d: dict[str, Any]) -> bool:
    if isinstance(d.get("model"), str):
        return True
    return any(k in d for k in ("batch_size", "rollouts_per_example", "env", "sampling", "learning_rate"))


def to_native(d: dict[str, Any], source: str = "") -> tuple[dict[str, Any], list[str]]:
    """Return (native dict, notes). Native configs pass through (platform-only keys still reported)."""
    notes: list[str] = []
    d = dict(d)
    workers = _compute_size(d, source, notes)
    out, notes = _to_native(d, source, notes)
    if workers is not None:
        orch = out.setdefault("orchestrator", {})
        if isinstance(orch, dict):
            orch.setdefault("env_workers", workers)
    return out, notes


# [infrastructure] compute_size: the CPU given to the user's environments -> env worker processes.
COMPUTE_SIZE_WORKERS = {"S": 1, "M": 2, "L": 4}


def _compute_size(d: dict[str, Any], source: str, notes: list[str]) -> int | None:
    infra = d.get("infrastructure")
    if not isinstance(infra, dict) or "compute_size" not in infra:
        return None
    infra = dict(infra)
    size = infra.pop("compute_size")
    if not isinstance(size, str) or size not in COMPUTE_SIZE_WORKERS:
        raise ConfigError("infrastructure.compute_size", f"expected S, M or L, got {size!r}")
    d["infrastructure"] = infra
    if not infra:
        del d["infrastructure"]
    notes.append(
        f"{source}: infrastructure.compute_size = {size!r}: {COMPUTE_SIZE_WORKERS[size]} env worker "
        "process(es) per environment (orchestrator.env_workers)"
    )
    return COMPUTE_SIZE_WORKERS[size]


def _to_native(d: dict[str, Any], source: str, notes: list[str]) -> tuple[dict[str, Any], list[str]]:
    for key in PLATFORM_ONLY:
        if key in d:
            shown = f"[{key}]" if isinstance(d.pop(key), dict) else key
            notes.append(f"{source}: {shown} is a hosted-platform setting; ignored here")
    if selfhosted.is_self_hosted(d):  # seed 004's model_name / num_gpus / [env] shape
        return selfhosted.translate(d, source, notes), notes
    if d.get("type") == "full_finetune":
        notes.append(f'{source}: type = "full_finetune" (native shape): trains all weights')
        _full_finetune_checkpointing(d, source, notes)
    if not is_hosted(d):
        return d, notes
    notes.append(f"{source}: hosted (flat) config shape detected; translated to the native shape")
    return _translate(d, source, notes), notes


def _full_finetune_checkpointing(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """The full_finetune shape checkpoints activations unless it says otherwise: its sizes (a 30B MoE
    at 32k tokens) do not fit a GPU without it (docs/memory.md: 339 vs 69 GiB per trainer rank at ep 8 with chunked logprobs), and
    the shape's docs leave memory to the platform. A later file or flag still turns it off."""
    trainer, model = d.get("trainer"), d.get("model")
    own = trainer.get("model") if isinstance(trainer, dict) else None
    if any(isinstance(t, dict) and "activation_checkpointing" in t for t in (own, model)):
        return
    if (trainer is not None and not isinstance(trainer, dict)) or (
        own is not None and not isinstance(own, dict)
    ):
        return  # a scalar where a table belongs: the shape check names it
    d.setdefault("trainer", {}).setdefault("model", {})["activation_checkpointing"] = True
    notes.append(
        f"{source}: full_finetune: activation checkpointing on (trainer.model.activation_checkpointing = false "
        "turns it off)"
    )


def _take(d: dict[str, Any], key: str, default: Any = None) -> Any:
    return d.pop(key) if key in d else default


def _table(value: Any, path: str) -> dict[str, Any]:
    """A hosted section must be a table ([path]); anything else is the user's one-line error."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a table ([{path}]), got {_kind(value)} {value!r}")
    return dict(value)


def _kind(value: Any) -> str:
    return {
        "list": "an array",
        "str": "a string",
        "int": "an integer",
        "float": "a float",
        "bool": "a boolean",
    }.get(type(value).__name__, f"a {type(value).__name__}")


def _env_list(envs: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(envs, dict):  # a single [env] table (seed 004's examples write one): one env
        envs = [envs]
    if not isinstance(envs, list):
        raise ConfigError(path, f"expected an array of tables ([[{path}]]), got {type(envs).__name__}")
    out = []
    for i, e in enumerate(envs):
        if not isinstance(e, dict):
            raise ConfigError(f"{path}[{i}]", "expected a table with id and args")
        out.append(dict(e))
    return out


def _translate(d: dict[str, Any], source: str, notes: list[str]) -> dict[str, Any]:
    native: dict[str, Any] = {}
    orch: dict[str, Any] = {}
    model = _take(d, "model")
    if model is not None:
        if not isinstance(model, (str, dict)):
            raise ConfigError(
                "model", f"expected a model name (string) or a [model] table, got {_kind(model)} {model!r}"
            )
        native["model"] = {"name": model} if isinstance(model, str) else model
    for key in ("trainer", "orchestrator", "inference"):
        if key in d and not isinstance(d[key], dict):
            _table(d[key], key)
    for key in ("max_steps", "seq_len", "name", "output_dir", "seed"):
        if key in d:
            native[key] = d.pop(key)
    for key in (
        "batch_size",
        "rollouts_per_example",
        "oversampling_factor",
        "max_async_level",
        "trajectory_strategy",
        "max_off_policy_steps",
    ):
        if key in d:
            orch[key] = d.pop(key)

    # Hosted training is LoRA training: learning_rate / lora_alpha are the adapter's.
    # (Defaults of the hosted docs are filled in by apply_defaults once every file is merged, so a
    # later hosted file cannot reset an earlier file's value to a default.)
    if "learning_rate" in d:
        lr = d.pop("learning_rate")
        optim = (d.get("trainer") or {}).get("optim")
        native_lr = optim.get("lr") if isinstance(optim, dict) else None
        if native_lr is not None and native_lr != lr:
            raise ConfigError(
                "trainer.optim.lr", f"{native_lr!r} conflicts with learning_rate = {lr!r} (set it once)"
            )
        native["trainer"] = {"optim": {"lr": lr}}
    lora: dict[str, Any] = {}
    if "lora_alpha" in d:
        lora["alpha"] = d.pop("lora_alpha")
    native.setdefault("model", {})["lora"] = lora

    env_file = _take(d, "env_file")
    if env_file is not None:
        native["env_files"] = [env_file] if isinstance(env_file, str) else env_file
    checkpoint_id = _take(d, "checkpoint_id")
    ckpt: dict[str, Any] = {}
    if checkpoint_id is not None:
        ckpt["warm_start"] = checkpoint_id
    train: dict[str, Any] = {}
    if "sampling" in d:
        train["sampling"] = _table(d.pop("sampling"), "sampling")
    if "env" in d:
        train["env"] = _env_list(d.pop("env"), "env")
    orch["train"] = train
    if "eval" in d:
        ev = _table(d.pop("eval"), "eval")
        if "env" in ev:
            ev["env"] = _env_list(ev["env"], "eval.env")
        orch["eval"] = ev
    if "val" in d:
        orch["val"] = _table(d.pop("val"), "val")
    if "buffer" in d:
        orch["buffer"] = _table(d.pop("buffer"), "buffer")
    if "checkpoints" in d:
        cp = _table(d.pop("checkpoints"), "checkpoints")
        if "keep_cloud" in cp:
            cp.pop("keep_cloud")
            notes.append(f"{source}: checkpoints.keep_cloud is a hosted-platform setting; ignored here")
        if "interval" in cp:
            ckpt["interval"] = cp.pop("interval")
        if cp:
            raise ConfigError(
                f"checkpoints.{show_key(next(iter(cp)))}", "unknown field (allowed: interval, keep_cloud)"
            )
        ckpt.setdefault("interval", None)
    if "adapters" in d:
        ad = _table(d.pop("adapters"), "adapters")
        ckpt["save_adapter_separately"] = True
        if "interval" in ad:
            ckpt["adapter_interval"] = ad.pop("interval")
        if "keep_last" in ad:
            ad.pop("keep_last")
            notes.append(f"{source}: adapters.keep_last is a hosted-platform setting; ignored here")
        if ad:
            raise ConfigError(
                f"adapters.{show_key(next(iter(ad)))}", "unknown field (allowed: interval, keep_last)"
            )
    if ckpt:
        native["ckpt"] = {k: v for k, v in ckpt.items() if v is not None}
    if "wandb" in d:
        wandb = d.pop("wandb")
        native["wandb"] = wandb if isinstance(wandb, bool) else _table(wandb, "wandb")
    native["orchestrator"] = orch
    # Anything left must be native (trainer, inference, ...); a stray top-level key is most likely
    # a misspelt hosted field, so suggest from both vocabularies.
    native_keys = fields.field_names(Config, [])
    for key in d:
        if key not in native_keys:
            raise ConfigError(
                show_key(key), f"unknown field in top level{nearest(key, HOSTED_KEYS + tuple(native_keys))}"
            )
    return deep_merge(native, d)
