"""Scored rollouts for `hpcrl eval` and GEPA through the orchestrator's own machinery.

Requests go through hpcrl.orchestrator.rollout and its pool / chat / stitching modules (token ids,
exact multi-turn stitching, shared first turns, retries) and rewards come from the environment's
rubric exactly as in training, so an eval score means what a training reward means. What the
orchestrator drops (the conversation text) is caught with run_group's sink and written per rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrl.envs.base import Environment, Message, Task, Trajectory
from hpcrl.orchestrator.pool import ServerPool
from hpcrl.orchestrator.rollout import Generator, run_group
from hpcrl.orchestrator.state import RolloutRecord


@dataclass
class ScoredGroup:
    env: str
    task: Task
    records: list[RolloutRecord]
    trajectories: dict[int, Trajectory]  # rollout index -> trajectory (errored rollouts have none)


def sampling_seed(cfg: Any) -> int | None:
    return cfg.sampling.seed if cfg.sampling.seed is not None else cfg.seed


def make_generator(cfg: Any, base_url: str, tokenizer: Any, api_key: str | None) -> Generator:
    """The Generator of an `hpcrl eval` / `hpcrl gepa` config (EvalRunConfig, GepaRunConfig) against
    the endpoint at `base_url`."""
    pool = ServerPool(
        [base_url],
        model=cfg.model,
        timeout=cfg.client.timeout_s,
        max_concurrent=cfg.client.max_concurrent,
        api_key=api_key,
    )
    from hpcrl.render.select import typed_renderers

    renderers = typed_renderers(tokenizer, cfg.renderer, cfg.model or "", "renderer")
    # No training here: every token comes from "policy 0" (the model as it is).
    return Generator(pool, tokenizer, cfg.seq_len, lambda: 0, sampling_seed(cfg), renderers=renderers)


async def score_group(
    gen: Generator,
    env_name: str,
    env: Environment,
    task: Task,
    k: int,
    sampling: Mapping[str, Any],
    key: Sequence[object],
) -> ScoredGroup:
    """k scored rollouts of one task; request seeds derive from (seed, *key, example_id, rollout)."""
    trajs: dict[int, Trajectory] = {}

    def sink(_task: Task, index: int, traj: Trajectory) -> None:
        trajs[index] = traj

    records = await run_group(env, task, k, sampling, gen.client_factory(*key, task.example_id), sink=sink)
    return ScoredGroup(env_name, task, records, trajs)


async def score_all(
    gen: Generator,
    jobs: Sequence[tuple[str, Environment, Task, int]],
    sampling: Mapping[str, Any],
    key: Callable[[str], Sequence[object]],
    on_done: Callable[[ScoredGroup], None] | None = None,
) -> list[ScoredGroup]:
    """Every (env name, env, task, k) job at once (the pool bounds concurrency), in job order."""

    async def one(job: tuple[str, Environment, Task, int]) -> ScoredGroup:
        name, env, task, k = job
        group = await score_group(gen, name, env, task, k, sampling, key(name))
        if on_done is not None:
            on_done(group)
        return group

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def _prompt_and_completion(
    env: Environment, task: Task, traj: Trajectory | None
) -> tuple[list[Message], list[Message]]:
    if traj is None:
        return env.initial_messages(task), []
    return traj.messages[: traj.num_prompt_messages], traj.completion


def result_rows(group: ScoredGroup, env: Environment) -> list[dict[str, Any]]:
    """One results.jsonl line per rollout of the group."""
    rows = []
    for rec in group.records:
        traj = group.trajectories.get(rec.index)
        prompt, completion = _prompt_and_completion(env, group.task, traj)
        prompt_tokens = len(traj.turns[0].prompt_token_ids) if traj is not None and traj.turns else 0
        rows.append(
            {
                "example_id": group.task.example_id,
                "rollout_index": rec.index,
                "env": group.env,
                "prompt": prompt,
                "completion": completion,
                "answer": group.task.answer,
                "reward": 0.0 if rec.errored else rec.reward,
                "metrics": dict(rec.metrics),
                "prompt_tokens": prompt_tokens,
                "completion_tokens": rec.completion_tokens,
                "num_turns": rec.num_turns,
                "truncated": rec.truncated,
                "error": rec.error,
            }
        )
    return rows
