"""Trainer losses as pure functions: flat per-token tensors in, a scalar loss and summable stats out.

Every per-token tensor is 1-D ``[T]`` and aligned with the packed ``input_ids``: the value at ``t``
describes token ``t`` (its logprob given the tokens before it, its advantage, whether it is trained).

Conventions that make multi-rank / micro-batch accumulation exact:

* The loss is a SUM over loss tokens divided by ``num_loss_tokens``, the number of loss tokens in the
  whole optimizer step (all micro-batches, all ranks). Summing the per-micro-batch losses (and
  their gradients, with a sum-reducing data-parallel wrapper) therefore gives exactly the loss of one
  big batch.
* Stats are SUMS (plus the counts needed to average them), so the loop can add them over
  micro-batches, all-reduce them once, and call :func:`summarize` at the end.
* Masked positions contribute exactly zero to values and gradients: inputs are sanitised with
  ``torch.where`` before any arithmetic, so a NaN/inf in a masked slot (e.g. a prompt token with no
  inference logprob) cannot leak through ``0 * inf``.

RL loss types (``LossParams.type``), with ``r = exp(clamp(logp - logp_inf))`` the per-token
importance ratio between the trainer and the policy that sampled the token:

* ``default`` (prime-rl style masked importance sampling): gradient ``-sg(r) * A * grad(logp)`` on
  tokens inside the trust region; a token is masked (zero gradient) when its probability already
  moved too far in the direction the advantage pushes: ``A > 0 and r > 1 + eps_high`` or
  ``A < 0 and r < 1 - eps_low``. Unlike PPO's clip this drops the token rather than keeping a
  constant, and it never masks a token the update would pull back towards the sampler.
* ``cispo``: every loss token keeps its gradient, with a clipped, stop-gradient weight
  ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` (MiniMax-M1).
* ``grpo``: the PPO clipped surrogate ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.

Modes (``LossParams.mode``; ``[orchestrator.algo] type`` picks it, AlgoConfig.loss_mode: prime-rl's
``rl`` loss is ``rl``, its ``ref_kl`` is ``opd``, its ``ce`` is ``sft``; docs/algorithms.md):

* ``rl`` (grpo, max_rl, rae, echo): advantages come from the batch. echo's batches also carry
  ``ce_weights`` on env-provided tokens outside the loss mask: :func:`ce_loss` adds prime-rl's ``ce``
  component, normalised by its own token count.
* ``opd`` (on-policy distillation; opd and opsd): the student samples, the reference (a frozen
  teacher, or for opsd the policy shown a demonstration) scores the same tokens, and
  the per-token advantage is ``teacher_logprob - inference_logprob`` (= minus the per-token reverse
  KL sample ``log pi_student - log pi_teacher``, taken with the sampler's logprob as in Thinking
  Machines' on-policy distillation). Plugged into the policy-gradient loss above, its expected
  gradient is the gradient of the reverse KL(student || teacher) with per-token (discount 0)
  credit, and the same importance ratio corrects for the sampler lagging the trainer. We prefer
  this over a differentiable KL loss on sampled tokens because that one has a biased gradient
  (it ignores that the sampling distribution depends on the parameters).
* ``sft`` (sft): cross entropy ``-logp`` on loss tokens (hard distillation / plain SFT). Inference
  logprobs are not needed.

Rollout mismatch correction (the sampler is not the trainer: FP8 or another kernel, docs/fp8.md).
All off by default; ``r`` is the same trainer/sampler ratio, every threshold is on ``r`` itself:

* TIS (``use_tis``, ``tis_clip``; slime's names, verl's ``rollout_is = "token"``): the token's
  importance weight is truncated at ``C = tis_clip`` as a detached weight: default ``sg(min(r, C))``,
  cispo ``clip(min(r, C))``, grpo's surrogate times ``sg(min(r, C) / r)``. A token's gradient weight
  then never exceeds ``C |A|``: bias for bounded variance (Yao et al., "Your efficient RL framework
  secretly brings you off-policy RL training").
* MIS, masking (prime-rl #1404's names; verl's ``rollout_rs`` token / sequence / geometric): a masked
  token gets zero gradient. ``token_mask_low/high``: the token's ``r`` is outside ``[low, high]``;
  ``sequence_mask_low/high``: the whole sample, when any of its loss tokens' ``r`` is below ``low`` /
  above ``high``; ``geo_mask_low/high``: the whole sample, when the geometric mean of its ``r`` (exp of
  the mean log-ratio) leaves ``[low, high]`` (``seq_mask_low/high`` is the same test in log space).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["default", "cispo", "grpo"]
LossMode = Literal["rl", "opd", "sft"]
KLEstimator = Literal["k1", "k2", "k3"]

_LOSS_TYPES = ("default", "cispo", "grpo")
_LOSS_MODES = ("rl", "opd", "sft")
_KL_ESTIMATORS = ("k1", "k2", "k3")
_KL_TARGETS = ("reference", "inference")


@dataclass(frozen=True)
class LossParams:
    """Knobs of the trainer loss. The config layer maps its ``loss`` section onto this.

    Defaults: ``eps_low = 0.2`` / ``eps_high = 0.28`` are the asymmetric "clip-higher" bounds of
    DAPO that prime-rl-style trainers use (a bit more room for raising a token's probability than
    for lowering it, which slows entropy collapse); ``max_log_ratio = 20`` only guards ``exp``.
    """

    type: LossType = "default"
    mode: LossMode = "rl"
    eps_low: float = 0.2
    eps_high: float = 0.28
    max_log_ratio: float = 20.0
    kl_coef: float = 0.0
    # Entropy bonus: coef * -log pi(token) joins the token's advantage. E_a[-log pi(a) grad log pi(a)]
    # = grad H(pi) at each position, so the bonus's policy gradient is coef * grad H in expectation.
    entropy_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    # "reference": against ref_logprobs in the batch; "inference": against the sampler's logprobs.
    kl_target: Literal["reference", "inference"] = "reference"
    # Mask a whole sample when the mean log-ratio over its loss tokens leaves [low, high].
    seq_mask_low: float | None = None
    seq_mask_high: float | None = None
    # Rollout mismatch correction (module docstring): TIS, then MIS at token / sequence / geo level.
    use_tis: bool = False
    tis_clip: float = 2.0
    token_mask_low: float | None = None
    token_mask_high: float | None = None
    sequence_mask_low: float | None = None
    sequence_mask_high: float | None = None
    geo_mask_low: float | None = None
    geo_mask_high: float | None = None

    def __post_init__(self) -> None:
        if self.type not in _LOSS_TYPES:
            raise ValueError(f"loss.type: {self.type!r} is not one of {_LOSS_TYPES}")
        if self.mode not in _LOSS_MODES:
            raise ValueError(f"loss.mode: {self.mode!r} is not one of {_LOSS_MODES}")
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator: {self.kl_estimator!r} is not one of {_KL_ESTIMATORS}")
        if self.kl_target not in _KL_TARGETS:
            raise ValueError(f"loss.kl_target: {self.kl_target!r} is not one of {_KL_TARGETS}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"loss.eps_low: {self.eps_low} must be in [0, 1)")
        if self.eps_high < 0.0:
            raise ValueError(f"loss.eps_high: {self.eps_high} must be >= 0")
        if self.max_log_ratio <= 0.0:
            raise ValueError(f"loss.max_log_ratio: {self.max_log_ratio} must be > 0")
        if self.entropy_coef < 0.0:
            raise ValueError(f"loss.entropy_coef: {self.entropy_coef} must be >= 0")
        if self.kl_coef < 0.0:
            raise ValueError(f"loss.kl_coef: {self.kl_coef} must be >= 0")
        lo, hi = self.seq_mask_low, self.seq_mask_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"loss.seq_mask_low ({lo}) must be < loss.seq_mask_high ({hi})")
        if not self.tis_clip > 0.0:
            raise ValueError(f"loss.tis_clip: {self.tis_clip} must be > 0 (a cap on the importance ratio)")
        for level in ("token", "sequence", "geo"):
            lo, hi = getattr(self, f"{level}_mask_low"), getattr(self, f"{level}_mask_high")
            for side, v in (("low", lo), ("high", hi)):
                if v is not None and not v > 0.0:
                    raise ValueError(f"loss.{level}_mask_{side}: {v} must be > 0 (a bound on the ratio)")
            if lo is not None and hi is not None and lo >= hi:
                raise ValueError(f"loss.{level}_mask_low ({lo}) must be < loss.{level}_mask_high ({hi})")

    @property
    def masks_samples(self) -> bool:
        """True when some mask drops whole samples (it needs ``seq_lens``)."""
        bounds = ("seq_mask", "sequence_mask", "geo_mask")
        return any(getattr(self, f"{b}_{s}") is not None for b in bounds for s in ("low", "high"))


@dataclass
class LossOutput:
    """``loss``: scalar to backpropagate (already divided by the global token count).
    ``stats``: detached sums/counts; add them across micro-batches and ranks, then :func:`summarize`."""

    loss: Tensor
    stats: dict[str, Tensor]
    # [T] detached per-token mismatch KL (0 off the loss mask); RL only: per-env / std / max metrics
    token_kl: Tensor | None = None


# Keys of LossOutput.stats, in a fixed order so the loop can stack them into one tensor to all-reduce.
STAT_KEYS = (
    "loss",
    "loss_tokens",
    "entropy_sum",
    "mismatch_kl_sum",
    "ratio_sum",
    "pos_tokens",
    "pos_masked",
    "neg_tokens",
    "neg_masked",
    "seq_masked_tokens",
    "token_masked_tokens",
    "tis_truncated_tokens",
    "ce_loss",  # echo's cross-entropy term (already normalised by the step's ce tokens)
    "ce_tokens",
    "ce_nll_sum",  # unweighted -logp over the ce tokens
)


def masked_where(mask: Tensor, x: Tensor) -> Tensor:
    """``x`` on ``mask``, exactly 0 elsewhere (also where ``x`` is NaN/inf); gradient 0 off the mask."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def importance_log_ratio(
    trainer_logprobs: Tensor, inference_logprobs: Tensor, max_log_ratio: float
) -> Tensor:
    """``clamp(logp_trainer - logp_inference, -m, m)``: clamped before ``exp`` so the ratio stays finite."""
    return torch.clamp(trainer_logprobs - inference_logprobs, -max_log_ratio, max_log_ratio)


