"""Advantages of the reward-based algorithms (grpo, its length penalty, max_rl, rae), hand-checked."""

from __future__ import annotations

import numpy as np
import pytest

from hpcrl.orchestrator.advantages import (
    AdvantageConfig,
    GroupSizes,
    LengthPenalty,
    compute_advantages,
    grpo_advantages,
    length_penalty_fraction,
    max_rl_advantages,
    rae_advantages,
)


def test_grpo_group_mean_baseline():
    # mean 0.5 -> [0.5, -0.5, 0.5, -0.5]
    np.testing.assert_allclose(grpo_advantages([1, 0, 1, 0]), [0.5, -0.5, 0.5, -0.5])
    # mean 2 -> [-1, 0, 1]
    adv = grpo_advantages([1.0, 2.0, 3.0])
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [-1, 0, 1])


def test_std_normalisation():
    # rewards [1, 2, 3]: population std = sqrt(2/3) = 0.8165 -> [-1.2247, 0, 1.2247]
    np.testing.assert_allclose(
        grpo_advantages([1, 2, 3], std_normalize=True, eps=1e-12), [-1.2247449, 0, 1.2247449], rtol=1e-6
    )
    # [1, 0, 1, 0]: std 0.5 -> +-1 (eps barely matters)
    np.testing.assert_allclose(grpo_advantages([1, 0, 1, 0], std_normalize=True), [1, -1, 1, -1], rtol=1e-5)
    # all-equal group: 0 / (0 + eps) = 0, never NaN
    np.testing.assert_array_equal(grpo_advantages([0.7, 0.7], std_normalize=True), [0, 0])


def test_linear_length_penalty_prime_rl_defaults():
    # weights 0.25 / 0.1 / 0.1 (prime-rl's defaults); rewards [1, 1, 0, 0], pass rate 0.5;
    # output tokens [10, 20, 20, 40] / max 40 = [0.25, 0.5, 0.5, 1] x 0.25 = [0.0625, 0.125, 0.125, 0.25];
    # input tokens all 30 / 30 = 1 x 0.1 = 0.1; turns all 1 / 1 x 0.1 = 0.1
    # fraction = [0.2625, 0.325, 0.325, 0.45]; penalty = 0.5 x fraction = [0.13125, 0.1625, 0.1625, 0.225]
    sizes = GroupSizes(output=[10, 20, 20, 40], input=[30] * 4, turns=[1] * 4)
    np.testing.assert_allclose(length_penalty_fraction(sizes, LengthPenalty()), [0.2625, 0.325, 0.325, 0.45])
    # shaped = [0.86875, 0.8375, -0.1625, -0.225], mean 0.3296875
    # A = [0.5390625, 0.5078125, -0.4921875, -0.5546875] (sums to 0: the group's credit is unchanged)
    adv = grpo_advantages([1, 1, 0, 0], sizes, length_penalty=LengthPenalty())
    np.testing.assert_allclose(adv, [0.5390625, 0.5078125, -0.4921875, -0.5546875], rtol=1e-6)
    assert abs(float(adv.sum())) < 1e-6
    with pytest.raises(ValueError, match="sizes"):
        grpo_advantages([1, 0], length_penalty=LengthPenalty())


def test_length_penalty_terms_and_pass_rate():
    # output term alone (the older advantage.length_penalty = 0.2): rewards [1, 0], pass rate 0.5,
    # output [10, 30] / 30 = [1/3, 1] x 0.2 = [0.0667, 0.2]; penalty [0.0333, 0.1];
    # shaped [0.9667, -0.1], mean 0.4333 -> A = [0.5333, -0.5333]
    only_out = LengthPenalty(0.2, 0.0, 0.0)
    sizes = GroupSizes(output=[10, 30], input=[5, 500], turns=[1, 9])
    np.testing.assert_allclose(
        grpo_advantages([1, 0], sizes, length_penalty=only_out), [0.5333333, -0.5333333], rtol=1e-6
    )
    # a group that never succeeds (pass rate 0) is not penalised at all
    np.testing.assert_array_equal(grpo_advantages([0, 0], sizes, length_penalty=LengthPenalty()), [0, 0])
    # equal rewards 1: A = -1 x 0.2 x ([1/3, 1] - 2/3) = [0.0667, -0.0667]: the shorter one is preferred
    np.testing.assert_allclose(
        grpo_advantages([1, 1], sizes, length_penalty=only_out), [0.0666667, -0.0666667], rtol=1e-5
    )
    # input term: [5, 500] / 500 = [0.01, 1] x 0.1; turns term: [1, 9] / 9 x 0.1; rewards [1, 1]
    # penalty = [0.001 + 0.0111, 0.1 + 0.1] = [0.012111, 0.2] -> A = -(penalty - mean) = [0.0939, -0.0939]
    both = LengthPenalty(0.0, 0.1, 0.1)
    np.testing.assert_allclose(
        grpo_advantages([1, 1], sizes, length_penalty=both), [0.0939444, -0.0939444], rtol=1e-5
    )
    # each max is at least 1: zero tokens everywhere give a zero term, not a division by zero
    zero = GroupSizes(output=[0, 0], input=[0, 0], turns=[0, 0])
    np.testing.assert_allclose(grpo_advantages([1, 0], zero, length_penalty=LengthPenalty()), [0.5, -0.5])


