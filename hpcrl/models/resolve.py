"""Model names -> model directories, for every role: a local directory, a built-in tiny model
(built into the hpcrl cache on first use, hpcrl/models/tiny.py) or a Hub id (its snapshot in the
Hugging Face cache, hpcrl/models/hub.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def resolve_model(name: str, field: str = "model.name") -> str:
    """The one place a model name becomes a directory. Directory -> itself; built-in name -> cached build (made on first use); else a Hub id ->
    its snapshot in the Hugging Face cache (hpcrl.models.hub; downloaded unless HF_HUB_OFFLINE=1).
    An unusable name is a ConfigError naming ``field``."""
    if os.path.isdir(name):
        return name
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None:
        if not name:
            from hpcrl.errors import ConfigError

            raise ConfigError(field, "is not set (a Hub id, a local model directory or hpcrl/tiny-qwen3)")
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
