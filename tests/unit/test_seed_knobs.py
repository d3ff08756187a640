"""Seed 004's knobs to tune, with hand-checked numbers: an entropy bonus (trainer.loss.entropy_coef)
and reward clipping (orchestrator.advantage.reward_clip); and the perf/mfu peak table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpcrl.orchestrator.advantages import AdvantageConfig, compute_advantages
from hpcrl.trainer.loss import LossParams, compute_loss
from hpcrl.trainer.perf import gpu_peak_tflops, perf_metrics


def _loss(coef: float, adv: float) -> tuple[float, float]:
    """One sample of two tokens; token 1 is trained, sampled with p = 0.25 by the same policy."""
    lp = torch.tensor([0.0, math.log(0.25)], requires_grad=True)
    out = compute_loss(
        LossParams(entropy_coef=coef),
        trainer_logprobs=lp,
        loss_mask=torch.tensor([False, True]),
        num_loss_tokens=1,
        inference_logprobs=torch.tensor([0.0, math.log(0.25)]),
        advantages=torch.tensor([0.0, adv]),
    )
    out.loss.backward()
    return float(out.loss.detach()), float(lp.grad[1])


def test_entropy_bonus_adds_coef_times_surprise_to_the_advantage():
    # ratio 1; advantage 0 + 0.1 * -ln 0.25 = 0.138629; loss = -ratio * adv * logp = 0.138629 * 1.386294
    loss, grad = _loss(0.1, 0.0)
    assert loss == pytest.approx(0.1 * math.log(4) ** 2, rel=1e-6)  # 0.192181
    assert grad == pytest.approx(-0.1 * math.log(4), rel=1e-6)  # pushes log p(token) up: -0.138629
    assert _loss(0.0, 0.0) == (0.0, 0.0)  # off: no advantage, no gradient
    loss, grad = _loss(0.1, 0.5)  # added to a real advantage: 0.5 + 0.138629
    assert grad == pytest.approx(-(0.5 + 0.1 * math.log(4)), rel=1e-6)


def test_entropy_bonus_gradient_is_the_entropy_gradient_in_expectation():
    """Summed over every token a (weighted by p(a)), the bonus's surrogate gradient w.r.t. the logits
    equals dH/dlogits: here for p = softmax([1, 0, -1])."""
    logits = torch.tensor([1.0, 0.0, -1.0], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    p = logp.exp().detach()
    surrogate = -(p * (-logp.detach()) * logp).sum()  # E_a[-(bonus_a) * log p(a)]
    (g_bonus,) = torch.autograd.grad(-surrogate, logits)
    logits2 = logits.detach().clone().requires_grad_(True)
    lp2 = torch.log_softmax(logits2, -1)
    (g_entropy,) = torch.autograd.grad(-(lp2.exp() * lp2).sum(), logits2)
    assert torch.allclose(g_bonus, g_entropy, atol=1e-6)


def test_reward_clip_bounds_rewards_before_group_advantages():
    rewards = [3.0, 0.0, -5.0]
    (raw,), _ = compute_advantages([rewards])
    assert raw == pytest.approx([3 + 2 / 3, 2 / 3, -5 + 2 / 3], rel=1e-6)  # mean -2/3
    (clipped,), _ = compute_advantages([rewards], config=AdvantageConfig(reward_clip=1.0))
    assert clipped == pytest.approx([1.0, 0.0, -1.0])  # [1, 0, -1], mean 0
    # a group that differs only above the clip has no signal left: dropped as zero-advantage
    _, keep = compute_advantages([[2.0, 3.0]], config=AdvantageConfig(reward_clip=1.0))
    assert not keep[0]
    with pytest.raises(ValueError, match="reward_clip"):
        AdvantageConfig(reward_clip=0.0)


def test_mfu_from_the_gpu_name_or_a_configured_peak():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("Some Future Accelerator") is None
    # 1e9 params, 2 GPUs at 200k tokens/s together: 6e9 * 1e5 / 989e12 per GPU
    m = perf_metrics(2e5, 2, 10**9, 989.0)
    assert m["perf/throughput_per_gpu"] == 1e5
    assert m["perf/mfu"] == pytest.approx(6e14 / 989e12)  # 0.60667
    if not torch.cuda.is_available():
        assert "perf/mfu" not in perf_metrics(2e5, 2, 10**9, None)  # CPU without a figure: none
    assert np.isfinite(m["perf/mfu"])
