"""Packing samples into balanced per-rank batches."""

from __future__ import annotations

import numpy as np
import pytest

from hpcrl.orchestrator.packing import BATCH_KEYS, Sample, assign_to_ranks, pack_for_ranks


def sample(n: int, prompt: int = 2, idx: int = 0, teacher: bool = False, adv: float = 0.5) -> Sample:
    mask = np.arange(n) >= prompt
    return Sample(
        input_ids=np.arange(100 * idx, 100 * idx + n),
        loss_mask=mask,
        inference_logprobs=np.where(mask, -0.25, 0.0),
        advantage=adv,
        policy_version=idx,
        example_id=idx,
        env_name=f"env{idx % 2}",
        temperature=1.0,
        reward=float(idx),
        teacher_logprobs=np.full(n, -1.0) if teacher else None,
    )


def test_assign_longest_first_least_loaded():
    # lengths 8,7,6,5,4 over 2 ranks: 8->r0, 7->r1, 6->r1(7<8), 5->r0(8<13), 4->r0 (13=13, lower rank)
    assert assign_to_ranks([8, 7, 6, 5, 4], 2) == [[0, 3, 4], [1, 2]]
    # ties in length: lower index first
    assert assign_to_ranks([3, 3, 3], 3) == [[0], [1], [2]]
    assert assign_to_ranks([], 2) == [[], []]


def test_pack_fields_and_balance():
    lens = [8, 7, 6, 5, 4]
    batches, stats = pack_for_ranks([sample(n, idx=i) for i, n in enumerate(lens)], num_ranks=2, seq_len=16)
    assert stats.tokens_per_rank == [17, 13] and stats.max_tokens == 17 and stats.min_tokens == 13
    assert stats.num_samples == 5 and stats.num_dropped == stats.num_truncated == 0
    b0 = batches[0]
    assert set(b0) == set(BATCH_KEYS) and len(b0) == len(BATCH_KEYS)
    assert b0["seq_lens"].tolist() == [8, 5, 4] and b0["example_ids"].tolist() == [0, 3, 4]
    assert b0["input_ids"].dtype == np.int32 and b0["input_ids"].shape == (17,)
    assert b0["input_ids"][:8].tolist() == list(range(8)) and b0["input_ids"][8:13].tolist() == list(
        range(300, 305)
    )
    assert b0["position_ids"].tolist() == list(range(8)) + list(range(5)) + list(range(4))
    assert b0["loss_mask"].dtype == bool and b0["loss_mask"].sum() == (8 - 2) + (5 - 2) + (4 - 2)
    assert b0["advantages"].dtype == np.float32 and (b0["advantages"] == 0.5).all()
    assert (b0["inference_logprobs"][b0["loss_mask"]] == -0.25).all()
    assert b0["policy_versions"].dtype == np.int32 and b0["policy_versions"].tolist() == [0, 3, 4]
    assert b0["example_ids"].dtype == np.int64 and b0["rewards"].dtype == np.float32
    assert b0["temperatures"].dtype == np.float32 and b0["env_names"] == ["env0", "env1", "env0"]
    assert b0["teacher_logprobs"] is None
    for b in batches:
        t = int(b["seq_lens"].sum())
        for key in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs"):
            assert b[key].shape == (t,)
        s = len(b["seq_lens"])
        for key in ("policy_versions", "temperatures", "example_ids", "rewards"):
            assert b[key].shape == (s,)
        assert len(b["env_names"]) == s
    assert stats.metrics()["pack/imbalance"] == pytest.approx(17 / 15)


def test_pack_many_samples_is_balanced():
    rng = np.random.default_rng(0)
    samples = [sample(int(n), idx=i) for i, n in enumerate(rng.integers(10, 200, size=256))]
    _, stats = pack_for_ranks(samples, num_ranks=8, seq_len=256)
    assert stats.max_tokens - stats.min_tokens <= 200  # greedy LPT: within one sample's length


def test_overlong_truncate_drop_and_per_token_advantage():
    s = sample(10, prompt=2, idx=1)
    s.advantage = np.linspace(0, 1, 10)
    batches, stats = pack_for_ranks([s, sample(3, prompt=5, idx=2)], num_ranks=1, seq_len=6)
    # first is truncated to 6 tokens; the second has no trainable token (all prompt) and is dropped
    assert stats.num_truncated == 1 and stats.num_dropped == 1 and stats.num_samples == 1
    np.testing.assert_allclose(batches[0]["advantages"], np.linspace(0, 1, 10)[:6], rtol=1e-6)

    _, stats = pack_for_ranks([sample(10), sample(4, idx=1)], num_ranks=1, seq_len=6, overlong="drop")
    assert stats.num_dropped == 1 and stats.num_truncated == 0 and stats.tokens_per_rank == [4]


def test_empty_ranks_and_teacher_logprobs():
    batches, stats = pack_for_ranks([sample(5, teacher=True)], num_ranks=3, seq_len=8)
    assert stats.tokens_per_rank == [5, 0, 0]
    assert batches[0]["teacher_logprobs"].dtype == np.float32 and batches[0]["teacher_logprobs"].shape == (5,)
    assert batches[1]["input_ids"].shape == (0,) and batches[1]["env_names"] == []
    with pytest.raises(ValueError, match="teacher_logprobs"):
        pack_for_ranks([sample(5, teacher=True), sample(5)], num_ranks=1, seq_len=8)
    bad = sample(5)
    bad.inference_logprobs = np.zeros(4)
    with pytest.raises(ValueError, match="sample 0: inference_logprobs"):
        pack_for_ranks([bad], num_ranks=1, seq_len=8)


def test_repack_for_another_world_size_keeps_every_sample() -> None:
    from hpcrl.orchestrator.batch import build_batches, repack_batches, unpack_samples

    rng = np.random.default_rng(3)
    samples = []
    for i, n in enumerate([9, 5, 12, 3, 7, 8, 4]):
        samples.append(
            Sample(
                input_ids=rng.integers(0, 100, n).astype(np.int32),
                loss_mask=rng.random(n) < 0.7,
                inference_logprobs=-rng.random(n).astype(np.float32),
                advantage=float(i) - 3,
                policy_version=i % 2,
                example_id=100 + i,
                env_name=f"e{i % 2}",
                temperature=1.0,
                reward=i / 10,
            )
        )
        samples[-1].loss_mask[-1] = True
    two, _ = build_batches(samples, step=5, world_size=2, seq_len=64, created_at=1.0)

    def key(s: Sample) -> tuple:
        return (
            s.example_id,
            s.input_ids.tobytes(),
            s.loss_mask.tobytes(),
            s.inference_logprobs.tobytes(),
            np.broadcast_to(np.float32(s.advantage), len(s)).tobytes()
            if np.ndim(s.advantage) == 0
            else np.asarray(s.advantage, np.float32).tobytes(),
            s.policy_version,
            s.env_name,
            np.float32(s.reward),
        )

    want = sorted(key(s) for s in samples)
    for world in (1, 3):
        again = repack_batches(two, world, seq_len=64)
        assert [b.rank for b in again] == list(range(world)) and all(b.world_size == world for b in again)
        assert all(b.step == 5 and b.total_loss_tokens == two[0].total_loss_tokens for b in again)
        assert sorted(key(s) for b in again for s in unpack_samples(b)) == want
