"""Context parallelism (``trainer.model.cp = N``): each micro-batch's packed row is split along time
over the N ranks of a cp group; attention is :mod:`hpcrl.models.ring_attention`.

Ranks are ``dp x cp``: ranks ``g*cp .. g*cp+cp-1`` form cp group ``g``. The orchestrator still
writes one shard per trainer rank; the ranks of a cp group read all the group's shards and train
their union (:func:`merge_batches`), each on its slice of every micro-batch. FSDP shards over all
ranks and SUM-reduces gradients; every rank divides its loss by the step's global loss-token count
and counts only the tokens it predicts (:func:`owned_tokens`), so the summed gradient is exactly the
gradient of cp = 1.

A micro-batch is one packed row (no row layout, no shared prefixes: ``trainer.share_prefix`` is
ignored under cp, because a shared prefix's slots would belong to one rank while its members'
tokens sit on others). The row is padded to a multiple of cp with a padding sample of its own
(loss mask off) and rank ``r`` takes tokens ``[r*L, (r+1)*L)``, ``L = padded / cp``. The logprob of
token ``t`` comes from the rank that holds position ``t-1`` (it owns the hidden state that predicts
``t``), so a token whose predictor sits on the previous rank is still counted once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor

from hpcrl.bus.messages import SAMPLE_FIELDS, TOKEN_FIELDS, compact_routes
from hpcrl.models.chunked import DEFAULT_CHUNK, can_chunk, head_logprobs, kept_logits, vocab_parallel
from hpcrl.models.parallelize import CPGroup
from hpcrl.models.ring_attention import CPBatch
from hpcrl.trainer.packing import ForwardOutput, PackedBatch, next_token_logprobs, sample_starts


def merge_batches(batches: list[Any]) -> Any:
    """One TrainBatch holding the samples of ``batches`` (a cp group's shards), in rank order."""
    first = batches[0]
    if len(batches) == 1:
        return first

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(b, name) for b in batches]
        if name == "ce_weights" and any(p is not None for p in parts):  # a shard without: no ce token
            parts = [
                np.zeros(len(b.input_ids), np.float32) if p is None else p for b, p in zip(batches, parts)
            ]
        return None if any(p is None for p in parts) else np.concatenate([np.asarray(p) for p in parts])

    arrays = TOKEN_FIELDS + SAMPLE_FIELDS  # the rest: ROW_FIELDS, below
    env_names = [n for b in batches for n in b.env_names]
    return msgspec.structs.replace(
        first, env_names=env_names, routed_experts=_merged_routes(batches), **{n: cat(n) for n in arrays}
    )


def _merged_routes(batches: list[Any]) -> np.ndarray | None:
    """The shards' router-replay rows in rank order (-1 rows for a shard without, None if none has
    any). Through ``route_ids``: one shard may travel as uint8 (255 = none), another as int16."""
    widths = {b.routed_experts.shape[1] for b in batches if b.routed_experts is not None}
    if len(widths) != 1:
        return None
    (w,) = widths
    parts = [
        b.route_ids() if b.routed_experts is not None else np.full((len(b.input_ids), w), -1, np.int64)
        for b in batches
    ]
    return compact_routes(np.concatenate(parts))


