"""Metric aliases: one value, computed once, logged under every name users look for.

The seed documents name some metrics differently from hpcrl (prime-rl's `time/wait_for_ckpt`, the
training overview's `reward/mean`, `policy/entropy`, ...) and hpcrl's older names stay readable for
plots and dashboards. `Metrics.log` copies each source name's value to its aliases when the record
has the source and not the alias. docs/observability.md lists this table once.
"""

from __future__ import annotations

from typing import Any

# alias: source (the name the value is computed under)
ALIASES: dict[str, str] = {
    # hpcrl's earlier names for the trainer's all-env means (hpcrl.trainer.env_stats)
    "entropy/mean": "entropy/all/mean",
    "mismatch_kl/mean": "mismatch_kl/all/mean",
    # seed 004 ("During Training": monitor W&B metrics)
    "reward/mean": "reward/all/mean",
    "reward/std": "reward/all/std",
    "policy/entropy": "entropy/all/mean",
    "policy/kl": "mismatch_kl/all/mean",
    # seed 001: the orchestrator waiting for the trainer's next policy (its checkpoint)
    "time/wait_for_ckpt": "time/wait_for_policy",
    # seed 001's SFT / MoE names for hpcrl.trainer.moe_metrics
    "max_vio/mean": "moe/max_vio/mean",
    "routing_confidence/mean": "moe/routing_confidence/mean",
}


def with_aliases(record: dict[str, Any]) -> dict[str, Any]:
    """`record` plus every alias whose source it has (an explicitly logged alias is kept)."""
    extra = {a: record[s] for a, s in ALIASES.items() if s in record and a not in record}
    return record | extra if extra else record
