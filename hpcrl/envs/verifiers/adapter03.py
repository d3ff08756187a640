"""Run environments written for verifiers' classic API (0.3.x: `load_environment()` ->
`vf.Environment`, SingleTurnEnv / MultiTurnEnv / ToolEnv, Rubric) unchanged.

verifiers drives its own rollout loop through a `vf.Client`; we hand it a bridge client that sends
each request through our `ChatClient` (token ids, logprobs and policy versions included), then read
the per-turn tokens back from `state["trajectory"]`. verifiers is imported lazily: nothing here
costs anything unless a verifiers environment is actually loaded.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.envs.base import ChatClient, Environment, Message, Task, Trajectory, Turn, normalize_split

_EXTRA_KEY = "_vf_extra"  # dataset columns beyond prompt/answer/info/example_id, kept for the rollout input
_INSTALL_HINT = "install the extra: pip install 'hpcrl[verifiers03]' (verifiers>=0.3.1,<0.4)"


def _vf() -> Any:
    try:
        import verifiers
    except ImportError as e:
        raise ValueError(f"this environment needs verifiers; {_INSTALL_HINT}") from e
    version = getattr(verifiers, "__version__", "0")
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor >= (0, 4):
        raise ValueError(f"verifiers {version} replaced the classic Environment API; {_INSTALL_HINT}")
    return verifiers


def is_verifiers_env(obj: Any) -> bool:
    """True for a verifiers Environment, decided without importing verifiers."""
    return any(
        c.__name__ == "Environment" and c.__module__.startswith("verifiers.") for c in type(obj).__mro__
    )


def wrap_verifiers_env(vf_env: Any, name: str) -> VerifiersEnvironment:
    try:
        _vf()
    except ValueError:
        from hpcrl.envs.verifiers.versions import installed, needs

        raise ValueError(needs(name, "0.3", installed())) from None
    return VerifiersEnvironment(vf_env, name=name)


def _plain(obj: Any) -> Any:
    """pydantic / TypedDict messages -> plain JSON-able dicts without None fields."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


@functools.cache
def _bridge_class() -> type:
    """A vf.Client that answers through our ChatClient. Built on first use (lazy import); it
    reuses verifiers' own message/tool conversion so every vf environment sees what it expects."""
    _vf()
    from verifiers.clients import OpenAIChatCompletionsClient
    from verifiers.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage

    class ChatClientBridge(OpenAIChatCompletionsClient):
        def __init__(self, chat_client: ChatClient, defaults: Mapping[str, Any]) -> None:
            super().__init__(chat_client)
            self.defaults = dict(defaults)

        def setup_client(self, config: Any) -> Any:  # only reached with a ClientConfig
            raise TypeError("ChatClientBridge wraps an hpcrl ChatClient, not a ClientConfig")

        async def close(self) -> None:
            return None

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs) -> Turn:
            sampling = {**self.defaults, **dict(sampling_args or {})}
            sampling.update(sampling.pop("extra_body", None) or {})
            sampling.pop("n", None)  # one completion per request; groups are separate rollouts
            return await self.client.chat(_plain(list(prompt)), _plain(tools) if tools else None, sampling)

        async def raise_from_native_response(self, response: Turn) -> None:
            # An empty reply is a legitimate (bad) RL sample with tokens to train on, not an error.
            return None

        async def from_native_response(self, turn: Turn) -> Any:
            finish = turn.finish_reason if turn.finish_reason in ("stop", "length", "tool_calls") else None
            calls = [
                ToolCall(
                    id=tc.get("id") or f"call_{i}",
                    name=tc["function"]["name"],
                    arguments=tc["function"].get("arguments") or "{}",
                )
                for i, tc in enumerate(turn.tool_calls or [])
            ]
            n_prompt, n_completion = len(turn.prompt_token_ids), len(turn.completion_token_ids)
            return Response(
                id="",
                created=0,
                model="",
                usage=Usage(
                    prompt_tokens=n_prompt,
                    reasoning_tokens=0,
                    completion_tokens=n_completion,
                    total_tokens=n_prompt + n_completion,
                ),
                message=ResponseMessage(
                    content=turn.text,
                    finish_reason=finish,
                    is_truncated=turn.finish_reason == "length",
                    tool_calls=calls or None,
                    tokens=ResponseTokens(
                        prompt_ids=list(turn.prompt_token_ids),
                        prompt_mask=[0] * n_prompt,
                        completion_ids=list(turn.completion_token_ids),
                        completion_mask=[1] * n_completion,
                        completion_logprobs=list(turn.completion_logprobs),
                    ),
                ),
                policy_steps=list(turn.policy_steps),  # Response allows extras; read back per step
            )

    return ChatClientBridge