def kl_estimate(
    logprobs: Tensor, target_logprobs: Tensor, estimator: KLEstimator, max_log_ratio: float = 20.0
) -> Tensor:
    """Per-token estimate of KL(pi || target) from tokens sampled by ``pi`` (Schulman's k1/k2/k3).

    With ``d = log target - log pi`` (clamped to +-max_log_ratio so exp stays finite):
    k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d (unbiased and >= 0)."""
    d = torch.clamp(target_logprobs - logprobs, -max_log_ratio, max_log_ratio)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {_KL_ESTIMATORS}")


def trust_region_mask(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """True where a token is dropped: its probability already moved past the trust region in the
    direction its advantage pushes (up for A > 0, down for A < 0)."""
    too_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    too_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    return too_high | too_low


def segment_ids(seq_lens: Tensor) -> Tensor:
    """``[2, 3] -> [0, 0, 1, 1, 1]``: the sample index of every token of a packed row."""
    return torch.repeat_interleave(torch.arange(len(seq_lens), device=seq_lens.device), seq_lens)


def sequence_mask(
    log_ratio: Tensor, loss_mask: Tensor, seq_lens: Tensor, low: float | None, high: float | None
) -> Tensor:
    """Per-token bool, True for every token of a sample whose mean log-ratio over its loss tokens is
    outside ``[low, high]``. Samples without loss tokens are never masked (nothing to mask)."""
    if low is None and high is None:
        return torch.zeros_like(loss_mask)
    seg = segment_ids(seq_lens)
    if seg.numel() != log_ratio.numel():
        raise ValueError(f"sum(seq_lens) = {seg.numel()} but there are {log_ratio.numel()} tokens")
    lr = masked_where(loss_mask, log_ratio).detach()
    sums = torch.zeros(len(seq_lens), dtype=lr.dtype, device=lr.device).index_add_(0, seg, lr)
    counts = torch.zeros(len(seq_lens), dtype=lr.dtype, device=lr.device).index_add_(
        0, seg, loss_mask.to(lr.dtype)
    )
    mean = sums / counts.clamp(min=1.0)
    bad = torch.zeros(len(seq_lens), dtype=torch.bool, device=lr.device)
    if low is not None:
        bad |= mean < low
    if high is not None:
        bad |= mean > high
    bad &= counts > 0
    return bad[seg]


def _log_or_none(x: float | None) -> float | None:
    return None if x is None else math.log(x)


def extreme_token_mask(
    log_ratio: Tensor, loss_mask: Tensor, seq_lens: Tensor, low: float | None, high: float | None
) -> Tensor:
    """Per-token bool, True for every token of a sample in which some loss token's ratio is below
    ``low`` or above ``high`` (ratio bounds; prime-rl's sequence_mask_low/high)."""
    if low is None and high is None:
        return torch.zeros_like(loss_mask)
    seg = segment_ids(seq_lens)
    lr = log_ratio.detach()
    inf = torch.full((), math.inf, dtype=lr.dtype, device=lr.device)
    bad = torch.zeros(len(seq_lens), dtype=torch.bool, device=lr.device)
    if low is not None:
        lo = torch.full((len(seq_lens),), math.inf, dtype=lr.dtype, device=lr.device)
        lo = lo.scatter_reduce(0, seg, torch.where(loss_mask, lr, inf), reduce="amin")
        bad |= lo < math.log(low)
    if high is not None:
        hi = torch.full((len(seq_lens),), -math.inf, dtype=lr.dtype, device=lr.device)
        hi = hi.scatter_reduce(0, seg, torch.where(loss_mask, lr, -inf), reduce="amax")
        bad |= hi > math.log(high)
    return bad[seg]


def sample_masks(params: LossParams, log_ratio: Tensor, loss_mask: Tensor, seq_lens: Tensor) -> Tensor:
    """Per-token bool: the token's sample is dropped by seq_mask, sequence_mask or geo_mask."""
    p = params
    bad = sequence_mask(log_ratio, loss_mask, seq_lens, p.seq_mask_low, p.seq_mask_high)
    geo_lo, geo_hi = _log_or_none(p.geo_mask_low), _log_or_none(p.geo_mask_high)
    bad = bad | sequence_mask(log_ratio, loss_mask, seq_lens, geo_lo, geo_hi)
    return bad | extreme_token_mask(log_ratio, loss_mask, seq_lens, p.sequence_mask_low, p.sequence_mask_high)


def token_ratio_mask(ratio: Tensor, loss_mask: Tensor, low: float | None, high: float | None) -> Tensor:
    """True on loss tokens whose ratio is outside ``[low, high]`` (prime-rl's token_mask_low/high)."""
    bad = torch.zeros_like(loss_mask)
    if low is not None:
        bad |= ratio < low
    if high is not None:
        bad |= ratio > high
    return bad & loss_mask


def compute_loss(
    params: LossParams,
    *,
    trainer_logprobs: Tensor,
    loss_mask: Tensor,
    num_loss_tokens: int | float | Tensor,
    inference_logprobs: Tensor | None = None,
    advantages: Tensor | None = None,
    entropy: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    seq_lens: Tensor | None = None,
    ce_weights: Tensor | None = None,
    num_ce_tokens: int | float = 0,
) -> LossOutput:
    """The loss of one micro-batch; see the module docstring for the maths.

    ``trainer_logprobs`` carries the gradient (computed at the sampling temperature);
    ``num_loss_tokens`` is the number of loss tokens of the whole step (all micro-batches and ranks);
    ``entropy`` (per token, optional) only feeds the stats; ``seq_lens`` is needed for sequence masks.
    ``ce_weights`` (echo) adds :func:`ce_loss` over its nonzero tokens, normalised by
    ``num_ce_tokens`` (the step's count of them).
    """
    out = _main_loss(
        params,
        trainer_logprobs=trainer_logprobs,
        loss_mask=loss_mask,
        num_loss_tokens=num_loss_tokens,
        inference_logprobs=inference_logprobs,
        advantages=advantages,
        entropy=entropy,
        teacher_logprobs=teacher_logprobs,
        ref_logprobs=ref_logprobs,
        seq_lens=seq_lens,
    )
    if ce_weights is None:
        return out
    ce, nll_sum, count = ce_loss(trainer_logprobs, ce_weights, num_ce_tokens)
    f32 = torch.float32
    out.stats["ce_loss"] = ce.detach().to(f32)
    out.stats["ce_tokens"] = count.to(f32)
    out.stats["ce_nll_sum"] = nll_sum.to(f32)
    out.stats["loss"] = out.stats["loss"] + out.stats["ce_loss"]
    return LossOutput(loss=out.loss + ce, stats=out.stats, token_kl=out.token_kl)


def ce_loss(
    trainer_logprobs: Tensor, ce_weights: Tensor, num_ce_tokens: int | float
) -> tuple[Tensor, Tensor, Tensor]:
    """echo's cross entropy, prime-rl's ``ce`` component (its trainer/rl/loss.py ``ce_loss_fn``, summed
    and divided by the step's ce-token count in ``compute_loss``): ``sum_t w_t * -logp_t / N_ce`` over
    the tokens with ``w_t != 0``, ``N_ce`` their number in the whole step (all micro-batches, all
    ranks; at least 1). Returns (loss, unweighted -logp sum, token count), the last two detached."""
    mask = ce_weights != 0
    logp = masked_where(mask, trainer_logprobs)
    w = masked_where(mask, ce_weights.to(logp.dtype))
    loss = -(w * logp).sum() / max(float(num_ce_tokens), 1.0)
    return loss, -logp.detach().sum(), mask.sum()


def _main_loss(
    params: LossParams,
    *,
    trainer_logprobs: Tensor,
    loss_mask: Tensor,
    num_loss_tokens: int | float | Tensor,
    inference_logprobs: Tensor | None,
    advantages: Tensor | None,
    entropy: Tensor | None,
    teacher_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    seq_lens: Tensor | None,
) -> LossOutput:
    """The loss mode's loss over the loss tokens (compute_loss without echo's term)."""
    loss_mask = loss_mask.bool()
    n = trainer_logprobs.numel()
    assert trainer_logprobs.dim() == 1 and loss_mask.shape == (n,), "per-token tensors must be flat [T]"
    denom = float(num_loss_tokens)
    if not denom > 0:
        # A step with no loss tokens must still run backward on every rank (FSDP collectives), so
        # divide by 1: the masked sum is exactly 0 anyway.
        denom = 1.0
    zero = trainer_logprobs.new_zeros(())
    logp = masked_where(loss_mask, trainer_logprobs)
    f32 = torch.float32

    stats: dict[str, Tensor] = {k: zero.detach().to(f32) for k in STAT_KEYS}
    stats["loss_tokens"] = loss_mask.sum().to(f32)
    if entropy is not None:
        stats["entropy_sum"] = masked_where(loss_mask, entropy.detach()).sum().to(f32)

    if params.mode == "sft":
        loss = -logp.sum() / denom
        stats["loss"] = loss.detach().to(f32)
        return LossOutput(loss=loss, stats=stats)

    if inference_logprobs is None:
        raise ValueError(f"loss mode {params.mode!r} needs inference_logprobs")
    inf_lp = masked_where(loss_mask, inference_logprobs)
    if params.mode == "opd":
        if teacher_logprobs is None:
            raise ValueError("loss mode 'opd' needs teacher_logprobs")
        adv = masked_where(loss_mask, teacher_logprobs) - inf_lp
    else:
        if advantages is None:
            raise ValueError("loss mode 'rl' needs advantages")
        adv = masked_where(loss_mask, advantages)
        if params.entropy_coef > 0.0:
            adv = adv + params.entropy_coef * masked_where(loss_mask, -logp.detach())
    adv = adv.detach()

    log_ratio = importance_log_ratio(logp, inf_lp, params.max_log_ratio)
    ratio = torch.exp(log_ratio)

    keep = loss_mask
    if seq_lens is not None or params.masks_samples:
        if seq_lens is None:
            raise ValueError("sample masks (seq_mask_*, sequence_mask_*, geo_mask_*) need seq_lens")
        seq_bad = sample_masks(params, log_ratio, loss_mask, seq_lens)
        stats["seq_masked_tokens"] = (seq_bad & loss_mask).sum().to(f32)
        keep = keep & ~seq_bad
    r_d = ratio.detach()
    mis_bad = token_ratio_mask(r_d, loss_mask, params.token_mask_low, params.token_mask_high)
    stats["token_masked_tokens"] = mis_bad.sum().to(f32)
    keep = keep & ~mis_bad
    # TIS: the detached weight is min(r, C) (the trust region below still tests the full ratio)
    r_w = torch.clamp(r_d, max=params.tis_clip) if params.use_tis else r_d
    if params.use_tis:
        stats["tis_truncated_tokens"] = (loss_mask & (r_d > params.tis_clip)).sum().to(f32)

    lo, hi = 1.0 - params.eps_low, 1.0 + params.eps_high
    token_bad = trust_region_mask(r_d, adv, params.eps_low, params.eps_high) & keep
    if params.type == "default":
        per_token = -r_w * adv * logp
        keep_pg = keep & ~token_bad
    elif params.type == "cispo":
        per_token = -torch.clamp(r_w, lo, hi) * adv * logp
        keep_pg = keep
    else:  # grpo: PPO clipped surrogate, gradient flows through the ratio (TIS: scaled by min(r, C) / r).
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv) * (r_w / r_d)
        keep_pg = keep

    per_token = masked_where(keep_pg, per_token)
    if params.kl_coef > 0.0:
        if params.kl_target == "reference":
            if ref_logprobs is None:
                raise ValueError("loss.kl_coef > 0 with kl_target 'reference' needs ref_logprobs")
            target = masked_where(loss_mask, ref_logprobs)
        else:
            target = inf_lp
        kl = kl_estimate(logp, target.detach(), params.kl_estimator, params.max_log_ratio)
        per_token = per_token + params.kl_coef * masked_where(keep, kl)
    loss = per_token.sum() / denom

    # Stats over all loss tokens (not only kept ones): they describe the batch, not the update.
    with torch.no_grad():
        lr_d = log_ratio.detach()
        stats["loss"] = loss.detach().to(f32)
        stats["mismatch_kl_sum"] = masked_where(loss_mask, torch.expm1(lr_d) - lr_d).sum().to(f32)
        stats["ratio_sum"] = masked_where(loss_mask, ratio.detach()).sum().to(f32)
        pos, neg = loss_mask & (adv > 0), loss_mask & (adv < 0)
        stats["pos_tokens"] = pos.sum().to(f32)
        stats["neg_tokens"] = neg.sum().to(f32)
        stats["pos_masked"] = (token_bad & pos).sum().to(f32)
        stats["neg_masked"] = (token_bad & neg).sum().to(f32)
        token_kl = masked_where(loss_mask, torch.expm1(lr_d) - lr_d).to(f32)
    return LossOutput(loss=loss, stats=stats, token_kl=token_kl)


