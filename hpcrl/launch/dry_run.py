"""What every --dry-run checks beyond the config: each model the command names and the datasets of an
SFT config, found where the role will look for them at start, without building, downloading or
reading anything.

    model_lines(cfg, role, at)   one line per model (hpcrl.models.resolve.locate_model: a local
                                 directory, a built-in, the Hugging Face cache, or "... it will be
                                 downloaded at start")
    dataset_lines(cfg, at)       the same for data.name / val.data.name
                                 (hpcrl.trainer.sft_data.locate_rows, the datasets cache)

What start would refuse is refused here, in one line naming the field: a directory without
config.json, an invalid Hub id, a Hub id or Hub dataset outside the cache under HF_HUB_OFFLINE=1.
Teacher models and an eval model served at `-b URL` are names at an endpoint: checked only when
they are local directories.
"""

from __future__ import annotations

import os
from typing import Any

from hpcrl.config.schema import Config, EvalRunConfig, SFTConfig
from hpcrl.errors import ConfigError

RL_ROLES = ("trainer", "orchestrator", "inference")
# Frozen models' names at an endpoint (base_url): hpcrl loads them only when they are local directories.
TEACHER_FIELDS = (
    "orchestrator.algo.teacher.name",
    "orchestrator.algo.sampling.source.name",
)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def role_model(cfg: Config, role: str) -> tuple[str, str]:
    """(field, name) of the model `role` loads: its own section's name, else [model]'s. The field is
    `model.name` when the name is the shared one (what the user wrote), else the role's own."""
    top = cfg.model.name or ""
    name = _get(cfg, f"{role}.model.name") or top
    return ("model.name" if name == top else f"{role}.model.name"), name


def model_names(cfg: Any, role: str | None = None) -> list[tuple[str, str, bool]]:
    """(field, name, local_only) of every model the command loads: `role` of an RL config
    (trainer | orchestrator | inference), every role when None; SFT's model; eval's -m (the
    tokenizer's name, and the model a self-started server loads)."""
    if isinstance(cfg, SFTConfig):
        return [("model.name", cfg.model.name or "", False)]
    if isinstance(cfg, EvalRunConfig):
        out = [
            ("model", cfg.model or "", cfg.client.base_url is not None and cfg.client.tokenizer is not None)
        ]
        if cfg.client.tokenizer:
            out.append(("client.tokenizer", cfg.client.tokenizer, False))
        return out
    roles = RL_ROLES if role is None else (role,)
    out = [(*role_model(cfg, r), False) for r in roles]
    if role in (None, "orchestrator"):
        out += [(f, n, True) for f in TEACHER_FIELDS if isinstance(n := _get(cfg, f), str) and n]
    return out


def model_lines(cfg: Any, role: str | None = None, at: str = "start") -> list[str]:
    """One line per distinct model of `cfg` (see model_names): where it will be found; ConfigError
    for what start would refuse."""
    from hpcrl.models.resolve import locate_model

    lines: list[str] = []
    seen: set[str] = set()
    for field, name, local_only in model_names(cfg, role):
        if name in seen or (local_only and not os.path.isdir(name)):
            continue
        seen.add(name)
        where, path = locate_model(name, field)
        if where == "local":
            lines.append(f"{field}: {name} is a local model directory")
        elif where == "builtin":
            made = f"built in {path}" if path else "built locally on first use"
            lines.append(f"{field}: {name} is a built-in model ({made})")
        elif where == "cached":
            lines.append(f"{field}: {name} is in the Hugging Face cache ({path})")
        else:
            lines.append(f"{field}: {name} is not in the Hugging Face cache: it will be downloaded at {at}")
    return lines


def dataset_lines(cfg: SFTConfig, at: str = "start") -> list[str]:
    """One line per dataset an SFT run reads (data.name; val.data.name when validation uses it)."""
    named = [] if cfg.data.type == "fake" else [("data.name", cfg.data.name)]  # fake rows: no dataset
    if cfg.val.interval > 0 and cfg.val.data is not None:
        named.append(("val.data.name", cfg.val.data.name))
    return [_dataset_line(field, name, at) for field, name in named]


def _dataset_line(field: str, name: str, at: str) -> str:
    from hpcrl.trainer import sft_data

    kind, _ = sft_data.locate_rows(name, field)  # DataError: one line naming the field
    if kind != "hub":
        return {
            "file": f"{field}: {name} is a local data file",
            "dir": f"{field}: {name} is a local directory of data files",
            "saved": f"{field}: {name} is a saved Hugging Face dataset",
            "missing": f"{field}: {name} does not exist yet: start fails unless it is written first",
        }[kind]
    if sft_data.hub_dataset_cached(name, field):
        return f"{field}: {name} is in the Hugging Face datasets cache"
    if _datasets_offline():
        raise ConfigError(
            field,
            f"'{name}' is not a local path and not in the Hugging Face datasets cache (offline: "
            "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); load it once with network first",
        )
    return f"{field}: {name} is not in the Hugging Face cache: it will be downloaded at {at}"


def _datasets_offline() -> bool:
    """The datasets package's rule: HF_DATASETS_OFFLINE when set, else HF_HUB_OFFLINE."""
    from hpcrl.models.hub import offline

    value = os.environ.get("HF_DATASETS_OFFLINE")
    return offline() if value is None else value.strip().upper() in ("1", "ON", "YES", "TRUE")
