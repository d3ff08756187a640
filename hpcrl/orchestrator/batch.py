"""From scored groups to one TrainBatch per trainer rank: advantages, filters, staleness, packing.

Pure functions over GroupRecords (no I/O), so every rule here is unit-testable:

    judge_group      the algorithm's credit + difficulty filter + zero-advantage filter for one group
    fill_with_uniform   last-resort filler: zero-advantage groups for a batch the filters starve
    fill_batch       accepted groups in, the groups of this step out (the rest carries over)
    build_batches    staleness bound per sample, deterministic order, balanced packing
    repack_batches   one step's published batches re-packed for another trainer world size
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcrl.bus import TrainBatch
from hpcrl.orchestrator.algo import Credit
from hpcrl.orchestrator.buffer import Buffer
from hpcrl.orchestrator.images import DROP, SampleImages, sample_images
from hpcrl.orchestrator.packing import PackStats, Sample, pack_for_ranks
from hpcrl.orchestrator.state import GroupRecord

# A policy that reached this reward solved the example (pass@k; rewards of the built-in envs are
# similarities in [0, 1], so only an exact/near-exact answer passes).
PASS_THRESHOLD = 0.99


@dataclass
class StepCounts:
    """What happened to the groups and samples of one step (for metrics)."""

    filtered: Counter = field(default_factory=Counter)  # easy / hard / zero_advantage / all_errored
    stale_dropped: int = 0
    zero_advantage_filled: int = 0  # dropped groups put back because refills kept coming back uniform


def judge_group(group: GroupRecord, buffer: Buffer, credit: Credit, counts: StepCounts) -> bool:
    """Set `group.advantages` (the algorithm's credit, hpcrl.orchestrator.algo.credit) and decide
    whether the group is trained on.

    Errored rollouts take no part in the group baseline (advantage 0, never packed). sft trains on
    every completion of its frozen model; opd / opsd keep every group, their signal being the
    reference logprobs, not the reward; the others drop what the difficulty filter or (with
    zero_advantage = drop) a group without any nonzero advantage leaves.
    """
    ok = [r for r in group.rollouts if not r.errored]
    if not ok:
        counts.filtered["all_errored"] += 1
        return False
    if credit.action_loss == "ce":
        return credit.assign(group, ok)
    rewards = [r.reward for r in ok]
    if not buffer.accept_group(rewards):
        counts.filtered[buffer.filter.classify(float(np.mean(rewards)))] += 1
        return False
    if not credit.assign(group, ok):
        counts.filtered["zero_advantage"] += 1  # advantages all 0: usable as a last-resort filler
        return False
    return True


def num_rollouts(groups: Sequence[GroupRecord]) -> int:
    return sum(sum(not r.errored for r in g.rollouts) for g in groups)


def fill_with_uniform(
    ready: list[GroupRecord], uniform: list[GroupRecord], missing: int
) -> tuple[list[GroupRecord], int]:
    """``ready`` plus the first zero-advantage groups that cover ``missing`` rollouts; how many."""
    taken, got = [], 0
    for g in uniform:
        if got >= missing:
            break
        taken.append(g)
        got += num_rollouts([g])
    return ready + taken, len(taken)


def fill_batch(ready: list[GroupRecord], batch_size: int) -> tuple[list[GroupRecord], list[GroupRecord]]:
    """Whole groups, in order, until they hold >= batch_size usable rollouts: (this step, carry-over)."""
    taken: list[GroupRecord] = []
    count = 0
    for i, g in enumerate(ready):
        if count >= batch_size:
            return taken, ready[i:]
        taken.append(g)
        count += sum(not r.errored for r in g.rollouts)
    return taken, []


def to_samples(
    groups: Sequence[GroupRecord],
    step: int,
    max_off_policy_steps: int,
    temperature: float,
    buffer: Buffer,
    counts: StepCounts,
    images: SampleImages | None = None,
) -> list[Sample]:
    """Samples of the usable rollouts, sorted by (env, example_id, rollout index, piece) so the packing
    never depends on completion order. A rollout older than the bound is dropped (counted): batch
    `step` is trained by the update from policy step-1, so its lag is (step-1) - policy_version.
    `images`: a vision-language model's image processor (pieces with images carry their tensors)."""
    rows = [(g, r) for g in groups for r in g.rollouts if not r.errored and r.pieces]
    keep = buffer.filter_stale([r.policy_version for _, r in rows], step - 1) if rows else np.zeros(0, bool)
    counts.stale_dropped += int(len(rows) - keep.sum())
    samples: list[tuple[tuple, Sample]] = []
    for (g, r), k in zip(rows, keep):
        if not k:
            continue
        for p_i, p in enumerate(r.pieces):
            mm = sample_images(images, p, f"{g.env} example {g.example_id} rollout {r.index}")
            if mm is DROP:
                continue
            s = Sample(
                input_ids=np.asarray(p.input_ids, dtype=np.int32),
                loss_mask=np.asarray(p.loss_mask, bool),
                inference_logprobs=np.asarray(p.logprobs, dtype=np.float32),
                advantage=g.piece_advantage(r, p),
                policy_version=r.policy_version,
                example_id=g.example_id,
                env_name=g.env,
                temperature=temperature,
                reward=r.piece_reward(p),
                teacher_logprobs=None
                if p.teacher_logprobs is None
                else np.asarray(p.teacher_logprobs, dtype=np.float32),
                routed_experts=None if p.routed_experts is None else np.asarray(p.routed_experts, np.int16),
                ce_weights=None if p.ce_weights is None else np.asarray(p.ce_weights, dtype=np.float32),
                mm=mm,
                image_end=0 if mm is None else _image_end(p.input_ids, images),
            )
            samples.append(((g.env, g.example_id, r.index, p_i), s))
    samples.sort(key=lambda kv: kv[0])
    return [s for _, s in samples]


def _image_end(input_ids: list[int], images: SampleImages | None) -> int:
    assert images is not None
    where = np.flatnonzero(np.asarray(input_ids) == images.vision.image_id)
    return int(where[-1]) + 1 if len(where) else 0


def build_batches(
    samples: Sequence[Sample], step: int, world_size: int, seq_len: int, created_at: float | None = None
) -> tuple[list[TrainBatch], PackStats]:
    """One TrainBatch per rank; `total_loss_tokens` counts the loss tokens of every rank and
    `total_ce_tokens` the tokens with a cross-entropy weight (echo)."""
    packed, stats = pack_for_ranks(samples, world_size, seq_len)
    total = int(sum(int(np.count_nonzero(b["loss_mask"])) for b in packed))
    ce = int(sum(int(np.count_nonzero(b["ce_weights"])) for b in packed if b["ce_weights"] is not None))
    extra = {} if created_at is None else {"created_at": created_at}
    batches = [
        TrainBatch(
            step=step,
            rank=r,
            world_size=world_size,
            total_loss_tokens=total,
            total_ce_tokens=ce,
            **b,
            **extra,
        )
        for r, b in enumerate(packed)
    ]
    return batches, stats


def unpack_samples(batch: TrainBatch) -> list[Sample]:
    """The samples a rank's TrainBatch was packed from (exact: every per-token and per-sample field)."""
    bounds = np.concatenate([[0], np.cumsum(batch.seq_lens)]).astype(int)
    out = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        out.append(
            Sample(
                input_ids=batch.input_ids[a:b],
                loss_mask=batch.loss_mask[a:b],
                inference_logprobs=batch.inference_logprobs[a:b],
                advantage=batch.advantages[a:b],
                policy_version=int(batch.policy_versions[i]),
                example_id=int(batch.example_ids[i]),
                env_name=batch.env_names[i],
                temperature=float(batch.temperatures[i]),
                reward=float(batch.rewards[i]),
                teacher_logprobs=None if batch.teacher_logprobs is None else batch.teacher_logprobs[a:b],
                routed_experts=None
                if batch.routed_experts is None
                else batch.route_ids()[a:b].astype(np.int16),
                ce_weights=None
                if batch.ce_weights is None or not np.any(batch.ce_weights[a:b])
                else batch.ce_weights[a:b],
                mm=None
                if batch.images is None or not batch.images.images_per_sample[i]
                else batch.images.sample(i),
                image_end=int(b - a),  # it fitted when packed: keep it whole
            )
        )
    return out


def repack_batches(batches: Sequence[TrainBatch], world_size: int, seq_len: int) -> list[TrainBatch]:
    """One step's batches (packed for N ranks) re-packed for ``world_size`` ranks: the same samples,
    so the same prompts and the same global loss-token count (a resumed run with fewer or more trainer
    ranks trains on exactly what it would have trained on)."""
    step = batches[0].step
    samples = [s for b in batches for s in unpack_samples(b)]
    out, _ = build_batches(samples, step, world_size, seq_len, created_at=batches[0].created_at)
    assert out[0].total_loss_tokens == batches[0].total_loss_tokens, "re-packing changed the batch"
    assert out[0].total_ce_tokens == batches[0].total_ce_tokens, "re-packing changed the batch"
    return out
