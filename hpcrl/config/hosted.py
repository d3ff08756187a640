"""Translate the hosted (flat) config shape and the `type = "full_finetune"` shape into the native shape.

Hosted shape (seed 002): top-level `model = "id"`, batch_size, rollouts_per_example, learning_rate,
lora_alpha, ..., `[sampling]`, `[[env]]`, `[eval]` + `[[eval.env]]`, `[val]`, `[buffer]`, `[checkpoints]`,
`[adapters]`, `[wandb]`. Hosted runs train a LoRA adapter, so the translation enables `model.lora`.
Platform-only fields are accepted and reported as ignored, never dropped silently.
"""

from __future__ import annotations

from typing import Any

from hpcrl.config.dicts import deep_merge
from hpcrl.config.errors import ConfigError

# Top-level keys only the hosted platform understands: accepted, reported, ignored.
PLATFORM_ONLY = ("tailscale", "infrastructure", "image_tag")
_HOSTED_MARKERS = ("batch_size", "rollouts_per_example", "env", "sampling", "learning_rate", "lora_alpha",
                   "oversampling_factor", "trajectory_strategy", "checkpoints", "adapters", "env_file",
                   "checkpoint_id", "buffer", "val", "eval", "max_async_level")


def is_hosted(d: dict[str, Any]) -> bool:
    if isinstance(d.get("model"), str):
        return True
    return any(k in d for k in ("batch_size", "rollouts_per_example", "env", "sampling", "learning_rate"))


def to_native(d: dict[str, Any], source: str = "") -> tuple[dict[str, Any], list[str]]:
    """Return (native dict, notes). Native configs pass through (platform-only keys still reported)."""
    notes: list[str] = []
    d = dict(d)
    for key in PLATFORM_ONLY:
        if key in d:
            d.pop(key)
            notes.append(f"{source}: [{key}] is a hosted-platform setting; ignored here")
    if d.get("type") == "full_finetune":
        notes.append(f"{source}: type = \"full_finetune\" (native shape): trains all weights")
    if not is_hosted(d):
        return d, notes
    notes.append(f"{source}: hosted (flat) config shape detected; translated to the native shape")
    return _translate(d, source, notes), notes


def _take(d: dict[str, Any], key: str, default: Any = None) -> Any:
    return d.pop(key) if key in d else default


def _env_list(envs: Any, path: str) -> list[dict[str, Any]]:
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
        native["model"] = {"name": model} if isinstance(model, str) else model
    for key in ("max_steps", "seq_len", "name", "output_dir", "seed"):
        if key in d:
            native[key] = d.pop(key)
    for key in ("batch_size", "rollouts_per_example", "oversampling_factor", "max_async_level",
                "trajectory_strategy", "max_off_policy_steps"):
        if key in d:
            orch[key] = d.pop(key)

    # Hosted training is LoRA training: learning_rate / lora_alpha are the adapter's.
    lr = _take(d, "learning_rate", 1e-4)
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
        train["sampling"] = d.pop("sampling")
    if "env" in d:
        train["env"] = _env_list(d.pop("env"), "env")
    orch["train"] = train
    if "eval" in d:
        ev = dict(d.pop("eval"))
        if "env" in ev:
            ev["env"] = _env_list(ev["env"], "eval.env")
        orch["eval"] = ev
    if "val" in d:
        orch["val"] = d.pop("val")
    if "buffer" in d:
        orch["buffer"] = d.pop("buffer")
    if "checkpoints" in d:
        cp = dict(d.pop("checkpoints"))
        if "keep_cloud" in cp:
            cp.pop("keep_cloud")
            notes.append(f"{source}: checkpoints.keep_cloud is a hosted-platform setting; ignored here")
        if "interval" in cp:
            ckpt["interval"] = cp.pop("interval")
        if cp:
            raise ConfigError(f"checkpoints.{next(iter(cp))}", "unknown field (allowed: interval, keep_cloud)")
        ckpt.setdefault("interval", None)
    if "adapters" in d:
        ad = dict(d.pop("adapters"))
        ckpt["save_adapter_separately"] = True
        if "interval" in ad:
            ckpt["adapter_interval"] = ad.pop("interval")
        if "keep_last" in ad:
            ad.pop("keep_last")
            notes.append(f"{source}: adapters.keep_last is a hosted-platform setting; ignored here")
        if ad:
            raise ConfigError(f"adapters.{next(iter(ad))}", "unknown field (allowed: interval, keep_last)")
    if ckpt:
        native["ckpt"] = {k: v for k, v in ckpt.items() if v is not None}
    if "wandb" in d:
        native["wandb"] = d.pop("wandb")
    native["orchestrator"] = orch
    # Anything left is either native (trainer, inference, ...) or a mistake the schema will name.
    return deep_merge(native, d)
