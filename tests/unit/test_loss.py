"""Trainer losses checked against numbers worked out by hand (the arithmetic is in the comments).

Shared fixture: four loss tokens sampled with probability 0.5 (inference logprob log 0.5), whose
trainer probabilities moved to 0.75, 0.55, 0.35, 0.45, i.e. ratios r = 1.5, 1.1, 0.7, 0.9, with
advantages +1, +1, -1, -1, and eps_low = 0.2, eps_high = 0.28 (trust region [0.8, 1.28]).
"""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.trainer.loss import (
    STAT_KEYS,
    LossParams,
    add_stats,
    check_finite,
    compute_loss,
    grads_are_finite,
    importance_log_ratio,
    kl_estimate,
    sequence_mask,
    stack_stats,
    summarize,
    unstack_stats,
)

LN = math.log
RATIOS = [1.5, 1.1, 0.7, 0.9]
ADV = [1.0, 1.0, -1.0, -1.0]


def fixture_inputs():
    lp = torch.tensor([LN(0.5 * r) for r in RATIOS], dtype=torch.float64, requires_grad=True)
    inf = torch.full((4,), LN(0.5), dtype=torch.float64)
    return lp, inf, torch.tensor(ADV, dtype=torch.float64), torch.ones(4, dtype=torch.bool)


def run(params: LossParams, **kw):
    lp, inf, adv, mask = fixture_inputs()
    out = compute_loss(
        params,
        trainer_logprobs=lp,
        inference_logprobs=inf,
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=4,
        **kw,
    )
    out.loss.backward()
    return out, lp.grad


def test_log_ratio_is_clamped_before_exp():
    # (-0.5) - (-1.0) = 0.5 stays; 0 - (-50) = 50 -> clamped to 20; -50 - 0 = -50 -> -20.
    lr = importance_log_ratio(torch.tensor([-0.5, 0.0, -50.0]), torch.tensor([-1.0, -50.0, 0.0]), 20.0)
    assert torch.allclose(lr, torch.tensor([0.5, 20.0, -20.0]))
    assert torch.isfinite(torch.exp(lr)).all()


def test_default_masks_by_advantage_sign():
    out, grad = run(LossParams(type="default"))
    # token0: A>0, r=1.5 > 1.28 -> masked.  token2: A<0, r=0.7 < 0.8 -> masked.  tokens 1, 3 kept.
    # kept: -r*A*logp:  token1 -1.1*(+1)*ln(0.55) = -1.1*(-0.597837) = 0.657621
    #                   token3 -0.9*(-1)*ln(0.45) = 0.9*(-0.798508)  = -0.718657
    # loss = (0.657621 - 0.718657) / 4 = -0.015259
    assert out.loss.item() == pytest.approx(-0.0152591, abs=1e-6)
    # d loss / d logp = -sg(r)*A/N on kept tokens: [0, -1.1/4, 0, +0.9/4] = [0, -0.275, 0, 0.225]
    assert torch.allclose(grad, torch.tensor([0.0, -0.275, 0.0, 0.225], dtype=torch.float64))
    m = summarize(out.stats)
    assert m["masked_advantage_positive"] == pytest.approx(0.5)  # 1 of 2 positive tokens
    assert m["masked_advantage_negative"] == pytest.approx(0.5)  # 1 of 2 negative tokens


def test_mismatch_kl_and_ratio_metrics():
    out, _ = run(LossParams())
    # k3 per token = r - 1 - ln r:  1.5: 0.5 - 0.405465 = 0.094535   1.1: 0.1 - 0.095310 = 0.004690
    #                               0.7: -0.3 + 0.356675 = 0.056675  0.9: -0.1 + 0.105361 = 0.005361
    # mean = 0.161261 / 4 = 0.040315;  ratio mean = (1.5 + 1.1 + 0.7 + 0.9) / 4 = 1.05
    m = summarize(out.stats)
    assert m["mismatch_kl"] == pytest.approx(0.040315, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.05)
    assert m["loss_tokens"] == 4


def test_cispo_keeps_every_token_with_clipped_weight():
    out, grad = run(LossParams(type="cispo"))
    # w = clip(r, 0.8, 1.28) = [1.28, 1.1, 0.8, 0.9];  -w*A*logp:
    #   token0 -1.28*ln(0.75) = 0.368233   token1 0.657621
    #   token2 -0.8*(-1)*ln(0.35) = 0.8*(-1.049822) = -0.839858   token3 -0.718657
    # loss = (0.368233 + 0.657621 - 0.839858 - 0.718657) / 4 = -0.532661 / 4 = -0.133165
    assert out.loss.item() == pytest.approx(-0.133165, abs=1e-6)
    # gradient -w*A/N = [-0.32, -0.275, 0.2, 0.225]
    assert torch.allclose(grad, torch.tensor([-0.32, -0.275, 0.2, 0.225], dtype=torch.float64))


