"""Batched logits processing and sampling with per-row parameters (pure torch, no model).

The log-probabilities returned are those of the distribution the token was actually drawn from:
repetition penalty, then temperature, then top-k, top-p and min-p filtering, then a softmax. RL needs
exactly these (the importance ratio compares the trainer's policy with the sampling policy).

For greedy rows (temperature 0) the distribution is a point mass; we report the log-probability under
the penalised and filtered distribution at temperature 1 instead, which is what a trainer at temperature
1 would compute, rather than a useless 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5
MAX_PENALISED_LOGIT = 1e30  # / GREEDY_EPS stays finite in float32 (max 3.4e38)


@dataclass
class RowParams:
    """The sampling parameters one batch row needs."""

    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None  # per-request seed; None: the engine's shared generator


def apply_repetition_penalty(
    logits: torch.Tensor, seen: Sequence[Sequence[int] | None], penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL-style penalty (as HF and vLLM): divide positive, multiply negative logits of seen tokens."""
    rows = [i for i, s in enumerate(seen) if s is not None and penalty[i] != 1.0]
    if not rows:
        return logits
    mask = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for j, i in enumerate(rows):
        ids = torch.as_tensor(list(seen[i]), dtype=torch.long, device=logits.device)  # type: ignore[arg-type]
        mask[j, ids] = True
    sub = logits[rows]
    p = penalty[rows].unsqueeze(1)
    sub = torch.where(mask, torch.where(sub > 0, sub / p, sub * p), sub)
    # A tiny penalty (1e-40 is 0 in float32) would make logits inf and every logprob NaN: keep them
    # finite, with room for the smallest temperature to divide them.
    sub = sub.clamp(-MAX_PENALISED_LOGIT, MAX_PENALISED_LOGIT)
    logits = logits.clone()
    logits[rows] = sub
    return logits


@dataclass
class BatchParams:
    """Per-row sampling parameters as tensors, built once per batch composition (not every step);
    the `any_*` flags let a step skip filters no row uses without a device sync."""

    rows: list[RowParams]
    temperature: torch.Tensor  # [B] 1 for greedy rows (their logprobs are reported at temperature 1)
    greedy: torch.Tensor  # [B] bool
    penalty: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] 0 = off
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    any_temperature: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    seeded: list[int]  # rows with their own generator

    @classmethod
    def of(cls, rows: Sequence[RowParams], vocab: int, device: torch.device | str = "cpu") -> BatchParams:
        rows = list(rows)
        greedy = [p.temperature < GREEDY_EPS for p in rows]
        temp = [1.0 if g else p.temperature for p, g in zip(rows, greedy)]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in rows]
        return cls(
            rows=rows,
            temperature=torch.tensor(temp, device=device),
            greedy=torch.tensor(greedy, device=device),
            penalty=torch.tensor([p.repetition_penalty for p in rows], device=device),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in rows], device=device),
            min_p=torch.tensor([p.min_p for p in rows], device=device),
            any_temperature=any(t != 1.0 for t in temp),
            any_penalty=any(p.repetition_penalty != 1.0 for p in rows),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in rows),
            any_min_p=any(p.min_p > 0 for p in rows),
            seeded=[i for i, p in enumerate(rows) if p.generator is not None],
        )


def processed_logprobs(
    logits: torch.Tensor,
    params: Sequence[RowParams] | BatchParams,
    seen: Sequence[Sequence[int] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (log-probabilities of the sampling distribution [B, V], greedy mask [B])."""
    logits = logits.float()
    v = logits.shape[1]
    bp = params if isinstance(params, BatchParams) else BatchParams.of(params, v, logits.device)
    if seen is not None and bp.any_penalty:
        logits = apply_repetition_penalty(logits, seen, bp.penalty)
    if bp.any_temperature:  # x / 1 == x exactly, so skipping it changes no bit
        logits = logits / bp.temperature.unsqueeze(1)
    neg = torch.finfo(logits.dtype).min

    if bp.any_top_k:
        top_k = bp.top_k
        kth = torch.topk(logits, int(top_k.max()), dim=1).values
        thresh = kth.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
        drop = (logits < thresh) & (top_k > 0).unsqueeze(1)
        logits = logits.masked_fill(drop, neg)

    if bp.any_top_p:
        sorted_logits, order = torch.sort(logits, dim=1, descending=True)
        probs = torch.softmax(sorted_logits, dim=1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(dim=1) - probs) >= bp.top_p.unsqueeze(1)
        drop_sorted[:, 0] = False  # the likeliest token stays, even for a top_p that is 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg)

    if bp.any_min_p:
        probs = torch.softmax(logits, dim=1)
        drop = probs < (bp.min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values)
        logits = logits.masked_fill(drop, neg)

    return torch.log_softmax(logits, dim=1), bp.greedy


def sample(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    params: Sequence[RowParams] | BatchParams,
    shared: torch.Generator,
) -> torch.Tensor:
    """Draw one token per row: argmax for greedy rows, else the exponential race (= multinomial).

    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i, and lets every row use its
    own generator without a Python loop over the vocabulary.
    """
    b, v = logprobs.shape
    dev = logprobs.device
    rows = params.rows if isinstance(params, BatchParams) else list(params)
    seeded = (
        params.seeded
        if isinstance(params, BatchParams)
        else [i for i, p in enumerate(rows) if p.generator is not None]
    )
    if not seeded:  # the common case: one draw for the whole batch
        noise = torch.empty(b, v, device=dev).exponential_(generator=shared)
    else:
        noise = torch.empty(b, v, device=dev)
        if len(seeded) < b:
            shared_rows = torch.tensor([i for i in range(b) if rows[i].generator is None], device=dev)
            noise[shared_rows] = torch.empty(len(shared_rows), v, device=dev).exponential_(generator=shared)
        for i in seeded:  # each seeded row draws from its own stream, whatever its neighbours
            noise[i] = torch.empty(v, device=dev).exponential_(generator=rows[i].generator)
    # A zero draw would turn 0/0 into NaN for filtered tokens.
    drawn = (logprobs.exp() / noise.clamp_(min=1e-30)).argmax(dim=1)
    return torch.where(greedy, logprobs.argmax(dim=1), drawn)