class VerifiersEnvironment(Environment):
    """Our Environment protocol over a verifiers environment (rollout-level API, not the step API:
    verifiers owns its loop). `rollout_group` uses the verifiers rubric's group scoring so group
    reward functions work."""

    def __init__(self, vf_env: Any, name: str, model: str = "policy") -> None:
        super().__init__()
        self.vf_env = vf_env
        self.name = name
        self.model = model  # verifiers requires a model name; our ChatClient ignores it
        max_turns = getattr(vf_env, "max_turns", 1)
        self.max_turns = max_turns if isinstance(max_turns, int) and max_turns > 0 else 1
        tool_defs = getattr(vf_env, "tool_defs", None) or []
        self.tools = [
            {
                "type": "function",
                "function": _plain(
                    {"name": t.name, "description": t.description, "parameters": t.parameters}
                ),
            }
            for t in tool_defs
        ] or None
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str = "train", seed: int | None = None) -> Sequence[Task]:
        """Dataset rows in their stored order (`seed` is unused: samplers shuffle). val falls back
        to the eval dataset, which falls back to train (as verifiers does)."""
        split = normalize_split(split)
        if split not in self._tasks:
            ds = self.vf_env.get_dataset() if split == "train" else self.vf_env.get_eval_dataset()
            self._tasks[split] = [self._row_to_task(i, row) for i, row in enumerate(ds)]
        return self._tasks[split]

    @staticmethod
    def _row_to_task(index: int, row: Mapping[str, Any]) -> Task:
        info = row.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info) if info else {}
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "info", "example_id")}
        if extra:
            info = {**info, _EXTRA_KEY: extra}
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        example_id = row.get("example_id")
        return Task(
            example_id=int(example_id) if isinstance(example_id, int) else index,
            prompt=_plain(prompt),
            answer=str(row.get("answer") or ""),
            info=dict(info),
        )

    def reward_weights(self) -> dict[str, float]:
        """The verifiers rubric's functions and weights (a RubricGroup lists its members' together)."""
        rubric = self.vf_env.rubric
        try:
            names, weights = rubric.get_reward_func_names(), rubric.get_reward_weights()
        except Exception:  # noqa: BLE001 - an unusual rubric: its scores are saved without weights
            return {}
        return {str(n): float(w) for n, w in zip(names, weights)}

    def _rollout_input(self, task: Task) -> dict[str, Any]:
        info = dict(task.info)
        extra = info.pop(_EXTRA_KEY, {})
        return {
            **extra,
            "prompt": self.initial_messages(task),  # the system prompt override applies here too
            "example_id": task.example_id,
            "answer": task.answer,
            "info": info,
        }

    async def _run(self, task: Task, client: ChatClient, sampling: Mapping[str, Any]) -> Any:
        defaults = {k: v for k, v in (getattr(self.vf_env, "sampling_args", None) or {}).items() if k != "n"}
        bridge = _bridge_class()(client, defaults)
        return await self.vf_env.rollout(self._rollout_input(task), bridge, self.model, dict(sampling))

    async def rollout_group(
        self, task: Task, client: ChatClient, sampling: Mapping[str, Any], n: int
    ) -> list[Trajectory]:
        states = list(await asyncio.gather(*(self._run(task, client, sampling) for _ in range(n))))
        rubric = self.vf_env.rubric
        if getattr(self.vf_env, "score_rollouts", True):
            await rubric.score_group(states)
        else:
            await rubric.dummy_score_group(states)
        for state in states:
            await rubric.cleanup(state)
        return [self._to_trajectory(task, s) for s in states]

    async def rollout(self, task: Task, client: ChatClient, sampling: Mapping[str, Any]) -> Trajectory:
        return (await self.rollout_group(task, client, sampling, 1))[0]

    def _to_trajectory(self, task: Task, state: Any) -> Trajectory:
        turns: list[Turn] = []
        for step in state["trajectory"]:
            tokens = step.get("tokens")
            if tokens is None:
                raise ValueError(
                    f"environment {self.name!r}: a turn came back without token ids; the inference "
                    "server must honour logprobs + return_token_ids"
                )
            response = step["response"]
            n = len(tokens["completion_ids"])
            steps = list(getattr(response, "policy_steps", None) or [])
            if len(steps) > n:  # verifiers truncated the completion to max_seq_len
                steps = steps[:n]
            msg = response.message
            turns.append(
                Turn(
                    text=msg.content if isinstance(msg.content, str) else "",
                    prompt_token_ids=list(tokens["prompt_ids"]),
                    completion_token_ids=list(tokens["completion_ids"]),
                    completion_logprobs=list(tokens["completion_logprobs"]),
                    policy_steps=steps,
                    finish_reason=msg.finish_reason or "stop",
                    tool_calls=[
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {"name": tc.name, "arguments": tc.arguments},
                        }
                        for tc in (msg.tool_calls or [])
                    ]
                    or None,
                )
            )
        prompt: list[Message] = _plain(list(state.get("prompt") or []))
        completion: list[Message] = _plain(list(state.get("completion") or []))
        error = state.get("error")
        return Trajectory(
            task=task,
            messages=prompt + completion,
            num_prompt_messages=len(prompt),
            turns=turns,
            reward=float(state.get("reward") or 0.0),
            metrics={k: float(v) for k, v in (state.get("metrics") or {}).items()},
            state={"stop_condition": state.get("stop_condition")},
            truncated=bool(state.get("is_truncated")),
            error=None if error is None else repr(error),
        )
