"""The environment protocol: tasks, a step API for (multi-turn) interaction, and weighted rubrics.

An environment never talks to the inference server itself in the preferred (step) style; the
orchestrator's rollout driver owns the loop so that it can stitch token ids exactly, track which
policy produced every token and cancel/retry turns. One rollout, as the driver runs it::

    state = env.initial_state(task)
    messages = env.initial_messages(task)          # the prompt (a fresh copy)
    for _ in range(env.max_turns):
        turn = await client.chat(messages, env.tools, sampling)
        messages.append(turn.message())             # assistant message, tool_calls included
        if turn.finish_reason == "length":          # truncated: no env response, scored as is
            break
        new_messages, done = await env.env_response(task, messages, state)
        messages.extend(new_messages)               # user / tool messages (masked out of the loss)
        if done:
            break
    reward, metrics = await env.score(task, messages[len(task.prompt):], state)

`Environment.rollout` is exactly that loop (a reference driver, used by tests and eval), and an
environment may override `rollout` entirely (the verifiers adapter does) as long as it returns a
`Trajectory` with every `Turn`'s token ids and logprobs.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

Message = dict[str, Any]
"""One OpenAI chat message: {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}."""

Split = Literal["train", "eval", "val"]
SPLITS: tuple[str, ...] = ("train", "eval", "val")
# Hosted configs say split="test"/"validation"; they mean our eval/val splits.
_SPLIT_ALIASES = {"test": "eval", "validation": "val", "dev": "val"}


def with_system_prompt(messages: Sequence[Message], system_prompt: str | None) -> list[Message]:
    """A copy of `messages` whose system message is `system_prompt`: the first system message is
    replaced (or one is put in front); "" removes it; None keeps the messages as they are."""
    out = copy.deepcopy(list(messages))
    if system_prompt is None:
        return out
    rest = out[1:] if out and out[0].get("role") == "system" else out
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + rest


def normalize_split(split: str) -> str:
    s = _SPLIT_ALIASES.get(split, split)
    if s not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)} (or test, validation)")
    return s


@dataclass(frozen=True)
class Task:
    """One prompt. `example_id` is unique and stable per (environment, split) so that samplers,
    checkpoints and logs can name it."""

    example_id: int
    prompt: list[Message]
    answer: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One assistant turn as the inference client returns it.

    `policy_steps` holds the policy version that produced each completion token (one entry per
    token), or a single entry when the whole turn came from one policy; the staleness bound uses
    the oldest one.
    """

    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    policy_steps: list[int]
    finish_reason: str = "stop"
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI format: {"id", "type", "function": {...}}
    reasoning: str | None = None  # the completion's reasoning, as the renderer parsed it
    # A later turn whose prompt could not extend the previous turn's ids (the renderer's bridge or
    # hpcrl's stitching declined): it was re-rendered and starts a new training sample.
    rerendered: bool = False
    # MoE router replay: experts the server routed each completion token to, [tokens][layers][k]
    routed_experts: list[list[list[int]]] | None = None
    # Multi-agent episodes: which trained trace (agent) of the rollout this turn belongs to; each
    # trace is its own sample, scored with Trajectory.trace_rewards[trace].
    trace: int = 0
    # ... and each prompt token to (the prefill; hpcrl's engine), [prompt tokens][layers][k]
    prompt_routed_experts: list[list[list[int]]] | None = None
    # The message role of each env-provided token this turn's prompt adds after the previous turn's
    # completion (aligned with the END of prompt_token_ids; hpcrl.orchestrator.env_roles.ROLES, 0 =
    # scaffold); None: not attributed (a first turn, a re-rendered one). Read by echo only.
    env_roles: bytes | None = None
    # The images of the prompt, in order (OpenAI image_url URLs): a vision-language model's sample
    # carries them to the trainer (hpcrl.orchestrator.images)
    images: list[str] | None = None

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": self.text}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = copy.deepcopy(self.tool_calls)
        return msg

    @property
    def oldest_policy_step(self) -> int:
        return min(self.policy_steps) if self.policy_steps else 0


