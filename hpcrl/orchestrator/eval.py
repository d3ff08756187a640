"""Online evaluation (eval envs, avg@k / pass@k) and validation (train envs' val split).

Neither touches the training buffer: tasks come straight from the env's eval/val split in their
fixed order, and in deterministic mode their sampling seeds live under their own key ("eval",
policy step, env), so evaluating never shifts the training stream or its seeds.

pass@k is the fraction of examples with at least one of its k rollouts reaching a reward of
PASS_THRESHOLD (0.99): the built-in rewards are similarities in [0, 1], so only (near-)exact
answers pass. Errored rollouts count as reward 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcrl.envs.base import Environment
from hpcrl.orchestrator.batch import PASS_THRESHOLD
from hpcrl.orchestrator.rollout import Generator
from hpcrl.orchestrator.state import RolloutRecord

log = logging.getLogger("hpcrl.orchestrator")


@dataclass
class EvalEnv:
    name: str
    env: Environment
    num_examples: int  # -1: all
    k: int


def avg_and_pass_at_k(
    groups: Sequence[Sequence[RolloutRecord]], threshold: float = PASS_THRESHOLD
) -> tuple[float, float]:
    """(mean reward over every rollout, fraction of examples with a rollout >= threshold)."""
    if not groups:
        return float("nan"), float("nan")
    rewards = [[0.0 if r.errored else r.reward for r in g] for g in groups]
    avg = float(np.mean([x for g in rewards for x in g])) if any(rewards) else float("nan")
    passed = float(np.mean([any(x >= threshold for x in g) for g in rewards]))
    return avg, passed


def _take(env: Environment, split: str, n: int):
    tasks = env.tasks(split)
    return list(tasks if n < 0 else tasks[:n])


async def run_eval(
    gen: Generator,
    envs: Sequence[EvalEnv],
    sampling: Mapping[str, Any],
    policy_step: int,
    saved: list | None = None,
) -> dict[str, float]:
    """eval/<env>/{avg@k,pass@k,errored}; `saved` gets (env name, tasks, groups) of each env."""
    out: dict[str, float] = {}
    for e in envs:
        tasks = _take(e.env, "eval", e.num_examples)
        if not tasks:
            log.warning("eval env %s has no eval tasks; skipped", e.name)
            continue
        groups = await gen.groups(e.env, tasks, e.k, sampling, "eval", policy_step, e.name)
        if saved is not None:
            saved.append((e.name, tasks, groups))
        avg, passed = avg_and_pass_at_k(groups)
        out[f"eval/{e.name}/avg@{e.k}"] = avg
        out[f"eval/{e.name}/pass@{e.k}"] = passed
        out[f"eval/{e.name}/errored"] = float(sum(r.errored for g in groups for r in g))
        log.info("eval policy %d %s: avg@%d %.3f pass@%d %.3f", policy_step, e.name, e.k, avg, e.k, passed)
    return out


async def run_val(
    gen: Generator,
    envs: Mapping[str, Environment],
    num_examples: int,
    k: int,
    sampling: Mapping[str, Any],
    step: int,
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, env in envs.items():
        try:
            tasks = _take(env, "val", num_examples)
        except (ValueError, NotImplementedError, KeyError):
            tasks = []
        if not tasks:
            continue
        groups = await gen.groups(env, tasks, k, sampling, "val", step, name)
        out[f"val/{name}/reward"] = avg_and_pass_at_k(groups)[0]
    return out
