"""Which model families have hpcrl's own training implementation (``trainer.model.impl = "custom"``).

A family is a package under hpcrl/models/ exposing ``MODEL_TYPES`` (HF ``config.model_type`` values it
serves), ``build(hf_config) -> nn.Module``, ``from_hf(state) -> state`` and ``to_hf(named) -> named``.
Adding a family: one package and one line here.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

from hpcrl.config.errors import ConfigError

FAMILIES = {"qwen3": "hpcrl.models.qwen3", "qwen3_moe": "hpcrl.models.qwen3"}


def model_type_of(path: str | Path) -> str:
    try:
        return str(json.loads(Path(path, "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def family(model_type: str) -> ModuleType | None:
    mod = FAMILIES.get(model_type)
    return None if mod is None else importlib.import_module(mod)


def pick_impl(impl: str, model_type: str, *, lora: bool = False, attn: str | None = None) -> str:
    """'hf' or 'custom' for a model: auto picks custom where hpcrl has one, unless LoRA asks for peft
    or the attention asked for is one only transformers runs (flash_attention_2)."""
    if impl == "custom":
        if model_type not in FAMILIES:
            raise ConfigError(
                "trainer.model.impl",
                f"no custom implementation for model_type {model_type!r} "
                f"(custom: {sorted(FAMILIES)}); use impl = 'hf' or 'auto'",
            )
        if lora:
            raise ConfigError(
                "trainer.model.impl",
                "LoRA runs on the transformers implementation only; set impl = 'hf' or 'auto'",
            )
        return "custom"
    if impl == "auto":
        return "custom" if model_type in FAMILIES and not lora and attn != "flash_attention_2" else "hf"
    return "hf"