@runtime_checkable
class ChatClient(Protocol):
    """What an environment needs from inference: one chat completion with token ids + logprobs.

    `sampling` carries OpenAI sampling fields (temperature, top_p, max_tokens, ...).
    """

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn: ...


RewardFn = Callable[[Task, list[Message], dict[str, Any]], float]
"""fn(task, completion_messages, state) -> float; completion = everything after the prompt."""


class Rubric:
    """Weighted reward functions: reward = sum(w_i * f_i). Every f_i is also reported as a metric
    under its function name (weight 0 makes a pure metric)."""

    def __init__(self, funcs: Sequence[tuple[RewardFn, float]] = ()) -> None:
        self.funcs: list[tuple[str, RewardFn, float]] = []
        for fn, weight in funcs:
            self.add(fn, weight)

    def add(self, fn: RewardFn, weight: float = 1.0, name: str | None = None) -> None:
        name = name or str(getattr(fn, "__name__", f"fn{len(self.funcs)}"))
        if any(n == name for n, _, _ in self.funcs):
            raise ValueError(f"rubric already has a reward function named {name!r}")
        self.funcs.append((name, fn, float(weight)))

    def score(
        self, task: Task, completion: list[Message], state: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        reward = 0.0
        metrics: dict[str, float] = {}
        for name, fn, weight in self.funcs:
            value = float(fn(task, completion, state))
            if not math.isfinite(value):
                # A NaN reward would poison the whole group's advantages; fail loudly instead.
                raise ValueError(f"reward function {name!r} returned {value} for example {task.example_id}")
            metrics[name] = value
            reward += weight * value
        return reward, metrics


@dataclass
class Trajectory:
    """A finished rollout: the conversation, every model turn (with token ids/logprobs), the score."""

    task: Task
    messages: list[Message]
    num_prompt_messages: int
    turns: list[Turn]
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    error: str | None = None
    # One reward per trained trace (multi-agent); None: every turn takes `reward`. A trace's samples
    # get advantages against the same trace of the group's other rollouts.
    trace_rewards: list[float] | None = None
    # The weight the env gave each reward function of `metrics` (reward = sum of weight x score for a
    # weighted rubric); {}: unknown. Saved rollouts and the reward/<env>/<function> metrics use it.
    reward_weights: dict[str, float] = field(default_factory=dict)

    @property
    def completion(self) -> list[Message]:
        return self.messages[self.num_prompt_messages :]

    @property
    def oldest_policy_step(self) -> int:
        return min((t.oldest_policy_step for t in self.turns), default=0)


class Environment:
    """Base class. Subclasses set `name`, `rubric`, `max_turns`, `tools` and implement `tasks`;
    multi-turn ones override `env_response` (and usually `initial_state`)."""

    name: str = "env"
    max_turns: int = 1
    tools: list[dict[str, Any]] | None = None  # OpenAI function-calling format
    # Replaces every task's system message (the `system_prompt` argument of environments whose
    # factory has none, and GEPA candidates); None keeps the task's own.
    system_prompt_override: str | None = None

    def __init__(self, rubric: Rubric | None = None) -> None:
        self.rubric = rubric or Rubric()

    @property
    def group_scored(self) -> bool:
        """The env runs (and scores) a whole group itself: rollout_group is overridden."""
        return type(self).rollout_group is not Environment.rollout_group

    @property
    def shares_first_turn(self) -> bool:
        """Every rollout makes exactly one chat call (the reference driver, one turn, no tools), so a
        group's n calls can be one request with n choices."""
        return self.max_turns <= 1 and not self.tools and type(self).rollout is Environment.rollout

    # -- data -------------------------------------------------------------------------------
    def tasks(self, split: str = "train", seed: int | None = None) -> Sequence[Task]:
        """All tasks of a split, in a fixed order (samplers shuffle). Deterministic in `seed`
        (None = the environment's own seed), generated locally."""
        raise NotImplementedError

    # -- interaction ------------------------------------------------------------------------
    def initial_state(self, task: Task) -> dict[str, Any]:
        """Per-rollout mutable scratch space handed to env_response and the rubric."""
        return {}

    def initial_messages(self, task: Task) -> list[Message]:
        return with_system_prompt(task.prompt, self.system_prompt_override)

    async def env_response(
        self, task: Task, messages: list[Message], state: dict[str, Any]
    ) -> tuple[list[Message], bool]:
        """Called after each assistant turn (messages ends with it). Returns the messages to
        append (user/tool) and whether the rollout is done. Single-turn: nothing, done."""
        return [], True

    async def score(
        self, task: Task, completion: list[Message], state: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return self.rubric.score(task, completion, state)

    def reward_weights(self) -> dict[str, float]:
        """Each reward function's weight, as `score` applies it (weight 0: a pure metric)."""
        return {name: weight for name, _, weight in self.rubric.funcs}

    def with_weights(self, traj: Trajectory) -> Trajectory:
        """`traj` with the env's reward weights, unless it carries its own."""
        if not traj.reward_weights:
            traj.reward_weights = self.reward_weights()
        return traj

    async def rollout(self, task: Task, client: ChatClient, sampling: Mapping[str, Any]) -> Trajectory:
        """Reference driver for the step API (see the module docstring)."""
        state = self.initial_state(task)
        messages = self.initial_messages(task)
        num_prompt = len(messages)
        turns: list[Turn] = []
        truncated = False
        for _ in range(max(1, self.max_turns)):
            turn = await client.chat(messages, self.tools, sampling)
            turns.append(turn)
            messages.append(turn.message())
            if turn.finish_reason == "length":
                truncated = True
                break
            new_messages, done = await self.env_response(task, messages, state)
            messages.extend(new_messages)
            if done:
                break
        reward, metrics = await self.score(task, messages[num_prompt:], state)
        metrics.setdefault("num_turns", float(len(turns)))
        return Trajectory(task, messages, num_prompt, turns, reward, metrics, state, truncated)

    async def rollout_group(
        self, task: Task, client: ChatClient, sampling: Mapping[str, Any], n: int
    ) -> list[Trajectory]:
        """`n` rollouts of one task. Environments whose rewards compare rollouts (verifiers group
        reward functions) override this; everything else scores each rollout on its own."""
        return list(await asyncio.gather(*(self.rollout(task, client, sampling) for _ in range(n))))


@dataclass
class StitchedTokens:
    """One multi-turn rollout as a single training sequence."""

    input_ids: np.ndarray  # int32[T]
    loss_mask: np.ndarray  # bool[T]: True on tokens the model sampled
    logprobs: np.ndarray  # float32[T]: sampling logprobs, 0 where masked
    policy_steps: np.ndarray  # int32[T]: policy that sampled the token, -1 where masked
    prompt_len: int


def stitch_turns(turns: Sequence[Turn]) -> StitchedTokens | None:
    """Concatenate turns into one sequence when every turn's prompt ids extend the previous turn's
    prompt + completion ids (the chat template re-renders history identically). Returns None when
    that prefix property fails, so the driver can fall back to one sample per turn rather than
    train on tokens the policy never saw."""
    if not turns:
        return None
    ids: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    steps: list[int] = []
    for turn in turns:
        prompt = turn.prompt_token_ids
        if prompt[: len(ids)] != ids:
            return None
        env_part = prompt[len(ids) :]
        ids += env_part
        mask += [False] * len(env_part)
        lps += [0.0] * len(env_part)
        steps += [-1] * len(env_part)
        n = len(turn.completion_token_ids)
        if len(turn.completion_logprobs) != n:
            raise ValueError(f"turn has {n} completion tokens but {len(turn.completion_logprobs)} logprobs")
        ps = turn.policy_steps if len(turn.policy_steps) == n else [turn.oldest_policy_step] * n
        ids += turn.completion_token_ids
        mask += [True] * n
        lps += turn.completion_logprobs
        steps += ps
    return StitchedTokens(
        input_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=bool),
        logprobs=np.asarray(lps, dtype=np.float32),
        policy_steps=np.asarray(steps, dtype=np.int32),
        prompt_len=len(turns[0].prompt_token_ids),
    )
