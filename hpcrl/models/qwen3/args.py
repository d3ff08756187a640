"""Qwen3 / Qwen3-MoE model arguments, read from a Hugging Face config (the one source of truth).

The custom model keeps the HF config object itself as ``model.config`` (exports write it back
unchanged); ``Qwen3Args`` is the typed subset the model code reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcrl.errors import ConfigError

# RoPE variants whose frequencies are fixed (transformers' ROPE_INIT_FUNCTIONS computes them once):
# the custom model serves these; "dynamic" / "longrope" change with the batch's length and stay with hf
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_type(c: Mapping[str, Any]) -> str:
    """The RoPE type of a config dict: the older ``rope_scaling`` first (transformers 5 reads it over
    ``rope_parameters`` when both are set), then ``rope_parameters``. A dict of per-layer-type dicts
    (no type of its own) is ``"per-layer-type"``."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        return "default"
    kind = rope.get("rope_type") or rope.get("type")
    if kind is None and any(isinstance(v, Mapping) for v in rope.values()):
        return "per-layer-type"
    return str(kind or "default")


def _slides(c: Mapping[str, Any]) -> bool:
    """Whether transformers' Qwen3 / Qwen3-MoE attends through a sliding window for this config: a
    window only with use_sliding_window; Qwen3-MoE then on every layer, Qwen3 on its layer_types'
    sliding layers (by default the layers from max_window_layers on)."""
    if not (c.get("use_sliding_window") and c.get("sliding_window")):
        return False
    if c.get("model_type") == "qwen3_moe":
        return True
    types = c.get("layer_types")
    if types:
        return "sliding_attention" in types
    return int(c.get("num_hidden_layers") or 0) > int(c.get("max_window_layers", 28) or 0)


def unsupported(c: Mapping[str, Any]) -> str | None:
    """Why the custom Qwen3 cannot compute what transformers computes for this config dict (config.json
    or ``config.to_dict()``), or None when it can."""
    rope = rope_type(c)
    if rope not in ROPE_TYPES:
        return f"rope_type {rope!r} (the custom model computes {', '.join(ROPE_TYPES)})"
    if c.get("attention_bias"):
        return "attention_bias = true (the custom model has no attention bias)"
    if _slides(c):
        return "sliding-window attention (use_sliding_window with sliding layers)"
    if (c.get("hidden_act") or "silu") != "silu":
        return f"hidden_act {c.get('hidden_act')!r} (the custom model computes silu)"
    if float(c.get("attention_dropout") or 0.0) > 0:
        return "attention_dropout > 0 (the custom model has no dropout)"
    return None


@dataclass(frozen=True)
class Qwen3Args:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # a scaled RoPE's inverse frequencies and cos / sin factor, from transformers' rope functions (the
    # exact float32 values, as Python floats); () for the default RoPE (from rope_theta)
    rope_inv_freq: tuple[float, ...] = ()
    rope_scale: float = 1.0
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3Args:
        reason = unsupported(config.to_dict())
        if reason is not None:
            raise ConfigError(
                "trainer.model.impl", f"the custom Qwen3 does not run {reason}; use impl = 'hf' or 'auto'"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq, scale = _scaled_rope(config)
        heads = config.num_attention_heads
        num_experts = int(getattr(config, "num_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if num_experts:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", []) or [])
            moe_layers = tuple(
                i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0
            )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            rope_scale=scale,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_experts=num_experts,
            top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            moe_layers=moe_layers,
        )


def _scaled_rope(config: Any) -> tuple[tuple[float, ...], float]:
    """A scaled RoPE's frequencies and cos / sin factor, computed on the CPU in float32 by transformers'
    own function for the type (so they are the engine's to the bit); ((), 1.0) for the default."""
    kind = rope_type(config.to_dict())
    if kind == "default":
        return (), 1.0
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # real numbers even while the model is built on the meta device
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return tuple(float(x) for x in inv_freq.float()), float(factor)
