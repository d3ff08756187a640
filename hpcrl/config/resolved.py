"""Resolved configs on disk: per-process TOML files under <output_dir>/configs/, secrets redacted."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config.schema import Config

_SECRET_RE = re.compile(
    r"(api_?key|secret|password|passwd|auth_key|access_token|auth_token|api_token|hf_token|^token)$", re.IGNORECASE
)
REDACTED = "***"
# Secrets inside free-form strings (slurm.setup lines, env args): `export HF_TOKEN=hf_...` keeps the
# name and loses the value; well-known key prefixes are blanked wherever they appear.
_INLINE_SECRET_RE = re.compile(
    r"(\b[A-Za-z0-9_]*(?:API_KEY|APIKEY|TOKEN|SECRET|PASSWORD|AUTH_KEY)\s*[=:]\s*)(['\"]?)[^\s'\"]+\2",
    re.IGNORECASE,
)
_KEY_PREFIX_RE = re.compile(r"\b(?:sk-[A-Za-z0-9_\-]{16,}|hf_[A-Za-z0-9]{16,}|tskey-[A-Za-z0-9\-]{8,}|wandb_v1_\w{16,})")

ROLES = ("trainer", "orchestrator", "inference")


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """Struct -> plain dict without None values (TOML has no null). Shared fields appear once, at the
    top level: the copies the loader flowed into sections are dropped, so a resolved file reloads
    with overrides (`hpcrl resume --max-steps 40`) instead of conflicting with its own copies."""
    d = _strip_none(msgspec.to_builtins(cfg))
    if isinstance(cfg, Config):
        for sec in ("trainer", "orchestrator", "inference"):
            part = d.get(sec, {})
            for key in ("max_steps", "seq_len"):
                part.pop(key, None)
            model = part.get("model")
            if isinstance(model, dict):
                model.pop("name", None)
                if model == {k: v for k, v in d.get("model", {}).items() if k != "name"}:
                    part.pop("model")  # an unchanged copy of [model]
    return d


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
    if isinstance(v, str):
        return _KEY_PREFIX_RE.sub(REDACTED, _INLINE_SECRET_RE.sub(rf"\1\2{REDACTED}\2", v))
    return v


def role_dict(cfg: Config, role: str) -> dict[str, Any]:
    """The config one process is started with. Every role gets the whole resolved config: roles read
    each other's sections (the trainer needs the orchestrator's mode and async level), and one
    validated whole is what makes the per-process files consistent."""
    assert role in ROLES, role
    return redact(to_dict(cfg))


def dumps(d: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(d)


def write_resolved(cfg: msgspec.Struct, configs_dir: Path) -> list[Path]:
    """Write resolved.toml (everything) and one file per role (RL) or sft.toml (SFT); atomic per file."""
    configs_dir.mkdir(parents=True, exist_ok=True)
    out = []
    full = redact(to_dict(cfg))
    if isinstance(cfg, Config):
        items = [("resolved", full)] + [(r, role_dict(cfg, r)) for r in ROLES]
    else:
        items = [("sft", full)]
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
