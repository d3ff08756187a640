"""Typed configuration: schema (msgspec Structs), loading (files, flags, hosted shape) and validation.

Names are imported lazily so `hpcrl <cmd> --help` (which needs only the schema) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcrl.config.loader import Loaded, load
    from hpcrl.config.schema import Config, SFTConfig
    from hpcrl.errors import ConfigError

__all__ = ["Config", "ConfigError", "Loaded", "SFTConfig", "load"]

_WHERE = {
    "ConfigError": "hpcrl.errors",
    "Loaded": "loader",
    "load": "loader",
    "Config": "schema",
    "SFTConfig": "schema",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        where = _WHERE[name]
        module = where if where.startswith("hpcrl.") else f"hpcrl.config.{where}"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'hpcrl.config' has no attribute {name!r}")