def test_grpo_clipped_surrogate():
    out, grad = run(LossParams(type="grpo"))
    # -min(r*A, clip(r)*A): token0 -min(1.5, 1.28) = -1.28; token1 -1.1;
    #                       token2 -min(-0.7, -0.8) = 0.8;  token3 -min(-0.9, -0.9) = 0.9
    # loss = (-1.28 - 1.1 + 0.8 + 0.9) / 4 = -0.17
    assert out.loss.item() == pytest.approx(-0.17, abs=1e-9)
    # clipped tokens have no gradient; d(-r*A)/dlogp = -r*A: token1 -1.1/4, token3 +0.9/4
    assert torch.allclose(grad, torch.tensor([0.0, -0.275, 0.0, 0.225], dtype=torch.float64))


def test_global_token_normalisation_sums_over_micro_batches():
    params = LossParams()
    lp, inf, adv, mask = fixture_inputs()
    whole = compute_loss(
        params, trainer_logprobs=lp, inference_logprobs=inf, advantages=adv, loss_mask=mask, num_loss_tokens=4
    )
    whole.loss.backward()
    g_whole = lp.grad.clone()
    lp.grad = None
    parts = [
        compute_loss(
            params,
            trainer_logprobs=lp[s],
            inference_logprobs=inf[s],
            advantages=adv[s],
            loss_mask=mask[s],
            num_loss_tokens=4,
        )
        for s in (slice(0, 1), slice(1, 4))
    ]
    total = parts[0].loss + parts[1].loss
    total.backward()
    assert total.item() == pytest.approx(whole.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, g_whole)
    summed = add_stats(add_stats(None, parts[0].stats), parts[1].stats)
    assert summarize(summed) == pytest.approx(summarize(whole.stats))
    # the all-reduce vector round-trips
    assert summarize(unstack_stats(stack_stats(summed))) == pytest.approx(summarize(summed))
    assert len(stack_stats(summed)) == len(STAT_KEYS)


def test_masked_positions_are_exactly_zero_even_with_nan_and_inf():
    # Token 1 is a prompt token: garbage everywhere (NaN inference logprob, inf advantage, -inf teacher).
    lp = torch.tensor([LN(0.5), float("-inf"), LN(0.5)], requires_grad=True)
    inf = torch.tensor([LN(0.5), float("nan"), LN(0.5)])
    adv = torch.tensor([1.0, float("inf"), -1.0])
    mask = torch.tensor([True, False, True])
    for params in (
        LossParams(),
        LossParams(type="cispo"),
        LossParams(type="grpo"),
        LossParams(kl_coef=0.1, kl_target="inference"),
        LossParams(mode="sft"),
    ):
        lp.grad = None
        out = compute_loss(
            params,
            trainer_logprobs=lp,
            inference_logprobs=inf,
            advantages=adv,
            loss_mask=mask,
            num_loss_tokens=2,
            entropy=torch.tensor([1.0, float("nan"), 3.0]),
        )
        out.loss.backward()
        assert torch.isfinite(out.loss), params
        assert torch.isfinite(lp.grad).all() and lp.grad[1] == 0.0, params
        assert all(math.isfinite(v) for v in summarize(out.stats).values()), params
    # r = 1 on both kept tokens: -A*logp = -(1)(ln .5) - (-1)(ln .5) = 0; entropy mean (1 + 3)/2 = 2
    out = compute_loss(
        LossParams(),
        trainer_logprobs=lp,
        inference_logprobs=inf,
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=2,
        entropy=torch.tensor([1.0, float("nan"), 3.0]),
    )
    assert out.loss.item() == pytest.approx(0.0, abs=1e-7)
    assert summarize(out.stats)["entropy"] == pytest.approx(2.0)