def test_max_rl_divides_by_the_group_mean():
    # [1, 0, 0, 0]: mean 0.25 -> (r - 0.25) / 0.25 = [3, -1, -1, -1] (a hard example weighs ~1/p)
    np.testing.assert_allclose(max_rl_advantages([1, 0, 0, 0]), [3, -1, -1, -1])
    # [1, 1, 0, 0]: mean 0.5 -> [1, 1, -1, -1]; [0.5, 1.0]: mean 0.75 -> [-1/3, 1/3]
    np.testing.assert_allclose(max_rl_advantages([1, 1, 0, 0]), [1, 1, -1, -1])
    np.testing.assert_allclose(max_rl_advantages([0.5, 1.0]), [-1 / 3, 1 / 3], rtol=1e-6)
    # mean <= 0: no signal, all zero (never a division by zero or a flipped sign)
    np.testing.assert_array_equal(max_rl_advantages([0, 0, 0]), [0, 0, 0])
    np.testing.assert_array_equal(max_rl_advantages([-1, 0]), [0, 0])


def test_rae_per_agent_ema_baselines():
    # decay 0.5, traces (a: 1), (a: 1), (b: -1), baselines start at 0:
    # a: A = 1 - 0 = 1, b_a = 0.5 x 0 + 0.5 x 1 = 0.5; a: A = 1 - 0.5 = 0.5, b_a = 0.25 + 0.5 = 0.75
    # b: A = -1 - 0 = -1, b_b = -0.5
    adv, base = rae_advantages([1.0, 1.0, -1.0], ["a", "a", "b"], {}, decay=0.5)
    np.testing.assert_allclose(adv, [1, 0.5, -1])
    assert base == {"a": 0.75, "b": -0.5}
    # continuing from those baselines (the input is not modified): a: A = 0 - 0.75 = -0.75
    adv2, base2 = rae_advantages([0.0], ["a"], base, decay=0.5)
    np.testing.assert_allclose(adv2, [-0.75])
    assert base2["a"] == 0.375 and base == {"a": 0.75, "b": -0.5}
    # prime-rl's default decay 0.95: rewards 1, 1 -> A = 1, then 1 - 0.05 = 0.95; b = 0.0975
    adv3, base3 = rae_advantages([1.0, 1.0], ["x", "x"], {}, decay=0.95)
    np.testing.assert_allclose(adv3, [1.0, 0.95])
    assert base3["x"] == pytest.approx(0.0975)
    with pytest.raises(ValueError, match="decay"):
        rae_advantages([1.0], ["x"], {}, decay=1.0)


def test_zero_advantage_groups_keep_or_drop():
    groups = [[1, 1, 1], [1, 0, 0], [0, 0]]
    advs, keep = compute_advantages(groups, config=AdvantageConfig(zero_advantage="keep"))
    assert keep.tolist() == [True, True, True]
    np.testing.assert_allclose(advs[0], [0, 0, 0])
    np.testing.assert_allclose(advs[1], [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)

    advs, keep = compute_advantages(groups, config=AdvantageConfig(zero_advantage="drop"))
    assert keep.tolist() == [False, True, False]
    assert [a.shape for a in advs] == [(3,), (3,), (2,)]  # still aligned with the input

    # equal rewards with a length penalty still carry the length signal, so they are kept (prime-rl
    # drops only traces whose advantages are all zero): A = [0.0667, -0.0667] as above
    lp = AdvantageConfig(length_penalty=LengthPenalty(0.2, 0.0, 0.0), zero_advantage="drop")
    advs, keep = compute_advantages([[1, 1]], [GroupSizes([10, 30], [0, 0], [1, 1])], lp)
    assert keep.tolist() == [True]
    np.testing.assert_allclose(advs[0], [0.0666667, -0.0666667], rtol=1e-5)

    # max_rl: a group with mean reward 0 has no signal -> dropped
    _, keep = compute_advantages([[0, 0], [1, 0]], config=AdvantageConfig(kind="max_rl"))
    assert keep.tolist() == [False, True]


def test_config_validation():
    with pytest.raises(ValueError, match="zero_advantage"):
        AdvantageConfig(zero_advantage="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        AdvantageConfig(kind="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages([])
