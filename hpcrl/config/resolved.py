"""Resolved configs on disk: per-process TOML files under <output_dir>/configs/.

The files hold no secret and no redaction either: a literal secret becomes a `${env:HPCRL_SECRET_...}`
reference and its value travels in the children's environment (hpcrl.config.secrets), so the
roles start from exactly the values the user gave. `redact` is for what people read (logs, W&B).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config import secrets
from hpcrl.config.schema import Config
from hpcrl.fileio import write_text

REDACTED = "***"

ROLES = ("trainer", "orchestrator", "inference")


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """Struct -> plain dict without None values (TOML has no null). Shared fields appear once, at the
    top level: the copies the loader flowed into sections are dropped, so a resolved file reloads
    with overrides (`hpcrl resume --max-steps 40`) instead of conflicting with its own copies."""
    d = _strip_none(msgspec.to_builtins(cfg))
    if isinstance(cfg, Config):
        for sec in ("trainer", "orchestrator", "inference"):
            part = d.get(sec, {})
            for key in ("max_steps",):
                part.pop(key, None)
            model = part.get("model")
            if isinstance(model, dict):
                top = d.get("model", {})
                for key in [k for k, v in model.items() if k == "name" or top.get(k) == v]:
                    del model[key]  # flowed from [model]: the reload flows it again
                if not model:
                    part.pop("model")
    return d


def _strip_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _strip_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_strip_none(x) for x in v if x is not None]
    return v


def redact(v: Any, key: str = "") -> Any:
    """For people only (logs, summaries, W&B): blank out values whose key looks secret and secrets
    inside free-form strings. `${env:NAME}` references stay (they name a variable, not a value).
    Never apply this to a config a role starts from."""
    if isinstance(v, dict):
        return {k: redact(x, k) for k, x in v.items()}
    if isinstance(v, list):
        return [redact(x, key) for x in v]
    if not isinstance(v, str) or secrets.is_ref(v):
        return v
    if secrets.is_secret_key(key):
        return REDACTED
    v = secrets.INLINE_SECRET_RE.sub(
        lambda m: m.group(0) if "${env:" in m.group(0) else f"{m.group(1)}{m.group(2)}{REDACTED}{m.group(2)}",
        v,
    )
    return secrets.KEY_PREFIX_RE.sub(REDACTED, v)


def role_dict(cfg: Config, role: str) -> dict[str, Any]:
    """The config one process is started with. Every role gets the whole resolved config: roles read
    each other's sections (the trainer needs the orchestrator's mode and async level), and one
    validated whole is what makes the per-process files consistent. Literal secrets are references
    here; `secret_env` gives their values for the process environment."""
    assert role in ROLES, role
    return secrets.externalize(to_dict(cfg))[0]


def secret_env(cfg: msgspec.Struct) -> dict[str, str]:
    """{HPCRL_SECRET_<PATH>: value} for every literal secret of the config: what a launcher puts in
    its children's environment (the files under configs/ reference these names)."""
    return secrets.externalize(to_dict(cfg))[1]


def dumps(d: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(d)


def write_resolved(cfg: msgspec.Struct, configs_dir: Path) -> list[Path]:
    """Write resolved.toml (everything) and one file per role (RL) or sft.toml (SFT); atomic per file."""
    configs_dir.mkdir(parents=True, exist_ok=True)
    out = []
    full = secrets.externalize(to_dict(cfg))[0]
    if isinstance(cfg, Config):
        items = [("resolved", full)] + [(r, role_dict(cfg, r)) for r in ROLES]
    else:
        items = [("sft", full)]
    for name, d in items:
        path = configs_dir / f"{name}.toml"
        write_text(path, dumps(d))
        out.append(path)
    return out
