"""Ulysses attention for context parallelism (``trainer.model.cp_mode = "ulysses"``): all-to-all over
heads instead of a ring over key/value blocks.

Rank ``r`` of ``N`` holds every head of the contiguous time slice ``r`` of a packed row (the same
split as ring attention, :mod:`hpcrl.trainer.context_parallel`). One ``all_to_all`` trades heads for
time: afterwards rank ``r`` holds heads ``[r*H/N, (r+1)*H/N)`` of the WHOLE row, runs ordinary
attention over it, and a second ``all_to_all`` gives each rank its time slice back with every head.
Both collectives are autograd-aware (functional collectives' ``all_to_all_single_autograd``), so the
backward is the same two exchanges in reverse plus attention's own backward. Per rank it moves
4 x S/N x H x D values (q, k, v out, the output back) against ring attention's gathering of every
K/V block, and the attention itself is one kernel call per sample (SDPA's flash backend on GPU,
no flash-attention package needed; ``is_causal`` per sample, never an ``[S, S]`` mask).

It needs the heads to divide by N: query heads always, key/value heads too or they are repeated to
the query heads first (grouped-query attention with fewer KV heads than ranks). The dry run refuses a
cp that does not divide the query heads (:func:`hpcrl.launch.checks.context_parallel`).

The packed row's samples come from the same :class:`~hpcrl.models.ring_attention.CPBatch` ring
attention reads (``segments``: the sample id of each local token, a forward argument); samples are
contiguous, so after the exchange each one is a slice of the whole row. The group is the one bound
to the attention module when cp was applied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

HF_NAME = "hpcrl_ulysses"


def _exchange(send: Tensor, group: Any) -> Tensor:
    """Equal all-to-all along dim 0, with a backward (the same exchange of the gradients)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(send, None, None, group))


def _heads_to_time(x: Tensor, group: Any, n: int) -> Tensor:
    """[B, H, S/N, D] (all heads, my slice) -> [B, H/N, S, D] (my heads, whole row)."""
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [N, B, H/N, S/N, D]
    recv = _exchange(send, group)  # [N(time), B, H/N, S/N, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _time_to_heads(x: Tensor, group: Any, n: int) -> Tensor:
    """[B, H/N, S, D] (my heads, whole row) -> [B, H, S/N, D] (all heads, my slice)."""
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [N(time), B, H/N, S/N, D]
    recv = _exchange(send, group)  # [N(heads), B, H/N, S/N, D]
    return recv.transpose(0, 1).reshape(b, n * hn, s // n, d)


def _sample_bounds(segments: Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal sample ids (samples are contiguous in a packed row)."""
    seg = segments.reshape(-1)
    change = torch.nonzero(seg[1:] != seg[:-1]).reshape(-1) + 1
    edges = [0, *change.tolist(), seg.numel()]
    return list(zip(edges[:-1], edges[1:]))


def _gather_segments(segments: Tensor, group: Any, n: int) -> Tensor:
    if n == 1:
        return segments
    parts = [torch.empty_like(segments) for _ in range(n)]
    dist.all_gather(parts, segments.contiguous(), group=group)
    return torch.cat(parts)


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    segments: Tensor,
    group: Any,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of this rank's slice of a packed row over the whole row, samples kept apart.

    ``query`` [B, H, S/N, D], ``key`` / ``value`` [B, Hkv, S/N, D] (this rank's contiguous slice,
    RoPE applied with the real positions), ``segments`` [S/N] sample id of each local token.
    Returns [B, H, S/N, D] in the query's dtype."""
    n = 1 if group is None else dist.get_world_size(group)
    h, hkv = query.shape[1], key.shape[1]
    if h % n:
        raise ValueError(f"ulysses attention: {h} query heads do not divide over cp = {n} ranks")
    if hkv % n:  # fewer KV heads than ranks: repeat them to the query heads (GQA groups stay aligned)
        key, value = (t.repeat_interleave(h // hkv, dim=1) for t in (key, value))
        hkv = h
    if n > 1:
        query, key, value = (_heads_to_time(t, group, n) for t in (query, key, value))
    seg = _gather_segments(segments.to(query.device), group, n)
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, a:e],
            key[:, :, a:e],
            value[:, :, a:e],
            is_causal=e - a > 1,
            scale=scale,
            enable_gqa=hkv != h,
        )
        for a, e in _sample_bounds(seg)
    ]
    out = torch.cat(outs, dim=2)
    return _time_to_heads(out, group, n) if n > 1 else out


def register_hf() -> str:
    """Register Ulysses attention with transformers (samples from ``cp_batch``, group from the
    attention module); its name."""
    from hpcrl.models.ring_attention import hf_adapter, register_kernel

    run = lambda q, k, v, batch, group, scale: ulysses_attention(  # noqa: E731
        q, k, v, segments=batch.segments, group=group, scale=scale
    )
    return register_kernel(HF_NAME, hf_adapter("ulysses", run))
