"""Typed configuration: schema (msgspec Structs), loading (files, flags, hosted shape) and validation."""

from hpcrl.config.errors import ConfigError
from hpcrl.config.loader import Loaded, load
from hpcrl.config.schema import Config, SFTConfig

__all__ = ["Config", "ConfigError", "Loaded", "SFTConfig", "load"]
