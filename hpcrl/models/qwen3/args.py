"""Qwen3 / Qwen3-MoE model arguments, read from a Hugging Face config (the one source of truth).

The custom model keeps the HF config object itself as ``model.config`` (exports write it back
unchanged); ``Qwen3Args`` is the typed subset the model code reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"trainer.model.impl: the custom Qwen3 supports default RoPE only, not {rope.get('rope_type')!r}; "
                "use impl = 'hf'"
            )
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        if getattr(config, "attention_bias", False):
            raise ValueError("trainer.model.impl: the custom Qwen3 has no attention bias; use impl = 'hf'")
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
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_experts=num_experts,
            top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            moe_layers=moe_layers,
        )