def test_kl_estimators_and_kl_term():
    # logp = ln 0.5, ref = ln 0.25: d = ref - logp = ln 0.5 = -0.693147
    # k1 = -d = 0.693147;  k2 = d^2/2 = 0.240227;  k3 = e^d - 1 - d = 0.5 - 1 + 0.693147 = 0.193147
    lp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    # As a loss term with A = 0 (no policy-gradient part), coefficient 0.1 and one token:
    # loss = 0.1 * 0.193147 = 0.0193147;  d/dlogp k3 = 1 - e^d = 0.5 -> grad 0.1 * 0.5 = 0.05
    x = lp.clone().requires_grad_(True)
    out = compute_loss(
        LossParams(kl_coef=0.1),
        trainer_logprobs=x,
        inference_logprobs=lp,
        advantages=torch.zeros(1),
        loss_mask=torch.ones(1, dtype=torch.bool),
        num_loss_tokens=1,
        ref_logprobs=ref,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.0193147, abs=1e-6)
    assert x.grad.item() == pytest.approx(0.05, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(
            LossParams(kl_coef=0.1),
            trainer_logprobs=x,
            inference_logprobs=lp,
            advantages=torch.zeros(1),
            loss_mask=torch.ones(1, dtype=torch.bool),
            num_loss_tokens=1,
        )


def test_sequence_mask_drops_whole_samples():
    # Two samples of 3 tokens; the first token of each is a prompt token (not a loss token).
    # Sample 0 log-ratios on loss tokens: 0.5, 0.3 -> mean 0.4 > high 0.3 -> whole sample masked.
    # Sample 1: 0.1, -0.1 -> mean 0 -> kept.
    inf = torch.zeros(6) - 1.0
    lp = inf + torch.tensor([9.0, 0.5, 0.3, 9.0, 0.1, -0.1])
    mask = torch.tensor([False, True, True, False, True, True])
    seq_lens = torch.tensor([3, 3])
    bad = sequence_mask(lp - inf, mask, seq_lens, low=-0.3, high=0.3)
    assert bad.tolist() == [True, True, True, False, False, False]
    x = lp.clone().requires_grad_(True)
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    out = compute_loss(
        LossParams(seq_mask_low=-0.3, seq_mask_high=0.3, eps_high=10.0, eps_low=0.9),
        trainer_logprobs=x,
        inference_logprobs=inf,
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=4,
        seq_lens=seq_lens,
    )
    out.loss.backward()
    # kept: tokens 4, 5 with A = 1: grad -r/N = [-e^0.1/4, -e^-0.1/4] = [-0.276293, -0.226209]
    assert torch.allclose(x.grad, torch.tensor([0, 0, 0, 0, -0.276293, -0.226209]), atol=1e-6)
    assert summarize(out.stats)["seq_masked_fraction"] == pytest.approx(0.5)  # 2 of 4 loss tokens


def test_opd_advantage_is_teacher_minus_sampler_logprob():
    # r = 1 (trainer = sampler = ln 0.5), teacher ln 0.25 -> A = ln 0.25 - ln 0.5 = -0.693147
    # loss = -r*A*logp = -(1)(-0.693147)(-0.693147) = -0.480453;  grad = -r*A = +0.693147
    x = torch.tensor([LN(0.5)], requires_grad=True)
    out = compute_loss(
        LossParams(mode="opd"),
        trainer_logprobs=x,
        inference_logprobs=torch.tensor([LN(0.5)]),
        teacher_logprobs=torch.tensor([LN(0.25)]),
        loss_mask=torch.ones(1, dtype=torch.bool),
        num_loss_tokens=1,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.480453, abs=1e-6)
    assert x.grad.item() == pytest.approx(0.693147, abs=1e-6)
    assert summarize(out.stats)["masked_advantage_negative"] == 0.0


def test_sft_is_cross_entropy_on_loss_tokens():
    # -(ln 0.5 + ln 0.25) / 2 = (0.693147 + 1.386294) / 2 = 1.039721; token 2 is not a loss token.
    x = torch.tensor([LN(0.5), LN(0.25), -7.0], requires_grad=True)
    out = compute_loss(
        LossParams(mode="sft"),
        trainer_logprobs=x,
        loss_mask=torch.tensor([True, True, False]),
        num_loss_tokens=2,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.039721, abs=1e-6)
    assert x.grad.tolist() == pytest.approx([-0.5, -0.5, 0.0])


def test_empty_step_gives_zero_loss_with_a_graph():
    x = torch.zeros(2, requires_grad=True)
    out = compute_loss(
        LossParams(),
        trainer_logprobs=x,
        inference_logprobs=torch.zeros(2),
        advantages=torch.ones(2),
        loss_mask=torch.zeros(2, dtype=torch.bool),
        num_loss_tokens=0,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and x.grad.tolist() == [0.0, 0.0]


def test_user_errors_are_value_errors():
    with pytest.raises(ValueError, match="loss.type"):
        LossParams(type="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss.mode"):
        LossParams(mode="dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps_low"):
        LossParams(eps_low=1.5)
    with pytest.raises(ValueError, match="seq_mask_low"):
        LossParams(seq_mask_low=0.5, seq_mask_high=0.1)
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="inference_logprobs"):
        compute_loss(LossParams(), trainer_logprobs=x, advantages=x, loss_mask=x.bool(), num_loss_tokens=1)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        compute_loss(
            LossParams(mode="opd"),
            trainer_logprobs=x,
            inference_logprobs=x,
            loss_mask=x.bool(),
            num_loss_tokens=1,
        )


def test_finite_checks():
    assert check_finite(torch.tensor(1.0)) and not check_finite(torch.tensor(float("nan")))
    assert not check_finite(float("inf"))
    lin = torch.nn.Linear(2, 1)
    lin(torch.ones(1, 2)).sum().backward()
    assert grads_are_finite(lin)
    lin.weight.grad[0, 0] = float("inf")
    assert not grads_are_finite(lin)


def test_a_step_without_micro_batches_sums_to_zero():
    """Every sample of a step filtered out: the stats all-reduce gets zeros, not a TypeError."""
    stats = summarize(unstack_stats(stack_stats(None)))
    assert stats["loss"] == 0.0
