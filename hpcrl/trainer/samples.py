"""The trainer's rows of the W&B samples table (`samples/<role>`): what rank 0 trained this step, one
row per sample of its shard, decoded (`trainer.wandb.log_extras.samples` / `.sample_ratio` choose
whether and how many; hpcrl.monitor.metrics.Metrics.log_samples keeps the ratio)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcrl.bus import TrainBatch


def trainer_sample_rows(batch: TrainBatch, tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """One row per sample: prompt (the tokens before its first trained token), completion (the rest,
    tool and environment turns included), reward, advantage (of its first trained token), env,
    example id, and the policy that sampled it."""
    rows: list[dict[str, Any]] = []
    ends = np.cumsum(np.asarray(batch.seq_lens, dtype=np.int64))
    for i, end in enumerate(ends):
        start = int(end - batch.seq_lens[i])
        ids = np.asarray(batch.input_ids[start:end])
        mask = np.asarray(batch.loss_mask[start:end], dtype=bool)
        first = int(mask.argmax()) if mask.any() else len(ids)
        rows.append(
            {
                "step": step,
                "env": batch.env_names[i],
                "example_id": int(batch.example_ids[i]),
                "prompt": tokenizer.decode(ids[:first].tolist()),
                "completion": tokenizer.decode(ids[first:].tolist()),
                "reward": float(batch.rewards[i]),
                "advantage": float(batch.advantages[start + first]) if first < len(ids) else 0.0,
                "policy_version": int(batch.policy_versions[i]),
            }
        )
    return rows
