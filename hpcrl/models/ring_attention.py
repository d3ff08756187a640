"""Ring attention for context parallelism: a packed row split along time over the ranks of a group.

Rank ``r`` of ``N`` holds the queries, keys and values of the contiguous slice ``r`` of the row.
The key/value blocks travel around the ring (point-to-point send/recv to rank ``r+1``, receive from
``r-1``: gloo on CPU, NCCL on GPU), so a rank holds at most two blocks at a time (the one it
computes with and the one arriving), never the whole row's keys: memory is O(S/N) per rank. At step
``s`` rank ``r`` holds block ``(r - s) mod N``; it attends its queries to it when the block is not
entirely in its future (``j <= r``) and merges the per-block results with their log-sum-exp::

    lse = logaddexp(lse, lse_j);  out = out * exp(lse_old - lse) + out_j * exp(lse_j - lse)

Masking is by two per-token tensors, so packed samples and causality hold across the split: a query
attends a key iff both carry the same ``segments`` id (the same sample) and the key's ``positions``
(its index in the whole packed row) is not after the query's. RoPE is the model's business: it is
applied with the tokens' real position ids before this function sees q and k. Grouped-query heads
travel and are saved unrepeated (``Hkv`` heads, not ``H``); a block is repeated to ``H`` heads only
while it is computed with.

Backward (a custom autograd Function, the flash-attention backward per block): only the local q, k,
v, the output (in the input's dtype) and the fp32 log-sum-exp are kept between forward and
backward. The key/value blocks go around the ring again, each with the fp32 gradient accumulators of
its keys and values; every rank adds its queries' contribution to the block it holds, computed from
the merged output and log-sum-exp, and passes block and accumulators on. After ``N - 1`` hops one
last hop of the accumulators alone brings every block's gradient home to the rank that owns it.

Each block runs in query tiles of ``tile`` rows (fewer past :data:`TILE_BYTES`) in fp32 torch math,
so the scores never exceed ``[B, H, tile, S/N]``; on GPU a flash-attention block kernel would replace ``_block_forward`` /
``_block_backward`` (it returns the same log-sum-exp). The signature is SDPA's plus the two mask
tensors and the group, so hpcrl's own models and the Hugging Face ones (:func:`register_hf`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

HF_NAME = "hpcrl_ring"
TILE = 256  # query rows per tile of a block's scores (and of its mask: never a [S, S] tensor)
# ... fewer where a tile's fp32 [B, H, rows, S/N] scores would pass TILE_BYTES (the backward holds two
# such buffers), but not under TILE_MIN rows: 128 rows at 16k tokens, cp 2, 4 heads (256 were 2 x 32
# MiB, the cp step's peak); 64 at 32k, cp 2, 32 heads (256 were 2 x 512 MiB).
TILE_BYTES = 16 * 2**20
TILE_MIN = 64


def tile_rows(tile: int, batch_heads: int, keys: int) -> int:
    """Query rows per tile: at most ``tile``, fewer to keep one fp32 [B, H, rows, keys] tile under
    :data:`TILE_BYTES`, never under :data:`TILE_MIN` (or ``tile`` if smaller)."""
    return max(min(tile, TILE_MIN), min(tile, TILE_BYTES // (4 * batch_heads * keys)))


def _ring_peers(group: Any) -> tuple[int, int]:
    """(next, previous) rank of this rank in ``group``, as global ranks (what P2POp takes)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _shift(tensors: list[Tensor], group: Any) -> tuple[list[Tensor], Callable[[], None]]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's
    (same shapes); returns the receive buffers and a function that waits for both directions."""
    nxt, prv = _ring_peers(group)
    recv = [torch.empty_like(t) for t in tensors]
    sent = [t.contiguous() for t in tensors]  # kept alive until the sends are waited for
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    reqs = dist.batch_isend_irecv(ops)

    def wait() -> None:
        for q in reqs:
            q.wait()
        sent.clear()

    return recv, wait


def _repeat_heads(x: Tensor, rep: int) -> Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _sum_heads(x: Tensor, rep: int) -> Tensor:
    """Gradient of :func:`_repeat_heads`: [B, Hkv*rep, S, D] -> [B, Hkv, S, D]."""
    if rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // rep, rep, s, d).sum(2)


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
        s = (q[:, :, a:e].float() @ kf.transpose(-1, -2)).mul_(scale)  # in place: one [tile, S_k]
        s.masked_fill_(~m, float("-inf"))
        t_lse = torch.logsumexp(s, -1)
        safe = torch.where(torch.isfinite(t_lse), t_lse, torch.zeros_like(t_lse))
        p = torch.exp_(s.sub_(safe[..., None]))  # masked entries: exp(-inf) = 0
        out[:, :, a:e] = p @ vf
        lse[:, :, a:e] = t_lse
        del s, p  # not alive while the next tile's scores are computed
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
        s = (qt @ kf.transpose(-1, -2)).mul_(scale)  # in place: one [tile, S_k] buffer, not two
        s.masked_fill_(~m, float("-inf"))
        p = torch.exp_(s.sub_(lse[:, :, a:e, None]))  # probabilities under the merged softmax
        dv += p.transpose(-1, -2) @ dot
        ds = p.mul_((dot @ vf.transpose(-1, -2)).sub_(delta[:, :, a:e, None]))
        dq[:, :, a:e] = (ds @ kf) * scale
        dk += (ds.transpose(-1, -2) @ qt) * scale
        # The tile's buffer (s, p and ds are one) must not live on while the next tile's scores are
        # computed: it did, and with the scores' unscaled product that was three [B, H, tile, S_k]
        # fp32 buffers at once, the cp step's peak (3 x 32 MiB at 16k tokens, cp 2, 4 heads).
        del s, p, ds
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seg: Tensor,
        pos: Tensor,
        group: Any,
        scale: float,
        tile: int,
        rep: int,
    ) -> Tensor:
        n = 1 if group is None else dist.get_world_size(group)
        r = 0 if group is None else dist.get_rank(group)
        kv, mask_kv = torch.stack([k, v]), torch.stack([seg.long(), pos.long()])  # one message each per hop
        out = lse = None
        for s in range(n):
            j = (r - s) % n  # the block held at this step
            wait = None
            if s < n - 1:
                (kv_next, mask_next), wait = _shift([kv, mask_kv], group)
            if j <= r:  # blocks after r are all in the future
                allowed = _allowed(seg, pos, mask_kv[0], mask_kv[1])
                o_j, l_j = _block_forward(
                    q, _repeat_heads(kv[0], rep), _repeat_heads(kv[1], rep), allowed, scale, tile
                )
                if out is None:
                    out, lse = o_j, l_j
                else:
                    new = torch.logaddexp(lse, l_j)
                    new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
                    w_old = torch.exp(lse - new_safe)[..., None]
                    w_j = torch.exp(l_j - new_safe)[..., None]
                    out, lse = out * w_old + o_j * w_j, new
                del o_j, l_j
            if wait is not None:
                wait()
                kv, mask_kv = kv_next, mask_next
        assert out is not None and lse is not None
        res = out.to(q.dtype)  # the fp32 accumulator is not kept: backward reads the output as returned
        del out
        ctx.save_for_backward(q, k, v, seg, pos, res, lse)
        ctx.group, ctx.scale, ctx.tile, ctx.n, ctx.r, ctx.rep = group, scale, tile, n, r, rep
        return res

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, seg, pos, res, lse = ctx.saved_tensors
        n, r, group, rep = ctx.n, ctx.r, ctx.group, ctx.rep
        dout = dout.float()
        delta = (dout * res.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, mask_kv = torch.stack([k, v]), torch.stack([seg.long(), pos.long()])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for s in range(n):
            j = (r - s) % n
            if j <= r:
                allowed = _allowed(seg, pos, mask_kv[0], mask_kv[1])
                dq_j, dk_j, dv_j = _block_backward(
                    dout,
                    delta,
                    q,
                    _repeat_heads(kv[0], rep),
                    _repeat_heads(kv[1], rep),
                    lse,
                    allowed,
                    ctx.scale,
                    ctx.tile,
                )
                dq += dq_j
                dkv[0] += _sum_heads(dk_j, rep)
                dkv[1] += _sum_heads(dv_j, rep)
                del dq_j, dk_j, dv_j
            if s < n - 1:  # pass the block on with its gradient so far
                (kv, mask_kv, dkv), wait = _shift([kv, mask_kv, dkv], group)
                wait()
        if n > 1:  # the block held now is r + 1's: one hop brings each block's gradient home
            (dkv,), wait = _shift([dkv], group)
            wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


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
    (grouped-query heads are repeated per block), ``segments`` / ``positions`` [S] the local tokens'
    sample ids and indices in the whole row. Returns [B, H, S, D] (causal within each sample)."""
    h, hkv = query.shape[1], key.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    s = query.shape[-1] ** -0.5 if scale is None else scale
    tile = tile_rows(tile, query.shape[0] * h, query.shape[2])  # a block has as many keys as queries
    return _RingAttention.apply(query, key, value, segments, positions, group, float(s), tile, h // hkv)


# ------------------------------------------------------------------------------ model hook


@dataclass(frozen=True)
class CPBatch:
    """One micro-batch's layout under context parallelism, passed to the model's forward as
    ``cp_batch=`` (transformers hands unknown forward arguments down to the attention function;
    hpcrl's own model threads it to its layers): no state outside the call."""

    segments: Tensor  # [S_local] sample id of each local token
    positions: Tensor  # [S_local] index of each local token in the whole packed row


CP_GROUP_ATTR = "hpcrl_cp_group"  # set on each attention module by hpcrl.models.parallelize.apply_cp
_UNBOUND = object()


def bind_cp_group(attention: torch.nn.Module, group: Any) -> None:
    """Bind the cp process group (None: a single rank) to one attention module, once, when cp is
    applied (:func:`hpcrl.models.parallelize.apply_cp`)."""
    setattr(attention, CP_GROUP_ATTR, group)


def cp_group_of(attention: torch.nn.Module) -> Any:
    """The cp group bound to ``attention``; a module cp was never applied to is refused (it would
    attend over its own slice alone)."""
    group = getattr(attention, CP_GROUP_ATTR, _UNBOUND)
    if group is _UNBOUND:
        raise RuntimeError(
            "context-parallel attention on a module with no cp group: apply cp to the model first "
            "(hpcrl.models.parallelize.apply_cp)"
        )
    return group


def need_batch(kind: str, cp_batch: CPBatch | None) -> CPBatch:
    if cp_batch is None:
        raise RuntimeError(
            f"{kind} attention needs the micro-batch's layout: call the model with cp_batch= "
            "(hpcrl.trainer.context_parallel.forward_cp passes it)"
        )
    return cp_batch


def hf_adapter(
    kind: str, run: Callable[[Tensor, Tensor, Tensor, CPBatch, Any, float | None], Tensor]
) -> Callable:
    """transformers' AttentionInterface signature around a cp kernel ``run(q, k, v, batch, group,
    scale)`` (ring here, Ulysses in hpcrl.models.ulysses): the samples come from the forward's
    ``cp_batch`` argument and the group from the attention module (bound when cp was applied), not
    from a mask."""

    def attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        cp_batch: CPBatch | None = None,
        **_: Any,
    ) -> tuple[Tensor, None]:
        if dropout:
            raise ValueError(f"{kind} attention has no dropout")
        out = run(query, key, value, need_batch(kind, cp_batch), cp_group_of(module), scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def register_kernel(name: str, attention: Callable) -> str:
    """Register ``attention`` with transformers under ``name`` (no mask is built for it); the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    return name


hf_ring_attention = hf_adapter(
    "ring",
    lambda q, k, v, batch, group, scale: ring_attention(
        q, k, v, segments=batch.segments, positions=batch.positions, group=group, scale=scale
    ),
)


def register_hf() -> str:
    """Register :func:`hf_ring_attention` with transformers; its name."""
    return register_kernel(HF_NAME, hf_ring_attention)
