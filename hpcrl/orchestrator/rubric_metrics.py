"""Rubric scores as metrics (issue 51): one series per reward function of each env.

    reward/<env>/<function>/{mean,std}   weight x score, as the env adds it into the reward: for a
                                         weighted-sum rubric the functions' means add up to
                                         reward/<env>/mean (prime-rl logs `Reward.value` the same way)
    metric/<env>/<function>/{mean,std}   the raw score of a weight-0 function (a pure metric)

over the rollouts of the step that did not error, with the weights each rollout carries
(Transcript.reward_weights: hpcrl's Rubric, a verifiers rubric's weights, or a verifiers 0.4
trace's Reward.weight). A per-rollout number without a weight (num_turns) is no rubric function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hpcrl.orchestrator.state import RolloutRecord


def weighted_scores(r: RolloutRecord) -> dict[str, tuple[float, bool]]:
    """{function: (weight x score, True), or (score, False) for a weight-0 one} of one rollout."""
    weights = r.transcript.reward_weights if r.transcript is not None else {}
    out = {}
    for fn, score in r.metrics.items():
        w = weights.get(fn)
        if w is None:
            continue
        out[fn] = (w * score, True) if w != 0 else (score, False)
    return out


def rubric_metrics(env: str, rollouts: Sequence[RolloutRecord]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for r in rollouts:
        if r.errored:
            continue
        for fn, (v, weighted) in weighted_scores(r).items():
            values.setdefault(f"{'reward' if weighted else 'metric'}/{env}/{fn}", []).append(v)
    out: dict[str, float] = {}
    for key, xs in sorted(values.items()):
        mean = math.fsum(xs) / len(xs)
        out[f"{key}/mean"] = mean
        out[f"{key}/std"] = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    return out
