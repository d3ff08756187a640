"""Multi-agent rollouts (several trained traces, e.g. a verifiers 0.4 episode of two agents): each
trace is its own sample, scored with its own reward against the same trace of the group's other
rollouts. Hand-checked numbers (mean-centred advantages, no std normalisation)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hpcrl.config.schema import AdvantageConfig
from hpcrl.config.sections.algo import AlgoConfig
from hpcrl.envs.base import Task, Trajectory, Turn
from hpcrl.envs.verifiers.v1_env import episode_trajectory
from hpcrl.envs.wire.messages import from_wtraj, to_wtraj
from hpcrl.orchestrator.algo import Credit
from hpcrl.orchestrator.batch import StepCounts, judge_group, to_samples
from hpcrl.orchestrator.buffer import Buffer, BufferConfig
from hpcrl.orchestrator.state import GroupRecord
from hpcrl.orchestrator.stitching import to_record

TASK = Task(example_id=0, prompt=[{"role": "user", "content": "hi"}], answer="", info={})


def two_agent_rollout(rewards: list[float]) -> Trajectory:
    """Agent 0 then agent 1, one turn each; the second turn extends the first's ids (it would
    stitch into one sequence if both belonged to one trace)."""
    a = Turn("", [1, 2], [3, 4], [-0.1, -0.2], [0], trace=0)
    b = Turn("", [1, 2, 3, 4, 5], [6], [-0.3], [0], trace=1)
    return Trajectory(TASK, [], 1, [a, b], reward=float(np.mean(rewards)), trace_rewards=rewards)


def test_each_trace_is_a_sample_with_its_own_reward_and_advantage() -> None:
    # Rollout 0: agent 0 won (1, 0); rollout 1: agent 1 won (0, 1). Equal means (0.5, 0.5): scored
    # as whole rollouts the group is uniform and dropped; per trace it teaches both agents.
    records = [to_record(i, two_agent_rollout(r)) for i, r in enumerate([[1.0, 0.0], [0.0, 1.0]])]
    assert [[p.trace for p in r.pieces] for r in records] == [[0, 1], [0, 1]]
    assert records[0].pieces[1].input_ids == [1, 2, 3, 4, 5, 6]  # its own sequence, not stitched on
    g = GroupRecord(env="e", example_id=0, task_index=0, task_epoch=0, rollouts=records)
    counts = StepCounts()
    assert judge_group(
        g,
        Buffer({"e": 1}, BufferConfig()),
        Credit(AlgoConfig(), AdvantageConfig(zero_advantage="drop")),
        counts,
    )
    assert g.advantages == [0.0, 0.0]  # the rollouts' means are equal
    assert g.trace_advantages == [[0.5, -0.5], [-0.5, 0.5]]
    samples = to_samples([g], 1, 8, 1.0, Buffer({"e": 1}, BufferConfig()), counts)
    assert [(s.reward, s.advantage) for s in samples] == [(1.0, 0.5), (0.0, -0.5), (0.0, -0.5), (1.0, 0.5)]


def test_single_trace_rollouts_are_unchanged() -> None:
    t = Turn("", [1, 2], [3], [-0.1], [0])
    recs = [to_record(i, Trajectory(TASK, [], 1, [t], reward=r)) for i, r in enumerate([1.0, 0.0])]
    g = GroupRecord(env="e", example_id=0, task_index=0, task_epoch=0, rollouts=recs)
    assert judge_group(
        g, Buffer({"e": 1}, BufferConfig()), Credit(AlgoConfig(), AdvantageConfig()), StepCounts()
    )
    assert g.advantages == [0.5, -0.5] and g.trace_advantages is None


def test_trace_rewards_cross_the_env_server_wire() -> None:
    back = from_wtraj(TASK, to_wtraj(two_agent_rollout([0.25, 0.75])))
    assert back.trace_rewards == [0.25, 0.75] and [t.trace for t in back.turns] == [0, 1]


def _trace(reward: float, ids: list[int], mask: list[bool], trainable: bool = True):
    branch = SimpleNamespace(
        trainable=True,
        token_ids=ids,
        sampled_mask=mask,
        logprobs=[-0.5] * len(ids),
        nodes=[SimpleNamespace(token_ids=ids, routed_experts=None)],
        calls=[SimpleNamespace(finish_reason="stop")],
        messages=[],
    )
    return SimpleNamespace(
        agent=SimpleNamespace(trainable=trainable),
        branches=[branch],
        metrics={},
        rewards={},
        reward=reward,
        errors=[],
        calls=[],  # verifiers' Trace.calls: one record per model call, with the error that ended it
    )


def test_a_failed_model_call_is_the_cause_before_the_harness_failure_it_caused() -> None:
    """verifiers' interception answers a failed model call 502 (the reason only in its log); the
    harness then exits with a traceback. The rollout's error names the model call's reason first."""
    trace = _trace(0.0, [1, 2], [False, True])
    err = SimpleNamespace(type="ValueError", message="DefaultRenderer does not support tools.")
    trace.calls = [SimpleNamespace(error=err), SimpleNamespace(error=err), SimpleNamespace(error=None)]
    harness = SimpleNamespace(
        type="HarnessError", message="harness 'h' exited 1: Traceback (most recent call last)"
    )
    episode = SimpleNamespace(ok=False, errors=[harness], traces=[trace])
    traj = episode_trajectory(TASK, episode, policy=3)
    assert traj.error == (
        "ValueError: DefaultRenderer does not support tools.; "
        "HarnessError: harness 'h' exited 1: Traceback (most recent call last)"
    )


def test_a_v1_episode_of_two_trained_agents_keeps_both_rewards() -> None:
    episode = SimpleNamespace(
        ok=True,
        errors=[],
        traces=[
            _trace(1.0, [1, 2, 3], [False, True, True]),
            _trace(0.0, [4, 5, 6], [False, False, True]),
            _trace(0.5, [7, 8], [False, True], trainable=False),  # a frozen opponent: not trained
        ],
    )
    traj = episode_trajectory(TASK, episode, policy=3)
    assert traj.reward == 0.5 and traj.trace_rewards == [1.0, 0.0]
    assert [(t.trace, t.completion_token_ids) for t in traj.turns] == [(0, [2, 3]), (1, [6])]
