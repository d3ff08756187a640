"""Per-step orchestrator metrics (names as in prime-rl) and the prompts log.

`logs/prompts.jsonl` gets one line per published step, {"step", "example_ids", "envs"} in the order
the groups were accepted: the resume tests compare it with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcrl.orchestrator.batch import StepCounts
from hpcrl.orchestrator.rubric_metrics import rubric_metrics
from hpcrl.orchestrator.state import GroupRecord
from hpcrl.paths import RunPaths


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def rollout_metrics(groups: Sequence[GroupRecord], step: int) -> dict[str, float]:
    """reward / seq_len / truncation / turns / empty / errored, overall and per env, over every
    rollout generated for this step's groups."""
    out: dict[str, float] = {}
    by_env: dict[str, list[GroupRecord]] = {}
    for g in groups:
        by_env.setdefault(g.env, []).append(g)
    for env, gs in [("all", list(groups)), *sorted(by_env.items())]:
        rs = [r for g in gs for r in g.rollouts]
        ok = [r for r in rs if not r.errored]
        rewards = [r.reward for r in ok]
        out[f"reward/{env}/mean"] = _mean(rewards)
        out[f"reward/{env}/std"] = float(np.std(rewards)) if rewards else float("nan")
        out[f"seq_len/{env}/mean"] = _mean([sum(len(p.input_ids) for p in r.pieces) for r in ok])
        out[f"is_truncated/{env}/mean"] = _mean([float(r.truncated) for r in ok])
        out[f"num_turns/{env}/mean"] = _mean([float(r.num_turns) for r in ok])
        out[f"empty_rollouts/{env}"] = float(sum(r.empty for r in rs))
        out[f"errored_rollouts/{env}"] = float(sum(r.errored for r in rs))
        out[f"rollout/bridge_breaks/{env}"] = float(sum(r.bridge_breaks for r in ok))
        if env != "all":
            out.update(rubric_metrics(env, ok))  # reward/<env>/<function>/{mean,std}
    versions = [r.policy_version for g in groups for r in g.rollouts if not r.errored]
    # Lag behind the policy this batch updates (step-1): 0 = fully on-policy.
    out["off_policy/mean"] = (step - 1) - _mean(versions) if versions else float("nan")
    return out


def step_metrics(
    trained: Sequence[GroupRecord],
    generated: Sequence[GroupRecord],
    step: int,
    counts: StepCounts,
    t_policy: float,
    t_gen: float,
    num_samples: int,
    num_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    m: dict[str, Any] = rollout_metrics(trained, step)
    gen = rollout_metrics(generated, step)
    # Failures are counted over everything generated for the step, filtered groups included, for
    # "all" and per env alike (an env whose every group errored is dropped from `trained`).
    for k, v in gen.items():
        if k.startswith(("empty_rollouts/", "errored_rollouts/")):
            m[k] = v
    m.update(
        {
            "off_policy/dropped": counts.stale_dropped,
            "filter/easy_dropped": counts.filtered["easy"],
            "filter/hard_dropped": counts.filtered["hard"],
            "filter/zero_advantage_dropped": counts.filtered["zero_advantage"],
            "filter/zero_advantage_filled": counts.zero_advantage_filled,
            "filter/all_errored_dropped": counts.filtered["all_errored"],
            "time/wait_for_policy": t_policy,
            "time/generate": t_gen,
            "perf/samples_per_s": num_samples / t_gen if t_gen > 0 else float("nan"),
            "batch/samples": num_samples,
            "batch/tokens": num_tokens,
            **extra,
        }
    )
    return m


class PromptsLog:
    """Appends {"step", "example_ids", "envs"} lines to RunPaths.prompts_log (one O_APPEND write each)."""

    def __init__(self, paths: RunPaths):
        self.path = path = paths.prompts_log
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def truncate_after(self, step: int) -> None:
        """Resume from a state whose last published batch is `step`: forget later lines (those steps
        are generated again), so the log stays one line per step."""
        from hpcrl.fileio import write_text

        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        os.close(self.fd)
        write_text(self.path, "".join(kept))
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, step: int, groups: Sequence[GroupRecord]) -> None:
        line = {"step": step, "example_ids": [g.example_id for g in groups], "envs": [g.env for g in groups]}
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a torn last line from a crash
        return float("inf")


def sample_rows(groups: list[GroupRecord], tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """Rows of the W&B samples table: prompt / completion text (first piece of each rollout)."""
    rows = []
    for g in groups:
        for r, adv in zip(g.rollouts, g.advantages or [0.0] * len(g.rollouts)):
            if not r.pieces:
                continue
            p = r.pieces[0]
            start = next((i for i, m in enumerate(p.loss_mask) if m), len(p.input_ids))
            rows.append(
                {
                    "step": step,
                    "env": g.env,
                    "example_id": g.example_id,
                    "prompt": tokenizer.decode(p.input_ids[:start]),
                    "completion": tokenizer.decode(p.input_ids[start:]),
                    "reward": r.reward,
                    "advantage": adv,
                }
            )
    return rows
