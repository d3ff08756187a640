"""Group-relative advantages, hand-checked."""

from __future__ import annotations

import numpy as np
import pytest

from hpcrl.orchestrator.advantages import AdvantageConfig, compute_advantages, group_advantages


def test_group_mean_baseline():
    # mean 0.5 -> [0.5, -0.5, 0.5, -0.5]
    np.testing.assert_allclose(group_advantages([1, 0, 1, 0]), [0.5, -0.5, 0.5, -0.5])
    # mean 2 -> [-1, 0, 1]
    adv = group_advantages([1.0, 2.0, 3.0])
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [-1, 0, 1])


def test_std_normalisation():
    # rewards [1, 2, 3]: population std = sqrt(2/3) = 0.8165 -> [-1.2247, 0, 1.2247]
    np.testing.assert_allclose(
        group_advantages([1, 2, 3], std_normalize=True, eps=0.0 + 1e-12),
        [-1.2247449, 0, 1.2247449],
        rtol=1e-6,
    )
    # [1, 0, 1, 0]: std 0.5 -> +-1 (eps barely matters)
    np.testing.assert_allclose(
        group_advantages([1, 0, 1, 0], std_normalize=True, eps=1e-6), [1, -1, 1, -1], rtol=1e-5
    )
    # all-equal group: 0 / (0 + eps) = 0, never NaN
    np.testing.assert_array_equal(group_advantages([0.7, 0.7], std_normalize=True), [0, 0])


def test_length_penalty():
    # rewards equal-mean-zero part: [0.5, -0.5]; lengths [10, 30], mean 20 ->
    # length term = 0.2 * [-10, 10] / 20 = [-0.1, 0.1] -> A = [0.5 + 0.1, -0.5 - 0.1]
    np.testing.assert_allclose(group_advantages([1, 0], [10, 30], length_penalty=0.2), [0.6, -0.6], rtol=1e-6)
    adv = group_advantages([1, 1, 0], [5, 15, 10], length_penalty=0.5)
    # mean r = 2/3; length term = 0.5 * [-5, 5, 0] / 10 = [-0.25, 0.25, 0]
    np.testing.assert_allclose(adv, [1 / 3 + 0.25, 1 / 3 - 0.25, -2 / 3], rtol=1e-6)
    assert abs(adv.sum()) < 1e-6  # the group's total advantage is unchanged
    with pytest.raises(ValueError, match="lengths"):
        group_advantages([1, 0], length_penalty=0.1)


def test_zero_advantage_groups_keep_or_drop():
    groups = [[1, 1, 1], [1, 0, 0], [0, 0]]
    advs, keep = compute_advantages(groups, config=AdvantageConfig(zero_advantage="keep"))
    assert keep.tolist() == [True, True, True]
    np.testing.assert_allclose(advs[0], [0, 0, 0])
    np.testing.assert_allclose(advs[1], [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)

    advs, keep = compute_advantages(groups, config=AdvantageConfig(zero_advantage="drop"))
    assert keep.tolist() == [False, True, False]
    assert [a.shape for a in advs] == [(3,), (3,), (2,)]  # still aligned with the input

    # with a length penalty, kept zero-reward-spread groups carry the length signal only
    advs, keep = compute_advantages(
        [[1, 1]], [[10, 30]], AdvantageConfig(length_penalty=0.2, zero_advantage="keep")
    )
    np.testing.assert_allclose(advs[0], [0.1, -0.1], rtol=1e-6)


def test_config_validation():
    with pytest.raises(ValueError, match="zero_advantage"):
        AdvantageConfig(zero_advantage="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rewards"):
        group_advantages([])
