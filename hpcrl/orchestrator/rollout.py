"""Rollouts: groups of scored trajectories from environments, driven over the inference pool.

Generator schedules groups (interleaved or branching); run_group runs one (a single-turn group is one
request with n choices); a failing environment or request errors only its rollouts. The pieces live
beside it: hpcrl.orchestrator.pool (HTTP, retries), .chat (the ChatClients, request fields) and
.stitching (exact multi-turn token stitching, records); their public names are re-exported here.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcrl.envs.base import Environment, Message, Task, Trajectory, Turn
from hpcrl.envs.errors import EnvServerFailed
from hpcrl.orchestrator.chat import GroupClient, RolloutClient, derive_seed, openai_sampling
from hpcrl.orchestrator.pool import (
    BACKOFF_S,
    FAILURE_STREAK,
    RETRIES,
    RequestFailed,
    ServerPool,
    teacher_logprobs,
)
from hpcrl.orchestrator.servers import InferenceUnavailable
from hpcrl.orchestrator.state import RolloutRecord
from hpcrl.orchestrator.stitching import (
    encode,
    env_response_ids,
    pieces_from_turns,
    render,
    stitch_prompt,
    template_kwargs,
    to_record,
)
from hpcrl.orchestrator.transcript import errored_transcript

__all__ = [
    "BACKOFF_S",
    "FAILURE_STREAK",
    "RETRIES",
    "Generator",
    "GroupClient",
    "InferenceUnavailable",
    "RequestFailed",
    "RolloutClient",
    "ServerPool",
    "SharedFirstTurn",
    "Sink",
    "derive_seed",
    "encode",
    "env_response_ids",
    "openai_sampling",
    "pieces_from_turns",
    "render",
    "run_group",
    "single_turn",
    "stitch_prompt",
    "teacher_logprobs",
    "template_kwargs",
    "to_record",
]

Sink = Callable[[Task, int, Trajectory], None]
"""Sees every finished (not errored) trajectory before it becomes a record: `hpcrl eval` and GEPA
keep the conversation text that RolloutRecord leaves out."""


async def run_group(
    env: Environment,
    task: Task,
    n: int,
    sampling: Mapping[str, Any],
    make_client: Callable[[int], RolloutClient],
    branching: bool = False,
    sink: Sink | None = None,
) -> list[RolloutRecord]:
    """`n` scored rollouts of `task`. An env or request failure errors that rollout (or the whole
    group for group-run environments); InferenceUnavailable propagates and ends the run."""
    if not env.group_scored:
        if n > 1 and single_turn(env):
            shared = SharedFirstTurn(make_client(0), n)
            return list(
                await asyncio.gather(
                    *(_one(env, task, sampling, shared.view(), i, branching, sink) for i in range(n))
                )
            )
        return list(
            await asyncio.gather(
                *(_one(env, task, sampling, make_client(i), i, branching, sink) for i in range(n))
            )
        )
    started = time.time()
    try:
        trajs = await env.rollout_group(task, GroupClient(make_client), sampling, n)
    except (InferenceUnavailable, EnvServerFailed):
        raise
    except Exception as e:  # noqa: BLE001 - any env bug must cost only its rollouts
        return [_errored(i, e, env.name, task, started) for i in range(n)]
    return [_record(env, task, i, t, branching, sink, started) for i, t in enumerate(trajs)]


def _record(
    env: Environment,
    task: Task,
    index: int,
    traj: Trajectory,
    branching: bool,
    sink: Sink | None,
    started: float = 0.0,
) -> RolloutRecord:
    if sink is not None:
        sink(task, index, traj)
    return to_record(index, env.with_weights(traj), branching, started, time.time())


async def _one(
    env: Environment,
    task: Task,
    sampling: Mapping[str, Any],
    client: RolloutClient | _SharedView,
    index: int,
    branching: bool = False,
    sink: Sink | None = None,
) -> RolloutRecord:
    started = time.time()
    try:
        return _record(env, task, index, await env.rollout(task, client, sampling), branching, sink, started)
    except (InferenceUnavailable, EnvServerFailed):
        raise
    except Exception as e:  # noqa: BLE001 - an env that raises errors its rollout, the run goes on
        return _errored(index, e, env.name, task, started)
    finally:
        if isinstance(client, _SharedView):
            client.close()


def single_turn(env: Environment) -> bool:
    """Rollouts of this env make exactly one chat call (the reference driver, one turn, no tools), so
    a group's n calls can be one request with n choices."""
    return env.shares_first_turn


