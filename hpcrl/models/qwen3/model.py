"""hpcrl's own Qwen3 / Qwen3-MoE causal LM for training (torchtitan's shape, HF's parameter names).

Every parameter keeps its Hugging Face name except the experts, which are stacked per layer
(``model.layers.L.mlp.experts.{gate,up,down}_proj`` [E, ...]; ``state_dict_adapter`` converts). The
forward takes what ``hpcrl.trainer.packing`` passes a transformers model (``input_ids``,
``position_ids``, ``attention_mask`` bool/additive/None, ``logits_to_keep``) and returns an object
with ``.logits``, so the trainer runs either implementation unchanged. ``routed_experts``
([B, L, moe layers, k] or flat [B, L, moe layers * k], -1 = route freely) replays an inference engine's routing.

Attention: SDPA with the packing's mask (CPU, tests), or flash-attention 3's varlen kernel on CUDA
(``config._attn_implementation == "flash_attention_3"``; sequences split where positions restart).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcrl.models.qwen3.args import Qwen3Args
from hpcrl.models.qwen3.moe import MoE


def _layer_routes(routed: Tensor, j: int, k: int) -> Tensor:
    """MoE layer j's [tokens, k] expert ids from [B, L, layers, k] or flat [B, L, layers*k]."""
    if routed.dim() == 4:
        return routed[:, :, j, :].reshape(-1, k).long()
    return routed[:, :, j * k : (j + 1) * k].reshape(-1, k).long()


class CausalLMOutput(NamedTuple):
    """A pytree node (FSDP2 finds the logits in it to hook its pre-backward unshard)."""

    logits: Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE. ``inv_freq`` stays float32 whatever the model's dtype, computed on the CPU as transformers
    computes it: a model cast to bf16 rounded the frequencies by up to 2^-9 relative, i.e. angles off by
    tens of radians at 32k positions, and q / k differed from transformers' (hence from the inference
    engine's) at every position. ``_apply`` (every ``to()``, ``to_empty()``, meta init) recomputes it.
    A scaled RoPE (linear, yarn, llama3) passes transformers' frequencies (``inv_freq``) and its cos /
    sin factor (``scale``, yarn's attention factor)."""

    def __init__(self, head_dim: int, theta: float, inv_freq: tuple[float, ...] = (), scale: float = 1.0):
        super().__init__()
        self.head_dim, self.theta, self.fixed, self.scale = head_dim, theta, inv_freq, scale
        self.register_buffer("inv_freq", self._frequencies(), persistent=False)

    def _frequencies(self) -> Tensor:
        if self.fixed:
            return torch.tensor(self.fixed, dtype=torch.float32)
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.theta**exps)

    def _apply(self, fn: Any, recurse: bool = True) -> Rotary:
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies().to(self.inv_freq.device)
        return self

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # in float32 before the cast, as transformers multiplies
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(x.dtype), sin.to(x.dtype)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, pos: Tensor, cp: Any, module: Any) -> Tensor:
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[2] > 1,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _fa3(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, pos: Tensor, cp: Any, module: Any) -> Tensor:
    return flash_attention_3(q, k, v, pos)


def _ring(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, pos: Tensor, cp: Any, module: Any) -> Tensor:
    """cp: this rank's time slice attends over the whole row (``cp``: the micro-batch's layout, a
    forward argument; the group: bound to the module when cp was applied)."""
    from hpcrl.models.ring_attention import cp_group_of, need_batch, ring_attention

    b = need_batch("ring", cp)
    return ring_attention(q, k, v, segments=b.segments, positions=b.positions, group=cp_group_of(module))


def _ulysses(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, pos: Tensor, cp: Any, module: Any
) -> Tensor:
    """cp: all-to-all over heads, then the whole row (layout and group as :func:`_ring`'s)."""
    from hpcrl.models.ring_attention import cp_group_of, need_batch
    from hpcrl.models.ulysses import ulysses_attention

    return ulysses_attention(q, k, v, segments=need_batch("ulysses", cp).segments, group=cp_group_of(module))


