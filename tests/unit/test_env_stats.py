"""hpcrl.trainer.env_stats by hand: per-env mismatch KL mean / std / max and entropy means."""

from __future__ import annotations

import pytest
import torch

from hpcrl.trainer.env_stats import env_metrics, token_envs


def test_env_metrics_by_hand():
    # samples: [a: 3 tokens, b: 2 tokens, a: 2 tokens]; loss tokens: all but each sample's first
    seq_lens = torch.tensor([3, 2, 2])
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    envs = token_envs(torch.tensor([0, 1, 0]), seq_lens, mask)
    assert envs.tolist() == [0, 0, 1, 0]
    kl = torch.tensor([0.1, 0.3, 0.5, 0.2])
    ent = torch.tensor([1.0, 2.0, 4.0, 3.0])
    m = env_metrics(kl, envs, ent, envs, ["a", "b"])
    assert m["mismatch_kl/all/mean"] == pytest.approx(0.275)  # 1.1 / 4
    # population std of [0.1, 0.3, 0.5, 0.2]: sqrt(mean of squares 0.0975 - 0.275^2) = 0.147902
    assert m["mismatch_kl/all/std"] == pytest.approx(0.1479019945774904)
    assert m["mismatch_kl/all/max"] == pytest.approx(0.5)
    assert m["mismatch_kl/a/mean"] == pytest.approx(0.2)  # [0.1, 0.3, 0.2]
    assert m["mismatch_kl/a/max"] == pytest.approx(0.3)
    assert m["mismatch_kl/b/mean"] == pytest.approx(0.5) and m["mismatch_kl/b/std"] == 0.0
    assert m["entropy/all/mean"] == pytest.approx(2.5)
    assert m["entropy/a/mean"] == pytest.approx(2.0) and m["entropy/b/mean"] == pytest.approx(4.0)


def test_an_env_without_tokens_this_step_is_left_out():
    m = env_metrics(
        torch.tensor([0.2]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0]), ["a", "b"]
    )
    assert "mismatch_kl/b/mean" not in m and "entropy/b/mean" not in m
    assert m["mismatch_kl/a/mean"] == pytest.approx(0.2)
