"""Which model families have hpcrl's own training implementation (``trainer.model.impl = "custom"``).

A family is a package under hpcrl/models/ exposing ``MODEL_TYPES`` (HF ``config.model_type`` values it
serves), ``SPEC`` (its :class:`hpcrl.models.spec.ModelSpec`: build, parallelize with its expert
parallelism, the state-dict adapter ``from_hf`` / ``to_hf``, checks), the same ``build``, ``from_hf``,
``to_hf``, ``apply_ep`` by name, and ``unsupported(config dict) -> reason | None`` (what of a config it
does not compute as transformers does: ``auto`` then keeps transformers, ``custom`` refuses in one
line; importable without torch, for the dry run). Adding a family: one package and one line here.
Every other model takes transformers' generic path (``hpcrl.models.spec.HF``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from hpcrl.errors import ConfigError

FAMILIES = {"qwen3": "hpcrl.models.qwen3", "qwen3_moe": "hpcrl.models.qwen3"}
# transformers' vision-language MoE classes whose MoE blocks hpcrl's expert-parallel MoE replaces
# ([model.vlm] with ep > 1: hpcrl.models.vlm_moe)
VL_MOE_TYPES = ("qwen3_vl_moe", "qwen3_5_moe")


def config_of(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json ({} when unreadable)."""
    try:
        c = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return c if isinstance(c, dict) else {}


def unsupported(config: dict[str, Any]) -> str | None:
    """Why the custom implementation of this config's model type cannot run it (None: it can, or
    there is no custom implementation to ask)."""
    mod = FAMILIES.get(str(config.get("model_type", "")))
    return None if mod is None else importlib.import_module(mod).unsupported(config)


def family(model_type: str) -> ModuleType | None:
    mod = FAMILIES.get(model_type)
    return None if mod is None else importlib.import_module(mod)


def refuse_lora_on_custom(impl: str, lora: bool) -> None:
    """LoRA (peft) wraps transformers' modules: the custom implementation does not run it."""
    if lora and impl == "custom":
        raise ConfigError(
            "trainer.model.impl",
            "LoRA runs on the transformers implementation only; set impl = 'hf' or 'auto'",
        )


def pick_impl(
    impl: str,
    model_type: str,
    *,
    lora: bool = False,
    attn: str | None = None,
    config: dict[str, Any] | None = None,
) -> str:
    """'hf' or 'custom' for a model: auto picks custom where hpcrl has one that runs this ``config``
    (config.json's dict), unless LoRA asks for peft or the attention asked for is one only transformers
    runs (flash_attention_2)."""
    reason = unsupported({**(config or {}), "model_type": model_type})
    if impl == "custom":
        if model_type not in FAMILIES:
            raise ConfigError(
                "trainer.model.impl",
                f"no custom implementation for model_type {model_type!r} "
                f"(custom: {sorted(FAMILIES)}); use impl = 'hf' or 'auto'",
            )
        refuse_lora_on_custom(impl, lora)
        if reason is not None:
            raise ConfigError(
                "trainer.model.impl",
                f"the custom {model_type} does not run {reason}; use impl = 'hf' or 'auto'",
            )
        return "custom"
    if impl == "auto":
        ok = model_type in FAMILIES and reason is None and not lora and attn != "flash_attention_2"
        return "custom" if ok else "hf"
    return "hf"