def local_range(num_tokens: int, cp: int, rank: int) -> tuple[int, int, int]:
    """(padded length, first, end) of this rank's slice of a row of ``num_tokens``."""
    padded = -(-num_tokens // cp) * cp
    width = padded // cp
    return padded, rank * width, (rank + 1) * width


def local_routes(routed: Tensor, pad: int, lo: int, hi: int) -> Tensor:
    """``[1, hi - lo, layers*k]``: the routes of tokens ``[lo, hi)`` of the row padded by ``pad``
    tokens (-1: route freely)."""
    if pad:
        routed = torch.cat([routed, routed.new_full((pad, routed.shape[1]), -1)])
    return routed[None, lo:hi]


def owned_tokens(num_tokens: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """[T] bool: tokens whose predicting position (t - 1) is on this rank."""
    _, lo, hi = local_range(num_tokens, cp, rank)
    t = torch.arange(num_tokens, device=device)
    return (t - 1 >= lo) & (t - 1 < hi)


def restrict(mb: PackedBatch, g: CPGroup) -> PackedBatch:
    """``mb`` with the loss mask (and echo's ce weights) limited to the tokens this rank predicts."""
    own = owned_tokens(mb.num_tokens, g.size, g.rank, mb.loss_mask.device)
    ce = None if mb.ce_weights is None else mb.ce_weights * own
    return replace(mb, loss_mask=mb.loss_mask.bool() & own, ce_weights=ce)


def forward_cp(
    model: torch.nn.Module,
    mb: PackedBatch,
    g: CPGroup,
    *,
    compute_entropy: bool = True,
    wanted: Tensor | None = None,
    chunk_tokens: int = 0,
) -> ForwardOutput:
    """:func:`hpcrl.trainer.packing.forward_packed` for this rank's slice of ``mb`` (one packed row,
    ring attention): logprobs ``[T]`` hold this rank's predicted tokens (see :func:`owned_tokens`),
    0 elsewhere. Every rank of the group must call it with the same ``mb``."""
    dev = mb.input_ids.device
    t = mb.num_tokens
    padded, lo, hi = local_range(t, g.size, g.rank)
    pad = padded - t
    seg = torch.repeat_interleave(torch.arange(mb.num_samples, device=dev), mb.seq_lens.to(dev))
    ids, pos = mb.input_ids, mb.position_ids
    if pad:  # a padding sample of its own: attends only to itself, predicts nothing
        seg = torch.cat([seg, torch.full((pad,), mb.num_samples, device=dev)])
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype, device=dev)])
        pos = torch.cat([pos, torch.arange(pad, device=dev)])
    target = torch.ones(t, dtype=torch.bool, device=dev) if wanted is None else wanted.to(dev).bool().clone()
    target[sample_starts(mb.seq_lens.to(dev))] = False
    target &= owned_tokens(t, g.size, g.rank, dev)
    tok = target.nonzero()[:, 0]  # tokens this rank predicts
    pred = tok - 1  # their predicting positions, all in [lo, hi)
    keep = torch.zeros(1, hi - lo, dtype=torch.bool, device=dev)
    keep[0, pred - lo] = True
    # the layout travels with the call; the group was bound to the attention when cp was applied
    batch = CPBatch(seg[lo:hi], torch.arange(lo, hi, device=dev))
    inputs = {"input_ids": ids[None, lo:hi], "position_ids": pos[None, lo:hi], "cp_batch": batch}
    if mb.routed_experts is not None:  # router replay: this rank's tokens' routes (padding routes freely)
        inputs["routed_experts"] = local_routes(mb.routed_experts, pad, lo, hi)
    if mb.temperatures is None:
        temp: Tensor | float = 1.0
    else:
        temp = mb.temperatures.to(dev)[seg[pred]]
    if vocab_parallel(model):  # no rank holds the whole head: chunked always
        chunk = chunk_tokens or DEFAULT_CHUNK
        picked, ent_p = head_logprobs(
            model, inputs, keep, ids[tok], temp, chunk=chunk, entropy=compute_entropy
        )
    elif chunk_tokens > 0 and can_chunk(model):
        picked, ent_p = head_logprobs(
            model, inputs, keep, ids[tok], temp, chunk=chunk_tokens, entropy=compute_entropy
        )
    else:
        logits = kept_logits(model, inputs, keep)
        picked, ent_p = next_token_logprobs(logits, ids[tok], temp, entropy=compute_entropy)
    lp = torch.zeros(t, dtype=picked.dtype, device=dev).index_copy(0, tok, picked)
    ent = None if ent_p is None else torch.zeros(t, dtype=ent_p.dtype, device=dev).index_copy(0, tok, ent_p)
    return ForwardOutput(logprobs=lp, entropy=ent, slots=hi - lo, padding=max(0, hi - max(lo, t)))
