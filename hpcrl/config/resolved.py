"""Resolved configs on disk: per-process TOML files under <output_dir>/configs/, secrets redacted."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config.schema import Config

_SECRET_RE = re.compile(r"(api_key|apikey|token|secret|password|auth_key)$", re.IGNORECASE)
REDACTED = "***"

# Which top-level sections each process needs (shared scalars always go along).
ROLE_SECTIONS = {
    "trainer": ("model", "trainer", "deployment", "ckpt", "wandb", "log"),
    "orchestrator": ("model", "orchestrator", "deployment", "ckpt", "wandb", "log"),
    "inference": ("model", "inference", "server", "log"),
}
_SCALARS = ("name", "type", "max_steps", "seq_len", "output_dir", "seed", "deterministic")


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """Struct -> plain dict without None values (TOML has no null)."""
    return _strip_none(msgspec.to_builtins(cfg))


def _strip_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _strip_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_strip_none(x) for x in v if x is not None]
    return v


def redact(v: Any, key: str = "") -> Any:
    """Blank out values whose key looks secret; env_files keep their paths but never their contents."""
    if isinstance(v, dict):
        return {k: redact(x, k) for k, x in v.items()}
    if isinstance(v, list):
        return [redact(x, key) for x in v]
    if key and _SECRET_RE.search(key) and isinstance(v, str) and not key.endswith("_var"):
        return REDACTED
    return v


def role_dict(cfg: Config, role: str) -> dict[str, Any]:
    full = redact(to_dict(cfg))
    keep = set(_SCALARS) | set(ROLE_SECTIONS[role])
    return {k: v for k, v in full.items() if k in keep}


def dumps(d: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(d)


def write_resolved(cfg: Config, configs_dir: Path) -> list[Path]:
    """Write resolved.toml (everything) and one file per role; atomic per file."""
    configs_dir.mkdir(parents=True, exist_ok=True)
    out = []
    items = [("resolved", redact(to_dict(cfg)))] + [(r, role_dict(cfg, r)) for r in ROLE_SECTIONS]
    for name, d in items:
        path = configs_dir / f"{name}.toml"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(dumps(d))
        os.replace(tmp, path)
        out.append(path)
    return out


def load_env_files(paths: list[str]) -> dict[str, str]:
    """Read KEY=VALUE secrets files into os.environ (values are never logged or written)."""
    from hpcrl.config.errors import ConfigError

    loaded: dict[str, str] = {}
    for i, p in enumerate(paths):
        f = Path(p)
        if not f.is_file():
            raise ConfigError(f"env_files[{i}]", f"'{p}' not found")
        for n, line in enumerate(f.read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ConfigError(f"env_files[{i}]", f"{p} line {n}: expected KEY=VALUE")
            k, v = line.split("=", 1)
            loaded[k.strip().removeprefix("export ").strip()] = v.strip().strip("'\"")
    os.environ.update(loaded)
    return loaded
