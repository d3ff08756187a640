"""What `hpcrl eval` reports per environment: pure functions over the scored groups.

- avg@k: the mean reward over every rollout; pass@k: the fraction of examples with at least one
  rollout whose reward reaches the pass threshold. Both come from the orchestrator's own function
  (hpcrl.orchestrator.eval.avg_and_pass_at_k), so they mean what the training run's eval metrics
  mean. Errored rollouts count as reward 0.
- reward_std over every rollout, and example_std: the mean over examples of the standard deviation of
  its k rewards (the seed's "check the per-example variance" before training).
- uniform_fraction: the fraction of examples whose k rewards are all equal. Such a group has zero
  group-relative advantage: it teaches an RL run nothing. Undefined (None) when k = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcrl.orchestrator.eval import avg_and_pass_at_k
from hpcrl.orchestrator.state import RolloutRecord

EQUAL_TOL = 1e-9


def rewards_of(group: Sequence[RolloutRecord]) -> list[float]:
    return [0.0 if r.errored else float(r.reward) for r in group]


def uniform_fraction(groups: Sequence[Sequence[RolloutRecord]]) -> float | None:
    """Fraction of groups whose rewards are all equal; None when no group has two rollouts."""
    sized = [rewards_of(g) for g in groups if len(g) >= 2]
    if not sized:
        return None
    return float(np.mean([max(r) - min(r) <= EQUAL_TOL for r in sized]))


def summarize_env(groups: Sequence[Sequence[RolloutRecord]], k: int, threshold: float) -> dict[str, Any]:
    """One environment's summary (see the module docstring for every field)."""
    avg, passed = avg_and_pass_at_k(groups, threshold)
    flat = [x for g in groups for x in rewards_of(g)]
    rollouts = [r for g in groups for r in g]
    return {
        "num_examples": len(groups),
        "rollouts_per_example": k,
        "num_rollouts": len(rollouts),
        f"avg@{k}": avg,
        f"pass@{k}": passed,
        "reward_mean": float(np.mean(flat)) if flat else float("nan"),
        "reward_std": float(np.std(flat)) if flat else float("nan"),
        "example_std": float(np.mean([np.std(rewards_of(g)) for g in groups])) if groups else float("nan"),
        "uniform_fraction": uniform_fraction(groups),
        "errored": sum(r.errored for r in rollouts),
        "truncated_fraction": float(np.mean([r.truncated for r in rollouts])) if rollouts else 0.0,
        "completion_tokens_mean": float(np.mean([r.completion_tokens for r in rollouts]))
        if rollouts
        else 0.0,
    }


def recommendation(s: dict[str, Any], no_signal_threshold: float) -> str | None:
    """One line of advice when too many examples gave the same reward in all k rollouts (or every
    rollout errored); None when the baseline looks trainable."""
    k = s["rollouts_per_example"]
    if s["num_rollouts"] and s["errored"] == s["num_rollouts"]:
        return "every rollout errored: fix the environment or the endpoint before training (see logs/)"
    frac = s["uniform_fraction"]
    if frac is None or frac < no_signal_threshold:
        return None
    mean = s["reward_mean"]
    head = f"{frac:.0%} of examples got the same reward in all {k} rollouts (no RL signal in those groups): "
    if mean >= 0.8:
        return head + "the task is too easy for this model; use harder examples"
    if mean <= 0.2:
        return head + (
            "the task is too hard for this model; use easier examples, a stronger model or an SFT "
            "warm-up first"
        )
    return head + "raise sampling.temperature or rollouts_per_example, or pick examples of mixed difficulty"


def table_rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    """[env, n x k, avg@k, pass@k, reward mean ± std, example std, uniform, errored] per env."""

    def fmt(v: Any) -> str:
        return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"

    rows = []
    for env, s in summary.items():
        k = s["rollouts_per_example"]
        rows.append(
            [
                env,
                f"{s['num_examples']} x {k}",
                fmt(s[f"avg@{k}"]),
                fmt(s[f"pass@{k}"]),
                f"{fmt(s['reward_mean'])} ± {fmt(s['reward_std'])}",
                fmt(s["example_std"]),
                fmt(s["uniform_fraction"]),
                str(s["errored"]),
            ]
        )
    return rows


TABLE_HEADER = ["env", "n x k", "avg@k", "pass@k", "reward mean ± std", "example std", "all-equal", "errored"]
