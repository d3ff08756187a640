"""Building a model on one device, for every family: a Hugging Face directory -> the family's module
(hpcrl's own implementation, or transformers' for everything else), in the master dtype, on a device
or on the meta device, with activation checkpointing and a LoRA adapter applied. Which family serves
a model is the registry's choice (:func:`hpcrl.models.registry.pick_impl`); the spec
(:mod:`hpcrl.models.spec`) then parallelizes what this builds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("hpcrl.trainer")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class LoraParams:
    """LoRA adapter shape. ``target_modules`` are module-name suffixes (Qwen/Llama projections)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # Seeds the adapter's random init: every rank must start from the same adapter (FSDP shards
    # each rank's own copy, so different inits would silently mix) and so must a rerun.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank: {self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: {self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def default_attn_impl(device: torch.device | str) -> str:
    """flash_attention_2 on CUDA when flash-attn is installed, else PyTorch SDPA (CPU, tests)."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def check_model_dir(path: str | os.PathLike[str]) -> None:
    if not Path(path, "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")


def check_offload(activation_checkpointing: bool, activation_offload: bool) -> None:
    if activation_offload and not activation_checkpointing:
        raise ValueError(
            "activation_offload needs activation_checkpointing (it offloads the checkpointed inputs)"
        )


def build_hf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn: str | None = None,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    lora: LoraParams | None = None,
    trust_remote_code: bool = False,
    meta: bool = False,
    vision: bool = False,
) -> nn.Module:
    """The generic family's build: transformers' ``AutoModelForCausalLM`` (``vision``: the model's
    vision-language class, ``AutoModelForImageTextToText``; on ``meta`` without reading a weight),
    activation checkpointing (:func:`enable_checkpointing`), then LoRA (:func:`apply_lora`)."""
    check_offload(activation_checkpointing, activation_offload)
    check_model_dir(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM

    kwargs = {
        "dtype": dtype,
        "attn_implementation": attn or default_attn_impl(device),
        "trust_remote_code": trust_remote_code,
    }
    if meta:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = auto.from_config(config, **kwargs)
    else:
        model = auto.from_pretrained(str(path), **kwargs)
        model.to(device)
    # The KV cache is useless for training forwards and conflicts with checkpointing.
    model.config.use_cache = False
    if activation_checkpointing:
        enable_checkpointing(model, activation_offload)
    if lora is not None:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = apply_lora(model, lora)
    model.train()
    return model


def read_hf_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF weights dir's *.safetensors files, by HF name."""
    from safetensors.torch import load_file

    d = Path(path)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        raise ValueError(f"ckpt.warm_start: {path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_warm_start(
    model: nn.Module, path: str, read_weights: Callable[[str], dict[str, torch.Tensor]] | None = None
) -> None:
    """Initialise weights from an HF weights dir (e.g. weights/step_N of an earlier run), or what
    ``read_weights`` reads at ``path``; a custom family's model through its state-dict adapter."""
    state = (read_weights or read_hf_dir)(path)
    if getattr(model, "hpcrl_family", None) is not None:
        from hpcrl.models.custom import load_hf_into

        load_hf_into(model, state, "ckpt.warm_start")
        log.info("warm start from %s", path)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise ValueError(
            f"ckpt.warm_start: weights do not match the model (missing {real_missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    log.info("warm start from %s", path)


def enable_checkpointing(model: nn.Module, offload: bool) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (it composes with
    FSDP2 and with frozen LoRA base weights); ``offload``: each layer's ``checkpoint`` call runs
    inside ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so the inputs it saves go to pinned
    CPU memory. (transformers >= 5.2x has ``activation_checkpointing_enable(offload=True)`` for the same
    wrapper, but it asks for pinned memory on CPU-only machines too, where torch refuses; ours leaves
    pinning to torch's CUDA check and works with every transformers version.)"""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not offload:
        return
    wrapped = 0
    for mod in model.modules():
        inner = getattr(mod, "_gradient_checkpointing_func", None)
        if inner is not None:
            mod._gradient_checkpointing_func = _offloading(inner)
            wrapped += 1
    if not wrapped:
        raise ValueError(f"activation_offload: {type(model).__name__} has no checkpointed layers to offload")


def _offloading(checkpoint_fn: Any) -> Any:
    from torch.autograd.graph import save_on_cpu

    def run(*args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=True):
            return checkpoint_fn(*args, **kwargs)

    return run


def apply_lora(model: nn.Module, lora: LoraParams) -> nn.Module:
    """Wrap with a peft LoRA adapter; only adapter weights stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("LoRA needs the 'peft' package: pip install 'hpcrl[lora]'") from e
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        # Checkpointed blocks need an input that requires grad when the embeddings are frozen.
        model.enable_input_require_grads()
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(lora.seed)
        return get_peft_model(model, cfg)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")
