"""reward/<env>/<function>/{mean,std} (issue 51), hand-checked: weight x score as the env adds it,
a weight-0 function as metric/<env>/<function>, errored rollouts left out."""

from __future__ import annotations

import math

from hpcrl.orchestrator.metrics import rollout_metrics
from hpcrl.orchestrator.rubric_metrics import rubric_metrics
from hpcrl.orchestrator.state import GroupRecord, RolloutRecord
from hpcrl.orchestrator.transcript import Transcript

WEIGHTS = {"correct": 0.5, "format": 2.0, "length": 0.0}


def _r(i: int, correct: float, fmt: float, length: float, error: str | None = None) -> RolloutRecord:
    metrics = {"correct": correct, "format": fmt, "length": length, "num_turns": 1.0}
    reward = sum(WEIGHTS[k] * metrics[k] for k in WEIGHTS)
    return RolloutRecord(
        index=i,
        pieces=[],
        reward=reward,
        metrics=metrics,
        error=error,
        transcript=Transcript(reward_weights=WEIGHTS),
    )


ROLLOUTS = [_r(0, 1.0, 0.5, 3.0), _r(1, 0.0, 1.0, 5.0), _r(2, 1.0, 1.0, 100.0, error="ValueError: x")]


def test_weighted_means_and_stds() -> None:
    m = rubric_metrics("calc", ROLLOUTS)
    # correct: 0.5 x [1, 0] = [0.5, 0.0] -> mean 0.25, std 0.25
    # format:  2.0 x [0.5, 1] = [1.0, 2.0] -> mean 1.5, std 0.5
    # length:  weight 0, raw [3, 5] -> mean 4, std 1 (the errored rollout's 100 is left out)
    assert m == {
        "reward/calc/correct/mean": 0.25,
        "reward/calc/correct/std": 0.25,
        "reward/calc/format/mean": 1.5,
        "reward/calc/format/std": 0.5,
        "metric/calc/length/mean": 4.0,
        "metric/calc/length/std": 1.0,
    }
    # the functions' means add up to the reward's (a weighted-sum rubric)
    ok = [r.reward for r in ROLLOUTS if not r.errored]
    assert math.isclose(m["reward/calc/correct/mean"] + m["reward/calc/format/mean"], sum(ok) / len(ok))


def test_in_the_step_metrics_per_env() -> None:
    other = _r(0, 0.0, 0.0, 1.0)
    groups = [
        GroupRecord(env="calc", example_id=0, task_index=0, task_epoch=0, rollouts=ROLLOUTS),
        GroupRecord(env="other", example_id=0, task_index=0, task_epoch=0, rollouts=[other]),
    ]
    m = rollout_metrics(groups, step=3)
    assert m["reward/calc/format/mean"] == 1.5 and m["reward/other/format/std"] == 0.0
    assert "reward/all/format/mean" not in m and "reward/calc/num_turns/mean" not in m
    assert m["reward/calc/mean"] == 1.75  # (1.5 + 2.0) / 2 = 0.25 + 1.5, the functions' means


def test_no_weights_no_rubric_metrics() -> None:
    r = RolloutRecord(index=0, pieces=[], metrics={"correct": 1.0})
    assert rubric_metrics("e", [r]) == {}