def add_stats(total: dict[str, Tensor] | None, new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accumulate micro-batch stats (sums), key by key."""
    if total is None:
        return {k: v.detach().clone() for k, v in new.items()}
    return {k: total[k] + new[k].detach() for k in total}


def stack_stats(stats: dict[str, Tensor] | None) -> Tensor:
    """Stats as one float64 vector in ``STAT_KEYS`` order: one all-reduce for all of them. A step
    with no micro-batch anywhere (every sample filtered out) contributes zeros, not a crash."""
    if stats is None:
        return torch.zeros(len(STAT_KEYS), dtype=torch.float64)
    return torch.stack([stats[k].detach().double().reshape(()) for k in STAT_KEYS])


def unstack_stats(vec: Tensor) -> dict[str, Tensor]:
    assert vec.shape == (len(STAT_KEYS),)
    return {k: vec[i] for i, k in enumerate(STAT_KEYS)}


def summarize(stats: dict[str, Tensor]) -> dict[str, float]:
    """Turn (globally summed) stats into the metrics the loop logs.

    ``loss`` is already normalised by the global token count, so it is the step's loss; the other
    means are over loss tokens; masked fractions are over tokens of that advantage sign."""

    def ratio_of(a: str, b: str) -> float:
        den = float(stats[b])
        return float(stats[a]) / den if den > 0 else 0.0

    return {
        "loss": float(stats["loss"]),
        "entropy": ratio_of("entropy_sum", "loss_tokens"),
        "mismatch_kl": ratio_of("mismatch_kl_sum", "loss_tokens"),
        "ratio_mean": ratio_of("ratio_sum", "loss_tokens"),
        "masked_advantage_positive": ratio_of("pos_masked", "pos_tokens"),
        "masked_advantage_negative": ratio_of("neg_masked", "neg_tokens"),
        "seq_masked_fraction": ratio_of("seq_masked_tokens", "loss_tokens"),
        "token_masked_fraction": ratio_of("token_masked_tokens", "loss_tokens"),
        "tis_truncated_fraction": ratio_of("tis_truncated_tokens", "loss_tokens"),
        "loss_tokens": float(stats["loss_tokens"]),
        "ce_loss": float(stats["ce_loss"]),
        "ce_nll": ratio_of("ce_nll_sum", "ce_tokens"),
        "ce_tokens": float(stats["ce_tokens"]),
    }


def check_finite(loss: Tensor | float) -> bool:
    """False for NaN/inf: the loop logs it and skips the update instead of applying it."""
    return math.isfinite(float(loss))


def grads_are_finite(model: torch.nn.Module) -> bool:
    """True when every gradient is finite on every rank.

    The decision is all-reduced when torch.distributed is initialised, so all ranks skip (or apply)
    the same update; a rank stepping alone would desynchronise the shards. Collective: call it on
    every rank. (A non-finite grad norm from clipping is an equivalent, cheaper signal.)"""
    bad = torch.zeros((), dtype=torch.float32)
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad = torch.ones((), dtype=torch.float32)
            break
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dev = _collective_device()
        bad = bad.to(dev)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return float(bad) == 0.0


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
