"""What a saved rollout shows beyond its training data: the whole conversation, each sampled turn's
tokens, the weights the env gave its reward functions, and when it ran.

A RolloutRecord keeps its Transcript from the moment the trajectory is scored until the step's
rollouts are written (hpcrl.orchestrator.rollout_log); nothing on the training path reads it. The
lists are the trajectory's own (no copy): building one costs a few object references.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hpcrl.envs.base import Task, Trajectory, Turn


class TurnLog(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sampled turn: its prompt length, the tokens it sampled and their sampling logprobs."""

    prompt_len: int
    completion_ids: list[int]
    logprobs: list[float]
    policy: tuple[int, int]  # oldest and newest policy step that sampled its tokens
    finish_reason: str = "stop"
    trace: int = 0  # multi-agent: the trained trace it belongs to


class Transcript(msgspec.Struct, kw_only=True, omit_defaults=True):
    messages: list[dict[str, Any]] = []  # the whole conversation, prompt first
    num_prompt_messages: int = 0
    turns: list[TurnLog] = []
    reward_weights: dict[str, float] = {}  # rubric function -> the weight the env applied
    started: float = 0.0  # Unix time the rollout (a group-scored env: its group) started
    finished: float = 0.0


def turn_log(t: Turn) -> TurnLog:
    steps = t.policy_steps
    return TurnLog(
        prompt_len=len(t.prompt_token_ids),
        completion_ids=t.completion_token_ids,
        logprobs=t.completion_logprobs,
        policy=(min(steps), max(steps)) if steps else (0, 0),
        finish_reason=t.finish_reason,
        trace=t.trace,
    )


def transcript_of(traj: Trajectory, started: float = 0.0, finished: float = 0.0) -> Transcript:
    return Transcript(
        messages=traj.messages,
        num_prompt_messages=traj.num_prompt_messages,
        turns=[turn_log(t) for t in traj.turns if t.completion_token_ids],
        reward_weights=dict(traj.reward_weights),
        started=started,
        finished=finished,
    )


def errored_transcript(task: Task | None, started: float = 0.0, finished: float = 0.0) -> Transcript:
    """An errored rollout keeps what it was asked (its prompt)."""
    prompt = list(task.prompt) if task is not None else []
    return Transcript(messages=prompt, num_prompt_messages=len(prompt), started=started, finished=finished)
