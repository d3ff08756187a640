"""Loading a model with hpcrl's own implementation (``trainer.model.impl = "custom"``): the family's
module is built from the HF config and filled from the HF checkpoint through its state-dict adapter."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from torch import nn

from hpcrl.errors import ConfigError
from hpcrl.models import registry

log = logging.getLogger("hpcrl.trainer")
_NOTED: set[str] = set()


def custom_attention(attn: str, device: torch.device | str) -> str:
    """The kernel the custom model runs: flash_attention_3 on CUDA (auto: when installed), else SDPA."""
    on_cuda = torch.device(device).type == "cuda"
    from hpcrl.models.ring_attention import HF_NAME

    if attn in (HF_NAME, "hpcrl_ulysses"):  # context parallelism (trainer.model.cp) over the cp group
        return attn
    if attn == "flash_attention_3":
        if on_cuda:
            if importlib.util.find_spec("flash_attn_interface") is None:
                raise ConfigError(
                    "trainer.model.attn",
                    "'flash_attention_3' needs flash-attention 3 (the flash_attn_interface "
                    "module) on this node; install it or set attn = 'sdpa'",
                )
            return "flash_attention_3"
        if "fa3" not in _NOTED:
            _NOTED.add("fa3")
            log.warning(
                "trainer.model.attn: flash_attention_3 runs as SDPA on CPU (same math, no FA3 kernel)"
            )
        return "sdpa"
    if attn == "auto":
        fa3 = on_cuda and importlib.util.find_spec("flash_attn_interface") is not None
        return "flash_attention_3" if fa3 else "sdpa"
    if attn in ("sdpa", "eager"):
        return "sdpa"
    raise ConfigError(
        "trainer.model.attn",
        f"{attn!r} is not available with impl = 'custom' "
        "(allowed: auto, sdpa, eager, flash_attention_3); use impl = 'hf' for it",
    )


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {str(path)!r} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_hf_into(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy HF-named tensors into a custom model (experts stacked by the family's adapter)."""
    fam = registry.family(model.config.model_type)
    converted = fam.from_hf(state)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    real_missing = [m for m in missing if not (m == "lm_head.weight" and model.args.tie_word_embeddings)]
    if real_missing or unexpected:
        raise ValueError(
            f"{where}: weights do not match the model (missing {real_missing[:3]}, unexpected {unexpected[:3]})"
        )


def load_custom(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    attn: str,
    activation_checkpointing: bool,
    meta: bool,
    offload: bool = False,
) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    fam = registry.family(config.model_type)
    assert fam is not None, config.model_type
    config._attn_implementation = custom_attention(attn, device)
    with torch.device("meta"):
        model = fam.build(config)
    model.to(dtype=dtype)
    if meta:
        return _finish(model, activation_checkpointing, offload)
    model.to_empty(device="cpu")
    if model.args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_hf_into(model, {k: v.to(dtype) for k, v in read_hf_state(path).items()}, f"model {path}")
    model.to(device)
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        model.generation_config = None
    return _finish(model, activation_checkpointing, offload)


def build_custom(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn: str | None = None,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    lora: object = None,
    trust_remote_code: bool = False,
    meta: bool = False,
) -> nn.Module:
    """A custom family's ``build`` (the spec's signature): no LoRA (peft wraps transformers' modules);
    the attention kernel is chosen here once (:func:`custom_attention`), activation checkpointing
    is a flag the model's forward reads."""
    registry.refuse_lora_on_custom("custom", lora is not None)
    return load_custom(
        path, dtype, device, attn or "auto", activation_checkpointing, meta, offload=activation_offload
    )


def _finish(model: nn.Module, activation_checkpointing: bool, offload: bool) -> nn.Module:
    model.config.use_cache = False
    model.activation_checkpointing = activation_checkpointing
    model.activation_offload = offload  # the checkpointed layer inputs in pinned CPU memory
    model.hpcrl_family = model.config.model_type
    model.train()
    return model