class SharedFirstTurn:
    """Joins the single chat call of each of a group's n rollouts into requests with n choices.

    Each rollout talks to its own `view()`. Once every rollout has either asked or finished without
    asking (an env error before its turn), the calls go out, one request per distinct (messages,
    tools, sampling) — normally exactly one — and the choices are handed back in order of asking.
    """

    def __init__(self, client: RolloutClient, n: int):
        self.client, self.expected = client, n
        self.pending: list[tuple[list[Message], list[dict] | None, Mapping[str, Any], asyncio.Future]] = []
        self.tasks: set[asyncio.Task] = set()

    def view(self) -> _SharedView:
        return _SharedView(self)

    def ask(
        self, messages: list[Message], tools: list[dict] | None, sampling: Mapping[str, Any]
    ) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((messages, tools, sampling, fut))
        self._maybe_send()
        return fut

    def gone(self) -> None:
        self.expected -= 1
        self._maybe_send()

    def _maybe_send(self) -> None:
        if not self.pending or len(self.pending) < self.expected:
            return
        calls, self.pending = self.pending, []
        same: dict[str, list[tuple[Any, ...]]] = {}
        for call in calls:
            same.setdefault(repr(call[:3]), []).append(call)
        for group in same.values():
            task = asyncio.ensure_future(self._send(group))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _send(self, group: list[tuple[Any, ...]]) -> None:
        messages, tools, sampling, _ = group[0]
        try:
            turns = await self.client.chat_group(messages, tools, sampling, len(group))
        except asyncio.CancelledError:
            for *_, fut in group:
                fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every waiting rollout gets the failure
            for *_, fut in group:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (*_, fut), turn in zip(group, turns):
            if not fut.done():
                fut.set_result(turn)


class _SharedView:
    """One rollout's ChatClient onto a SharedFirstTurn."""

    def __init__(self, shared: SharedFirstTurn):
        self.shared, self.asked = shared, False

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        assert not self.asked, "a single-turn rollout asked twice"
        self.asked = True
        return await self.shared.ask(copy.deepcopy(messages), tools, dict(sampling))

    def close(self) -> None:
        if not self.asked:  # finished (an env error) without asking: stop waiting for it
            self.asked = True
            self.shared.gone()


def _errored(
    index: int, e: BaseException, env_name: str, task: Task | None = None, started: float = 0.0
) -> RolloutRecord:
    from hpcrl.monitor.logging import env_logger

    env_logger(env_name).warning("rollout %d errored: %s: %s", index, type(e).__name__, e)
    return RolloutRecord(
        index=index,
        pieces=[],
        error=f"{type(e).__name__}: {e}"[:500],
        transcript=errored_transcript(task, started, time.time()),
    )


class Generator:
    """Runs groups of rollouts against a ServerPool. With `seed` set (deterministic mode) every
    request's sampling seed derives from (seed, key..., example id, rollout index, turn).

    `strategy` (orchestrator.trajectory_strategy) schedules multi-turn work:
    - interleaved: every requested example's group runs at once, so turns of different examples
      interleave on the servers (while one conversation waits for its env, others decode);
    - branching: one example at a time: its n rollouts branch from the shared prompt and run to their
      last turn before the next example's first request is sent (fewer conversations in flight,
      each finishes sooner; lower throughput).
    Either way a rollout's turns are stitched into one sample, and results are the same per seed."""

    def __init__(
        self,
        pool: ServerPool,
        tokenizer: Any,
        seq_len: int,
        default_policy: Callable[[], int],
        seed: int | None,
        strategy: str = "interleaved",
        renderers: Any = None,
    ):
        assert strategy in ("interleaved", "branching"), strategy
        # hpcrl.orchestrator.renderer_client.Renderers: renderer-driven rollouts (/inference/v1/generate, bridged
        # turns); None: the tokenizer's chat template with hpcrl's exact stitching.
        self.renderers = renderers
        self.pool, self.tokenizer, self.seq_len = pool, tokenizer, seq_len
        self.default_policy, self.seed, self.strategy = default_policy, seed, strategy
        self.branching = strategy == "branching"  # also: one training sample per assistant turn
        self.env_roles = (
            False  # clients record each env-provided token's role (echo; hpcrl.orchestrator.env_roles)
        )
        self._example_lock: asyncio.Lock | None = None
        self.images: Any = None  # [model.vlm]: SampleImages, for image prompts' lengths (chat.py)

    def client_factory(self, *key: object) -> Callable[[int], RolloutClient]:
        def make(i: int) -> RolloutClient:
            seed = None if self.seed is None else derive_seed(self.seed, *key, i)
            if self.renderers is not None:
                from hpcrl.orchestrator.renderer_client import RendererClient

                client = RendererClient(self.pool, self.renderers, self.seq_len, seed, self.default_policy)
            else:
                client = RolloutClient(self.pool, self.tokenizer, self.seq_len, seed, self.default_policy)
            client.env_roles = self.env_roles
            client.images = self.images
            return client  # type: ignore[return-value]  (the same ChatClient protocol)

        return make

    async def groups(
        self,
        env: Environment,
        tasks: Sequence[Task],
        n: int,
        sampling: Mapping[str, Any],
        *key: object,
        sink: Sink | None = None,
    ) -> list[list[RolloutRecord]]:
        return list(await asyncio.gather(*(self._group(env, t, n, sampling, key, sink) for t in tasks)))

    async def _group(
        self,
        env: Environment,
        task: Task,
        n: int,
        sampling: Mapping[str, Any],
        key: tuple[object, ...],
        sink: Sink | None,
    ) -> list[RolloutRecord]:
        make = self.client_factory(*key, task.example_id)
        if self.strategy == "interleaved":
            return await run_group(env, task, n, sampling, make, sink=sink)
        if self._example_lock is None:
            self._example_lock = asyncio.Lock()
        async with self._example_lock:  # branching: this example's trajectories finish first
            return await run_group(env, task, n, sampling, make, branching=True, sink=sink)