# The attention kernels of the custom model, chosen once when the model is built (set_attention).
KERNELS = {"sdpa": _sdpa, "flash_attention_3": _fa3, "hpcrl_ring": _ring, "hpcrl_ulysses": _ulysses}


def flash_attention_3(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor) -> Tensor:
    """Varlen FA3 over one packed row ([1, heads, T, d]); samples start where positions restart at 0."""
    try:
        from flash_attn_interface import flash_attn_varlen_func
    except ImportError as e:
        raise ValueError(
            "trainer.model.attn: 'flash_attention_3' needs flash-attention 3 (flash_attn_interface, built "
            "from flash-attention's hopper/ directory); install it or set attn = 'sdpa'"
        ) from e
    assert q.shape[0] == 1, "flash_attention_3 runs one packed row"
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [T, heads, d]
    out = flash_attn_varlen_func(qt, kt, vt, cu, cu, max_len, max_len, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(0, 1)[None]


class Attention(nn.Module):
    def __init__(self, a: Qwen3Args):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.kernel = "sdpa"
        self.attend = _sdpa  # set_attention chooses the kernel once, at build

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, pos: Tensor, cp: Any = None
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = self.attend(q, k, v, mask, pos, cp, self)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: Qwen3Args, layer: int):
        super().__init__()
        self.self_attn = Attention(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp: nn.Module
        if layer in a.moe_layers:
            self.mlp = MoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.top_k, a.norm_topk_prob)
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor | None,
        pos: Tensor,
        replay: Tensor | None = None,
        cp: Any = None,
    ) -> Tensor:
        """``replay``: [tokens, k] expert ids for this layer's MoE (router replay), -1 = route freely;
        ``cp``: the micro-batch's context-parallel layout (``ring_attention.CPBatch``; None without cp)."""
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, pos, cp)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, replay) if isinstance(self.mlp, MoE) else self.mlp(h))


class Qwen3Body(nn.Module):
    def __init__(self, a: Qwen3Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary_emb = Rotary(a.head_dim, a.rope_theta, a.rope_inv_freq, a.rope_scale)


class Qwen3ForTraining(nn.Module):
    """The causal LM. ``config`` is the HF config (exported unchanged)."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.args = Qwen3Args.from_hf(config)
        self.model = Qwen3Body(self.args)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = None
        self.activation_checkpointing = False
        self.activation_offload = False  # with checkpointing: the layers' saved inputs in pinned CPU memory
        self.set_attention(getattr(config, "_attn_implementation", None) or "sdpa")

    def set_attention(self, kernel: str) -> None:
        """Choose the attention kernel once, at build (hpcrl.models.custom): every layer calls it."""
        assert kernel in KERNELS, kernel
        self.config._attn_implementation = kernel
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kernel, attn.attend = kernel, KERNELS[kernel]

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        logits_to_keep: Tensor | int | None = None,
        routed_experts: Tensor | None = None,
        use_cache: bool = False,
        cp_batch: Any = None,
        **_: Any,
    ) -> CausalLMOutput:
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(h, position_ids)
        j = 0  # MoE layers seen: routed_experts holds one block of k ids per MoE layer
        for layer in self.model.layers:
            replay = None
            if routed_experts is not None and isinstance(layer.mlp, MoE):
                replay, j = _layer_routes(routed_experts, j, layer.mlp.top_k), j + 1
            # The routes are an argument, so a checkpointed layer's backward recompute replays them too.
            if self.activation_checkpointing and torch.is_grad_enabled():
                from torch.autograd.graph import save_on_cpu
                from torch.utils.checkpoint import checkpoint

                # save_on_cpu packs what checkpoint saves (the layer's input) into pinned CPU memory
                with save_on_cpu(pin_memory=True) if self.activation_offload else contextlib.nullcontext():
                    h = checkpoint(
                        layer, h, rope, attention_mask, position_ids, replay, cp_batch, use_reentrant=False
                    )
            else:
                h = layer(h, rope, attention_mask, position_ids, replay, cp_batch)
        h = self.model.norm(h)
        if isinstance(logits_to_keep, Tensor) and logits_to_keep.dtype == torch.bool:
            h = h[logits_to_keep]
        elif isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        return CausalLMOutput(self.lm_head(h))
