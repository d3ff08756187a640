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


@dataclass
class RowParams:
    """The sampling parameters one batch row needs."""

    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None  # per-request seed; None: the engine's shared generator


def apply_repetition_penalty(logits: torch.Tensor, seen: Sequence[Sequence[int] | None],
                             penalty: torch.Tensor) -> torch.Tensor:
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
    logits = logits.clone()
    logits[rows] = sub
    return logits


def processed_logprobs(logits: torch.Tensor, params: Sequence[RowParams],
                       seen: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (log-probabilities of the sampling distribution [B, V], greedy mask [B])."""
    logits = logits.float()
    b, v = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    greedy = temp < GREEDY_EPS
    rp = torch.tensor([p.repetition_penalty for p in params], device=dev)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, rp)
    logits = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    neg = torch.finfo(logits.dtype).min

    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else 0 for p in params], device=dev)
    if bool((top_k > 0).any()):
        kmax = int(top_k.max())
        kth = torch.topk(logits, kmax, dim=1).values
        idx = (top_k.clamp(min=1) - 1).unsqueeze(1)
        thresh = kth.gather(1, idx)
        drop = (logits < thresh) & (top_k > 0).unsqueeze(1)
        logits = logits.masked_fill(drop, neg)

    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, dim=1, descending=True)
        probs = torch.softmax(sorted_logits, dim=1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(dim=1) - probs) >= top_p.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg)

    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=1)
        drop = probs < (min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values)
        logits = logits.masked_fill(drop, neg)

    return torch.log_softmax(logits, dim=1), greedy


def sample(logprobs: torch.Tensor, greedy: torch.Tensor, params: Sequence[RowParams],
           shared: torch.Generator) -> torch.Tensor:
    """Draw one token per row: argmax for greedy rows, else the exponential race (= multinomial).

    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i, and lets every row use its
    own generator without a Python loop over the vocabulary.
    """
    b, v = logprobs.shape
    noise = torch.empty(b, v, device=logprobs.device)
    shared_rows = [i for i, p in enumerate(params) if p.generator is None]
    if shared_rows:
        noise[shared_rows] = torch.empty(len(shared_rows), v, device=logprobs.device).exponential_(generator=shared)
    for i, p in enumerate(params):
        if p.generator is not None:
            noise[i] = torch.empty(v, device=logprobs.device).exponential_(generator=p.generator)
    # A zero draw would turn 0/0 into NaN for filtered tokens.
    drawn = (logprobs.exp() / noise.clamp_(min=1e-30)).argmax(dim=1)
    return torch.where(greedy, logprobs.argmax(dim=1), drawn)
