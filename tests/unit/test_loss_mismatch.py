"""Rollout mismatch correction in the loss (TIS and MIS, hpcrl.trainer.loss) against hand-worked gradients.

Fixture: three loss tokens sampled with probability 0.2 (inference logprob log 0.2) whose trainer
probabilities are 0.6, 0.3, 0.1, i.e. ratios r = 3.0, 1.5, 0.5, with advantages -1, -1, +1; packed as
two samples, seq_lens [2, 1] (sample A = tokens 0-1, sample B = token 2); num_loss_tokens = 3.

Without any correction (type default, trust region [0.8, 1.28]): no token is masked (A < 0 tokens are
masked only below 0.8, the A > 0 token only above 1.28), and d loss / d logp_t = -r_t A_t / 3:
  token 0: -3.0 * -1 / 3 = 1.0;  token 1: -1.5 * -1 / 3 = 0.5;  token 2: -0.5 * +1 / 3 = -1/6.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.config.loader import load
from hpcrl.errors import ConfigError
from hpcrl.trainer.loss import LossParams, compute_loss, summarize
from tests.conftest import rl_toml

RATIOS = [3.0, 1.5, 0.5]
ADV = [-1.0, -1.0, 1.0]
SEQ_LENS = [2, 1]
PLAIN = [1.0, 0.5, -1 / 6]


def run(params: LossParams, seq_lens: list[int] | None = SEQ_LENS):
    lp = torch.tensor([math.log(0.2 * r) for r in RATIOS], dtype=torch.float64, requires_grad=True)
    out = compute_loss(
        params,
        trainer_logprobs=lp,
        inference_logprobs=torch.full((3,), math.log(0.2), dtype=torch.float64),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        loss_mask=torch.ones(3, dtype=torch.bool),
        num_loss_tokens=3,
        seq_lens=None if seq_lens is None else torch.tensor(seq_lens),
    )
    out.loss.backward()
    return out, lp.grad.tolist()


def test_no_correction_is_the_plain_loss():
    out, grad = run(LossParams())
    assert grad == pytest.approx(PLAIN)
    s = summarize(out.stats)
    assert s["token_masked_fraction"] == s["tis_truncated_fraction"] == s["seq_masked_fraction"] == 0.0


def test_tis_truncates_the_weight_default():
    # C = 2: token 0's weight min(3, 2) = 2 -> -2 * -1 / 3 = 2/3; tokens 1, 2 (r <= 2) unchanged.
    out, grad = run(LossParams(use_tis=True, tis_clip=2.0))
    assert grad == pytest.approx([2 / 3, 0.5, -1 / 6])
    assert summarize(out.stats)["tis_truncated_fraction"] == pytest.approx(1 / 3)
    # the loss value uses the truncated weight too: sum(-w A logp) / 3
    lps = [math.log(0.2 * r) for r in RATIOS]
    want = (2 * lps[0] + 1.5 * lps[1] - 0.5 * lps[2]) / 3
    assert float(out.loss.detach()) == pytest.approx(want)


def test_tis_grpo_matches_the_truncated_weight():
    # grpo: token 0: min(rA, clip(r)A) = min(-3, -1.28) = -3 (unclipped), d(-rA)/dlogp = -A r = 3, times
    # sg(min(3, 2) / 3) = 2/3 -> 2, / 3 = 2/3. Token 1: min(-1.5, -1.28) = -1.5 -> 1.5 / 3 = 0.5.
    # Token 2: min(0.5, 0.8) = 0.5 (unclipped) -> -0.5 / 3. Same as default's TIS weights.
    _, grad = run(LossParams(type="grpo", use_tis=True, tis_clip=2.0))
    assert grad == pytest.approx([2 / 3, 0.5, -1 / 6])
    _, plain = run(LossParams(type="grpo"))
    assert plain == pytest.approx(PLAIN)


def test_tis_cispo_caps_below_the_clip():
    # cispo weight clip(min(r, C), 0.8, 1.28) with C = 1.2: token 0: min(3, 1.2) = 1.2 -> 1.2 / 3 = 0.4;
    # token 1: min(1.5, 1.2) = 1.2 -> 0.4; token 2: clip(0.5) = 0.8 -> -0.8 / 3.
    _, grad = run(LossParams(type="cispo", use_tis=True, tis_clip=1.2))
    assert grad == pytest.approx([0.4, 0.4, -0.8 / 3])


def test_token_mis():
    # [0.6, 2.5]: token 0 (r = 3 > 2.5) and token 2 (r = 0.5 < 0.6) masked; token 1 keeps 1.5 / 3 = 0.5.
    out, grad = run(LossParams(token_mask_low=0.6, token_mask_high=2.5))
    assert grad == pytest.approx([0.0, 0.5, 0.0])
    assert summarize(out.stats)["token_masked_fraction"] == pytest.approx(2 / 3)


def test_sequence_mis():
    # high 2.5: sample A holds r = 3 > 2.5 -> both its tokens masked, sample B kept.
    out, grad = run(LossParams(sequence_mask_high=2.5))
    assert grad == pytest.approx([0.0, 0.0, -1 / 6])
    assert summarize(out.stats)["seq_masked_fraction"] == pytest.approx(2 / 3)
    # low 0.6: sample B's r = 0.5 < 0.6 -> masked; sample A (min 1.5) kept.
    _, grad = run(LossParams(sequence_mask_low=0.6))
    assert grad == pytest.approx([1.0, 0.5, 0.0])


def test_geo_mis():
    # geometric means: A = sqrt(3 * 1.5) = 2.1213, B = 0.5.
    _, grad = run(LossParams(geo_mask_high=2.0))  # 2.1213 > 2.0: A masked
    assert grad == pytest.approx([0.0, 0.0, -1 / 6])
    _, grad = run(LossParams(geo_mask_high=2.2))  # 2.1213 <= 2.2: nothing masked
    assert grad == pytest.approx(PLAIN)
    _, grad = run(LossParams(geo_mask_low=0.6))  # 0.5 < 0.6: B masked
    assert grad == pytest.approx([1.0, 0.5, 0.0])


def test_tis_and_mis_compose():
    # token MIS high 2.5 drops token 0; TIS C = 1.2 caps token 1's weight: 1.2 / 3 = 0.4; token 2 plain.
    _, grad = run(LossParams(use_tis=True, tis_clip=1.2, token_mask_high=2.5))
    assert grad == pytest.approx([0.0, 0.4, -1 / 6])


def test_sample_masks_need_seq_lens():
    with pytest.raises(ValueError, match="need seq_lens"):
        run(LossParams(geo_mask_high=2.0), seq_lens=None)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"tis_clip": 0.0}, "loss.tis_clip"),
        ({"token_mask_low": 2.0, "token_mask_high": 1.0}, "loss.token_mask_low"),
        ({"geo_mask_low": -1.0}, "loss.geo_mask_low"),
        ({"sequence_mask_high": 0.0}, "loss.sequence_mask_high"),
    ],
)
def test_params_refuse_bad_bounds(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LossParams(**kw)


def config(tmp_path, *flags: str):
    f = tmp_path / "cfg.toml"
    f.write_text(rl_toml())
    return load([str(f), "--output-dir", str(tmp_path / "out"), *flags]).config


def test_config_fields_reach_the_loss(tmp_path):
    from hpcrl.trainer.setup import loss_params

    flags = ["--trainer.loss.use-tis", "--trainer.loss.tis-clip", "3", "--trainer.loss.geo-mask-high", "2"]
    p = loss_params(config(tmp_path, *flags).trainer.loss, "rl")
    assert (p.use_tis, p.tis_clip, p.geo_mask_high, p.geo_mask_low) == (True, 3.0, 2.0, None)


def test_config_refuses_crossed_bounds_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, "--trainer.loss.token-mask-low", "3", "--trainer.loss.token-mask-high", "2")
    assert "trainer.loss.token_mask_low" in str(e.value) and "\n" not in str(e.value)
