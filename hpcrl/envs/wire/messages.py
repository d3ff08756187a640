"""Every message between the orchestrator, an env server and its workers: msgspec Structs as msgpack.

    orchestrator ──Run──────▶ worker (runs the env's rollout code)
                 ◀─Chat──────        (one model turn wanted: the orchestrator owns inference,
                 ──ChatReply─▶        token ids and policy versions)
                 ◀─Done──────        (trajectories, or the error that ended them)
    orchestrator ◀─Hello / WorkerDied── env server (starts, watches, replaces workers)
                 ──Kill / Stop────────▶

A frame is a msgpack-encoded list of `Msg` (a tagged union): what one side queued for one peer in one
event-loop iteration leaves as one frame (hpcrl.envs.wire.frames), so a group's 4 model turns or a step's
32 Runs cost one socket send, not 32. No pickle crosses a socket. Tasks, turns and
trajectories travel as plain msgspec Structs mirroring hpcrl.envs.base's dataclasses; `to_*` / `from_*`
convert at the edges so env code and the orchestrator keep their own types.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hpcrl.envs.base import Task, Trajectory, Turn


class WTask(msgspec.Struct, array_like=True):
    example_id: int
    prompt: list[dict[str, Any]]
    answer: str
    info: dict[str, Any]


class WTurn(msgspec.Struct, array_like=True):
    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    policy_steps: list[int]
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None
    reasoning: str | None
    rerendered: bool
    routed_experts: list[list[list[int]]] | None  # MoE router replay: [tokens][layers][k]
    trace: int = 0  # multi-agent: the trained trace this turn belongs to
    prompt_routed_experts: list[list[list[int]]] | None = None  # ... of the prompt tokens
    env_roles: bytes | None = None  # message role of each env-provided token (echo)
    images: list[str] | None = None  # the prompt's image URLs (vision-language RL)


class WTrajectory(msgspec.Struct, array_like=True):
    messages: list[dict[str, Any]]
    num_prompt_messages: int
    turns: list[WTurn]
    reward: float
    metrics: dict[str, float]
    state: dict[str, Any]
    truncated: bool
    error: str | None
    trace_rewards: list[float] | None = None
    reward_weights: dict[str, float] = {}


class Hello(msgspec.Struct, tag=True):
    """Server -> orchestrator once the env is loaded: what the orchestrator needs to schedule it."""

    name: str
    max_turns: int
    tools: list[dict[str, Any]] | None
    group_scored: bool  # the env scores a whole group (runs rollout_group itself)
    shares_first_turn: bool  # single chat call per rollout: a group's calls can be one n-choice request
    tasks: dict[str, list[WTask]]  # split -> tasks (the env's own seed)
    task_errors: dict[str, str]  # split -> why it has no tasks
    pid: int
    workers: list[int]  # worker pids


class LoadFailed(msgspec.Struct, tag=True):
    """Server -> orchestrator: the env could not be loaded (a user error, one line)."""

    error: str


class Run(msgspec.Struct, tag=True):
    """Run `n` rollouts of `task` (group=True: one rollout_group call, else n=1 rollout)."""

    rid: int
    task: WTask
    sampling: dict[str, Any]
    n: int
    group: bool
    system_prompt: str | None = None  # GEPA's candidate prompt (None: the env's own)


class Chat(msgspec.Struct, tag=True):
    rid: int
    seq: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]


class ChatReply(msgspec.Struct, tag=True):
    rid: int
    seq: int
    turn: WTurn | None = None
    error: str | None = None  # the request failed: the env sees an exception


class Done(msgspec.Struct, tag=True):
    rid: int
    trajectories: list[WTrajectory] = []
    error: str | None = None


class Stop(msgspec.Struct, tag=True):
    """Orchestrator -> server, server -> worker: exit now."""


class Ready(msgspec.Struct, tag=True):
    """Worker -> server: the env is loaded; route rollouts here."""

    pid: int


class WorkerDied(msgspec.Struct, tag=True):
    """Server -> orchestrator: a worker exited or was killed; its rollouts are errored with `why`."""

    ident: str
    why: str


class Kill(msgspec.Struct, tag=True):
    """Orchestrator -> server: a rollout of this worker overran rollout_timeout_s in env code."""

    ident: str
    why: str


class Ping(msgspec.Struct, tag=True):
    """Orchestrator -> server: are you running? (a stopped or hung server never answers)"""

    seq: int


class Pong(msgspec.Struct, tag=True):
    """Server -> orchestrator: the answer to Ping `seq`; `lost`: log lines the server dropped since
    its last Pong (its log's disk full or over quota: `N log line(s) lost: <why>`), else ""."""

    seq: int
    lost: str = ""


class ServerSpec(msgspec.Struct, kw_only=True):
    """What an env server (and each of its workers) is started with: JSON on its command line."""

    env_id: str
    args: dict[str, Any]
    name: str
    kind: str  # train | eval
    workers: int
    rollout_timeout_s: float
    connect: str  # the orchestrator's socket (tcp://host:port): the server and every worker connect
    log_dir: str  # logs/envs/<kind>/<name>/
    restarts: int = 0  # how often the orchestrator restarted this server before
    status_file: str = ""  # components.json of this server (written by the server)
    run_dir: str = ""  # the training run it serves: it records itself in logs/placement.jsonl
    index: int = 0  # its place in orchestrator.{train,eval}.env (its placement rank)
    # A worker stopped (SIGSTOP, a debugger) this long is killed and replaced like a dead one; the
    # orchestrator does the same to a server that answers no Ping this long. 0: never.
    frozen_s: float = 0.0


Msg = Hello | LoadFailed | Run | Chat | ChatReply | Done | Stop | Ready | WorkerDied | Kill | Ping | Pong

_ENCODER = msgspec.msgpack.Encoder(enc_hook=repr)  # non-msgpack values in env state travel as text
_DECODER = msgspec.msgpack.Decoder(list[Msg])


def encode(*msgs: Msg) -> bytes:
    """One frame holding `msgs`, in order."""
    return _ENCODER.encode(msgs)


def decode(data: bytes) -> list[Msg]:
    return _DECODER.decode(data)


# -- conversions --------------------------------------------------------------------------------
def to_wtask(t: Task) -> WTask:
    return WTask(t.example_id, t.prompt, t.answer, t.info)


def from_wtask(t: WTask) -> Task:
    return Task(example_id=t.example_id, prompt=t.prompt, answer=t.answer, info=t.info)


def to_wturn(t: Turn) -> WTurn:
    return WTurn(
        t.text,
        list(t.prompt_token_ids),
        list(t.completion_token_ids),
        [float(x) for x in t.completion_logprobs],
        list(t.policy_steps),
        t.finish_reason,
        t.tool_calls,
        t.reasoning,
        t.rerendered,
        t.routed_experts,
        t.trace,
        t.prompt_routed_experts,
        t.env_roles,
        t.images,
    )


def from_wturn(t: WTurn) -> Turn:
    return Turn(*msgspec.structs.astuple(t))  # WTurn lists Turn's fields in Turn's order


def _plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """Env scratch state that msgpack can carry (round-tripped so a bad value fails here, not later)."""
    try:
        return msgspec.msgpack.decode(_ENCODER.encode(state))
    except (TypeError, msgspec.ValidationError, msgspec.EncodeError):
        return {k: repr(v) for k, v in state.items()}


def to_wtraj(t: Trajectory) -> WTrajectory:
    return WTrajectory(
        t.messages,
        t.num_prompt_messages,
        [to_wturn(x) for x in t.turns],
        float(t.reward),
        {k: float(v) for k, v in t.metrics.items()},
        _plain_state(t.state),
        bool(t.truncated),
        t.error,
        None if t.trace_rewards is None else [float(r) for r in t.trace_rewards],
        {k: float(v) for k, v in t.reward_weights.items()},
    )


def from_wtraj(task: Task, t: WTrajectory) -> Trajectory:
    return Trajectory(
        task=task,
        messages=t.messages,
        num_prompt_messages=t.num_prompt_messages,
        turns=[from_wturn(x) for x in t.turns],
        reward=t.reward,
        metrics=t.metrics,
        state=t.state,
        truncated=t.truncated,
        error=t.error,
        trace_rewards=t.trace_rewards,
        reward_weights=t.reward_weights,
    )
