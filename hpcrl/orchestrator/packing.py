"""Pack finished samples into one flat batch per trainer rank with balanced token counts.

Samples are assigned greedily, longest first, to the rank with the fewest tokens so far (ties:
the lower sample index goes first, the lower rank wins), which keeps the slowest rank - the one
every other rank waits for - close to the mean. Inside a rank, samples keep their input order and
are concatenated: `seq_lens` delimits them and `position_ids` restart at 0 for each, so the trainer
can run them as one packed sequence (varlen attention) or split them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hpcrl.balance import assign_to_ranks
from hpcrl.bus.images import join_images
from hpcrl.bus.messages import ROW_FIELDS, SAMPLE_FIELDS, TOKEN_FIELDS

Overlong = Literal["truncate", "drop"]

# What the orchestrator packs: every sample field of a TrainBatch (named once, on the bus) but the
# reference logprobs, which the trainer computes itself.
BATCH_KEYS = (*(k for k in TOKEN_FIELDS + SAMPLE_FIELDS + ROW_FIELDS if k != "reference_logprobs"), "images")


@dataclass
class Sample:
    """One training sequence (prompt + completion tokens, multi-turn already stitched)."""

    input_ids: np.ndarray  # int[L]
    loss_mask: np.ndarray  # bool[L]: True on sampled tokens
    inference_logprobs: np.ndarray  # float[L]: sampling logprobs (0 where masked)
    advantage: float | np.ndarray  # scalar, broadcast to every token, or float[L]
    policy_version: int  # oldest policy that produced a token of this sample
    example_id: int
    env_name: str
    temperature: float
    reward: float
    teacher_logprobs: np.ndarray | None = None  # float[L]
    routed_experts: np.ndarray | None = None  # int16[L, layers*k]: MoE router replay, -1 = none
    ce_weights: np.ndarray | None = None  # float[L]: echo's cross-entropy weight per token (0 = none)
    # vision-language RL: (pixel_values float32 [P, D], image_grid_thw int32 [I, 3]) of its images, and
    # the index after its last image token (a cut before it would orphan an image: the sample is dropped)
    mm: tuple[np.ndarray, np.ndarray] | None = None
    image_end: int = 0

    def __len__(self) -> int:
        return int(len(self.input_ids))


@dataclass
class PackStats:
    num_samples: int = 0  # packed
    num_truncated: int = 0
    num_dropped: int = 0  # overlong with overlong="drop", empty, or nothing trainable left
    tokens_per_rank: list[int] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return max(self.tokens_per_rank, default=0)

    @property
    def min_tokens(self) -> int:
        return min(self.tokens_per_rank, default=0)

    def metrics(self) -> dict[str, float]:
        mean = sum(self.tokens_per_rank) / max(len(self.tokens_per_rank), 1)
        return {
            "pack/samples": float(self.num_samples),
            "pack/truncated": float(self.num_truncated),
            "pack/dropped": float(self.num_dropped),
            "pack/max_tokens_per_rank": float(self.max_tokens),
            "pack/min_tokens_per_rank": float(self.min_tokens),
            # 1.0 = perfect balance; the slowest rank sets the step time
            "pack/imbalance": float(self.max_tokens / mean) if mean else 1.0,
        }


def _check(s: Sample, i: int) -> None:
    n = len(s)
    for name in ("loss_mask", "inference_logprobs"):
        if len(getattr(s, name)) != n:
            raise ValueError(f"sample {i}: {name} has {len(getattr(s, name))} entries for {n} tokens")
    for name in ("teacher_logprobs", "ce_weights"):
        v = getattr(s, name)
        if v is not None and len(v) != n:
            raise ValueError(f"sample {i}: {name} has {len(v)} entries for {n} tokens")
    if np.ndim(s.advantage) == 1 and len(s.advantage) != n:  # type: ignore[arg-type]
        raise ValueError(f"sample {i}: advantage has {len(s.advantage)} entries for {n} tokens")  # type: ignore[arg-type]


def _fit(samples: Sequence[Sample], seq_len: int, overlong: Overlong, stats: PackStats) -> list[Sample]:
    """Apply the seq_len policy; drops samples left with no trainable token."""
    kept: list[Sample] = []
    for i, s in enumerate(samples):
        _check(s, i)
        if len(s) > seq_len:
            if overlong == "drop" or (s.mm is not None and s.image_end > seq_len):
                stats.num_dropped += 1
                continue
            stats.num_truncated += 1
            adv = s.advantage[:seq_len] if np.ndim(s.advantage) == 1 else s.advantage  # type: ignore[index]
            tlp = None if s.teacher_logprobs is None else s.teacher_logprobs[:seq_len]
            routed = None if s.routed_experts is None else s.routed_experts[:seq_len]
            ce = None if s.ce_weights is None else s.ce_weights[:seq_len]
            s = Sample(
                s.input_ids[:seq_len],
                s.loss_mask[:seq_len],
                s.inference_logprobs[:seq_len],
                adv,
                s.policy_version,
                s.example_id,
                s.env_name,
                s.temperature,
                s.reward,
                tlp,
                routed,
                ce,
                s.mm,
                s.image_end,
            )
        if len(s) == 0 or not (np.any(s.loss_mask) or (s.ce_weights is not None and np.any(s.ce_weights))):
            stats.num_dropped += 1
            continue
        kept.append(s)
    return kept


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _rank_batch(samples: list[Sample], with_teacher: bool) -> dict[str, Any]:
    lens = [len(s) for s in samples]
    return {
        "input_ids": _concat([np.asarray(s.input_ids) for s in samples], np.int32),
        "position_ids": _concat([np.arange(n) for n in lens], np.int32),
        "seq_lens": np.asarray(lens, dtype=np.int32),
        "loss_mask": _concat([np.asarray(s.loss_mask, dtype=bool) for s in samples], bool),
        "advantages": _concat(
            [np.broadcast_to(np.asarray(s.advantage, dtype=np.float32), (len(s),)) for s in samples],
            np.float32,
        ),
        "inference_logprobs": _concat([np.asarray(s.inference_logprobs) for s in samples], np.float32),
        "policy_versions": np.asarray([s.policy_version for s in samples], dtype=np.int32),
        "temperatures": np.asarray([s.temperature for s in samples], dtype=np.float32),
        "env_names": [s.env_name for s in samples],
        "example_ids": np.asarray([s.example_id for s in samples], dtype=np.int64),
        "rewards": np.asarray([s.reward for s in samples], dtype=np.float32),
        "teacher_logprobs": _concat([np.asarray(s.teacher_logprobs) for s in samples], np.float32)
        if with_teacher
        else None,
        "routed_experts": _routes(samples),
        "ce_weights": _concat(
            [
                np.zeros(len(s), np.float32) if s.ce_weights is None else np.asarray(s.ce_weights)
                for s in samples
            ],
            np.float32,
        )
        if any(s.ce_weights is not None for s in samples)
        else None,
        "images": join_images([s.mm for s in samples]),
    }


def _routes(samples: list[Sample]) -> np.ndarray | None:
    """[T, layers*k] expert ids of the rank's tokens (-1 rows for samples without), None if none has any."""
    widths = {s.routed_experts.shape[1] for s in samples if s.routed_experts is not None}
    if len(widths) != 1:
        return None  # no MoE routes (or servers that disagree on the shape: no replay this step)
    (w,) = widths
    parts = [
        np.asarray(s.routed_experts, np.int16)
        if s.routed_experts is not None
        else np.full((len(s), w), -1, np.int16)
        for s in samples
    ]
    return np.concatenate(parts)


def pack_for_ranks(
    samples: Sequence[Sample], num_ranks: int, seq_len: int, overlong: Overlong = "truncate"
) -> tuple[list[dict[str, Any]], PackStats]:
    """One batch dict per rank (keys: BATCH_KEYS) and the packing stats. A rank can be empty
    (zero-length arrays) when there are fewer samples than ranks."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r} is not one of truncate, drop")
    stats = PackStats()
    kept = _fit(samples, seq_len, overlong, stats)
    has_teacher = [s.teacher_logprobs is not None for s in kept]
    if any(has_teacher) and not all(has_teacher):
        raise ValueError("teacher_logprobs must be given for all samples or for none")
    assignment = assign_to_ranks([len(s) for s in kept], num_ranks)
    batches = [
        _rank_batch([kept[i] for i in idx], bool(has_teacher) and all(has_teacher)) for idx in assignment
    ]
    stats.num_samples = len(kept)
    stats.tokens_per_rank = [int(b["seq_lens"].sum()) for b in batches]
    return batches, stats
