"""Ring attention for context parallelism: a packed row split along time over the ranks of a group.

Rank ``r`` of ``N`` holds the queries, keys and values of the contiguous slice ``r`` of the row.
The key/value blocks of every rank are gathered (``all_gather``: gloo on CPU, NCCL on GPU); rank
``r`` attends its queries to blocks ``0..r`` one at a time (the later blocks are entirely in its
future) and merges the per-block results with their log-sum-exp::

    lse = logaddexp(lse, lse_j);  out = out * exp(lse_old - lse) + out_j * exp(lse_j - lse)

which is what a send/recv ring computes, in the order the blocks arrive. Masking is by two
per-token tensors, so packed samples and causality hold across the split: a query attends a key
iff both carry the same ``segments`` id (the same sample) and the key's ``positions`` (its index
in the whole packed row) is not after the query's. RoPE is the model's business: it is applied
with the tokens' real position ids before this function sees q and k.

Backward (a custom autograd Function): the keys and values are gathered again (only the local
slice is kept between forward and backward), each block's gradient is computed from the merged
output and log-sum-exp (the flash-attention backward), and the key/value gradients are summed
back onto the rank that owns each block (reduce-scatter; gloo has none, so all_to_all + sum).

Each block runs in query tiles of ``tile`` rows in fp32 torch math, so the scores never exceed
``[B, H, tile, S/N]``; on GPU a flash-attention block kernel would replace ``_block_forward`` /
``_block_backward`` (it returns the same log-sum-exp). The signature is SDPA's plus the two mask
tensors and the group, so hpcrl's own models and the Hugging Face ones (:func:`register_hf`) share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

HF_NAME = "hpcrl_ring"
TILE = 256  # query rows per tile of a block's scores (and of its mask: never a [S, S] tensor)


def _gather(x: Tensor, group: Any, n: int) -> list[Tensor]:
    if n == 1:
        return [x]
    out = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _reduce_to_owner(blocks: list[Tensor], group: Any, n: int) -> Tensor:
    """Sum over ranks of ``blocks[j]``, landing on rank ``j`` (reduce-scatter)."""
    if n == 1:
        return blocks[0]
    stacked = torch.stack(blocks).contiguous()
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(blocks[0])
        dist.reduce_scatter_tensor(out, stacked, group=group)
        return out
    recv = torch.empty_like(stacked)
    dist.all_to_all_single(recv, stacked, group=group)
    return recv.sum(0)


Mask = Callable[[int, int], Tensor]  # query rows [a, e) -> their [e - a, S_k] bool mask


def _allowed(seg_q: Tensor, pos_q: Tensor, seg_k: Tensor, pos_k: Tensor) -> Mask:
    """Same sample and key not after query, built one query tile at a time."""

    def rows(a: int, e: int) -> Tensor:
        return (seg_q[a:e, None] == seg_k[None, :]) & (pos_k[None, :] <= pos_q[a:e, None])

    return rows


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Mask, scale: float, tile: int
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` [B,H,Sq,D] to one key block: (out fp32 [B,H,Sq,D], lse fp32 [B,H,Sq]);
    rows with no allowed key get out 0, lse -inf."""
    b, h, sq, d = q.shape
    out = torch.zeros(b, h, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for a in range(0, sq, tile):
        e = min(a + tile, sq)
        m = allowed(a, e)
        if not bool(m.any()):
            continue
        s = (q[:, :, a:e].float() @ kf.transpose(-1, -2)) * scale
        s.masked_fill_(~m, float("-inf"))
        t_lse = torch.logsumexp(s, -1)
        safe = torch.where(torch.isfinite(t_lse), t_lse, torch.zeros_like(t_lse))
        p = torch.exp_(s.sub_(safe[..., None]))  # masked entries: exp(-inf) = 0
        out[:, :, a:e] = p @ vf
        lse[:, :, a:e] = t_lse
    return out, lse


def _block_backward(
    dout: Tensor,
    delta: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    allowed: Mask,
    scale: float,
    tile: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the MERGED log-sum-exp ``lse`` and ``delta = sum(dout * out)``."""
    kf, vf = k.float(), v.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for a in range(0, q.shape[2], tile):
        e = min(a + tile, q.shape[2])
        m = allowed(a, e)
        if not bool(m.any()):
            continue
        qt, dot = q[:, :, a:e].float(), dout[:, :, a:e]
        s = (qt @ kf.transpose(-1, -2)) * scale
        s.masked_fill_(~m, float("-inf"))
        p = torch.exp_(s.sub_(lse[:, :, a:e, None]))  # probabilities under the merged softmax
        dv += p.transpose(-1, -2) @ dot
        ds = p.mul_((dot @ vf.transpose(-1, -2)).sub_(delta[:, :, a:e, None]))
        dq[:, :, a:e] = (ds @ kf) * scale
        dk += (ds.transpose(-1, -2) @ qt) * scale
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, seg: Tensor, pos: Tensor, group: Any, scale: float, tile: int
    ) -> Tensor:
        n = 1 if group is None else dist.get_world_size(group)
        r = 0 if group is None else dist.get_rank(group)
        ks, vs, segs, poss = (_gather(x, group, n) for x in (k, v, seg, pos))
        out = lse = None
        for j in range(r + 1):  # blocks after r are all in the future
            allowed = _allowed(seg, pos, segs[j], poss[j])
            o_j, l_j = _block_forward(q, ks[j], vs[j], allowed, scale, tile)
            if out is None:
                out, lse = o_j, l_j
                continue
            new = torch.logaddexp(lse, l_j)
            new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
            w_old = torch.exp(lse - new_safe)[..., None]
            w_j = torch.exp(l_j - new_safe)[..., None]
            out, lse = out * w_old + o_j * w_j, new
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, seg, pos, out, lse)
        ctx.group, ctx.scale, ctx.tile, ctx.n, ctx.r = group, scale, tile, n, r
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, seg, pos, out, lse = ctx.saved_tensors
        n, r, group = ctx.n, ctx.r, ctx.group
        ks, vs, segs, poss = (_gather(x, group, n) for x in (k, v, seg, pos))
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dks = [torch.zeros(k.shape, dtype=torch.float32, device=q.device) for _ in range(n)]
        dvs = [torch.zeros(v.shape, dtype=torch.float32, device=q.device) for _ in range(n)]
        for j in range(r + 1):
            allowed = _allowed(seg, pos, segs[j], poss[j])
            dq_j, dks[j], dvs[j] = _block_backward(
                dout, delta, q, ks[j], vs[j], lse, allowed, ctx.scale, ctx.tile
            )
            dq += dq_j
        dk = _reduce_to_owner(dks, group, n)
        dv = _reduce_to_owner(dvs, group, n)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    segments: Tensor,
    positions: Tensor,
    group: Any = None,
    scale: float | None = None,
    tile: int = TILE,
) -> Tensor:
    """SDPA over a time-split packed row: ``query`` [B, H, S, D], ``key``/``value`` [B, Hkv, S, D]
    (grouped-query heads are repeated here), ``segments`` / ``positions`` [S] the local tokens'
    sample ids and indices in the whole row. Returns [B, H, S, D] (causal within each sample)."""
    h, hkv = query.shape[1], key.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if h != hkv:
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    s = query.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(query, key, value, segments, positions, group, float(s), tile)


# ------------------------------------------------------------------------------ Hugging Face hook


@dataclass
class CPContext:
    group: Any  # the context-parallel process group (None: a single rank)
    segments: Tensor  # [S_local] sample id of each local token
    positions: Tensor  # [S_local] index of each local token in the whole packed row


_STATE = threading.local()


@contextmanager
def cp_context(ctx: CPContext):
    """Within this block, attention implemented by :data:`HF_NAME` attends over ``ctx``."""
    prev = getattr(_STATE, "ctx", None)
    _STATE.ctx = ctx
    try:
        yield
    finally:
        _STATE.ctx = prev


def current_context() -> CPContext:
    """The context of the enclosing :func:`cp_context` (the model's attention is called inside it)."""
    ctx: CPContext | None = getattr(_STATE, "ctx", None)
    if ctx is None:
        raise RuntimeError(f"attention '{HF_NAME}' runs only inside hpcrl.models.ring_attention.cp_context")
    return ctx


def hf_ring_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[Tensor, None]:
    """transformers' AttentionInterface signature; the mask comes from :func:`cp_context`."""
    ctx = current_context()
    if dropout:
        raise ValueError("ring attention has no dropout")
    out = ring_attention(
        query, key, value, segments=ctx.segments, positions=ctx.positions, group=ctx.group, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> str:
    """Register :func:`hf_ring_attention` with transformers (no mask is built for it); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, hf_ring_attention)
    return HF_NAME
