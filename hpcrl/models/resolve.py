"""Model names -> model directories, for every role: a local directory, a built-in tiny model
(built into the hpcrl cache on first use, hpcrl/models/tiny.py) or a Hub id (its snapshot in the
Hugging Face cache, hpcrl/models/hub.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from hpcrl.errors import ConfigError
from hpcrl.models.names import BUILTIN_MODELS
from hpcrl.models.tiny import KIT_VERSION, build_tiny_model


def cache_root() -> Path:
    return Path(os.environ.get("HPCRL_CACHE") or Path.home() / ".cache" / "hpcrl")


def is_current(path: Path) -> bool:
    try:
        stamp = json.loads((path / "hpcrl_tiny.json").read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("kit_version") == KIT_VERSION and (path / "config.json").exists()


def _unset(field: str) -> ConfigError:
    return ConfigError(field, "is not set (a Hub id, a local model directory or hpcrl/tiny-qwen3)")


def resolve_model(name: str, field: str = "model.name") -> str:
    """The one place a model name becomes a directory. Directory -> itself; built-in name -> cached build (made on first use); else a Hub id ->
    its snapshot in the Hugging Face cache (hpcrl.models.hub; downloaded unless HF_HUB_OFFLINE=1).
    An unusable name is a ConfigError naming ``field``."""
    if os.path.isdir(name):
        return name
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None:
        if not name:
            raise _unset(field)
        from hpcrl.models.hub import resolve_hub

        return resolve_hub(name, field=field)
    import fcntl

    models_dir = cache_root() / "models"
    target = models_dir / name
    if is_current(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = models_dir / (name.replace("/", "__") + ".lock")
    with open(lock_path, "w") as lock:
        # Several processes (servers, trainer ranks) may start at once: one builds, the others wait
        # and then see the finished directory. Build in a temp dir + rename so nobody sees half of it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_current(target):
                return str(target)
            from hpcrl.fileio import atomic_dir

            with atomic_dir(target) as tmp:  # replaces a stale build from an older kit version
                preset, _, template = builtin.partition(":")
                build_tiny_model(tmp, preset=preset, seed=0, template=template or "chatml")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(target)


Where = Literal["local", "builtin", "cached", "download"]


def locate_model(name: str, field: str = "model.name") -> tuple[Where, str | None]:
    """Where ``resolve_model`` will find ``name`` at start, found without building or downloading
    anything (--dry-run): ("local", dir), ("builtin", its build or None before the first use),
    ("cached", Hugging Face snapshot) or ("download", None). A ConfigError naming ``field`` for what
    start would refuse: no name, a local directory without config.json, an invalid Hub id, a Hub id
    outside the cache under HF_HUB_OFFLINE=1."""
    if os.path.isdir(name):
        if not (Path(name) / "config.json").is_file():
            raise ConfigError(field, f"'{name}' is a directory without config.json: not a Hugging Face model")
        return "local", name
    if name in BUILTIN_MODELS:
        built = cache_root() / "models" / name
        return "builtin", str(built) if is_current(built) else None
    if not name:
        raise _unset(field)
    from hpcrl.models import hub

    snapshot = hub.cached_snapshot(name, field=field)
    if snapshot is not None:
        return "cached", snapshot
    if hub.offline():
        raise hub.not_cached_offline(name, field)
    return "download", None
