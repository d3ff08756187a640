"""The parallelism rules a model imposes, stated once: the dry run (hpcrl/launch/checks.py), the
memory plan (hpcrl/launch/memory_plan.py) and the trainer (models/qwen3/parallelize.py) all call these.

Pure functions of plain numbers; each raises a ConfigError naming `field`."""

from __future__ import annotations

from hpcrl.errors import ConfigError


def check_ep(
    ep: int,
    ranks: int,
    *,
    num_experts: int | None = None,
    moe: bool | None = None,
    model_name: str = "",
    field: str = "trainer.model.ep",
) -> None:
    """Expert parallelism: ``ep`` divides the trainer ranks (consecutive groups of ep ranks) and the
    model's experts; a model known to have no experts takes ep = 1. ``num_experts`` / ``moe`` None:
    the architecture is not known here (a Hub id not in the local cache), checked again at load."""
    if ep == 1:
        return
    if ep < 1 or ranks % ep:
        raise ConfigError(field, f"{ep} must divide the number of trainer ranks ({ranks})")
    if moe is False:
        what = f"{model_name!r} has no experts" if model_name else "the model has no MoE layers"
        raise ConfigError(field, f"{ep} needs an MoE model; {what}")
    if num_experts is not None and num_experts % ep:
        raise ConfigError(field, f"{ep} does not divide the model's {num_experts} experts")


def ep_groups(ranks: int, ep: int) -> list[list[int]]:
    """Trainer ranks of each expert-parallel group: consecutive ranks (a node's GPUs first), so
    the all-to-all stays inside a node whenever ep <= GPUs per node."""
    check_ep(ep, ranks)
    return [list(range(g * ep, (g + 1) * ep)) for g in range(ranks // ep)]
