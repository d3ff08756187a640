"""The multi-turn ChatClient of renderer-driven rollouts (orchestrator.renderer other than default).

Turn 1's prompt is `renderer.render(messages, tools, add_generation_prompt=True)`. Every later turn's
prompt is `renderer.bridge_to_next_turn(prev_prompt, prev_completion, new_messages)`: the sampled ids
extended byte for byte with the env's messages and the next generation prompt, never a re-rendering
of history (Qwen3's template strips earlier <think> blocks, so a re-render is not a prefix of what
was sampled). When the bridge declines (a new user query under thinking_retention "tool_cycle", an
env that rewrote history, a turn cut off mid-reasoning by a stop), the turn is rendered in full and
marked `rerendered`: it starts a new training sample and counts as a bridge break.

Sampling goes through POST /inference/v1/generate (token ids in, token ids and logprobs out), with
the renderer's stop tokens. Reasoning and tool calls are parsed from the completion ids by the
renderer (`parse_response`), never by a regex on text.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from hpcrl.envs.base import Message, Turn
from hpcrl.inference.routed import completion_rows, prompt_rows
from hpcrl.orchestrator.chat import ConversationClient
from hpcrl.orchestrator.env_roles import bridge_env_roles
from hpcrl.orchestrator.pool import RequestFailed, ServerPool
from hpcrl.render.select import Renderers

# OpenAI request fields of orchestrator sampling that /inference/v1/generate takes under the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")


def generate_sampling(
    sampling: Mapping[str, Any], max_tokens: int, stop_token_ids: list[int]
) -> dict[str, Any]:
    """Orchestrator sampling (OpenAI names) -> vLLM sampling_params for /inference/v1/generate."""
    sp = {k: sampling[k] for k in SAMPLING_KEYS if sampling.get(k) is not None}
    sp.update(
        max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), logprobs=0, skip_special_tokens=False
    )
    return sp


def completion_logprobs(choice: Mapping[str, Any], token_ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs, in vLLM 0.33's tokens shape (`token_id`) or the chat shape
    (`token: "token_id:N"`); a response whose tokens do not line up is refused."""
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(token_ids):
        raise RequestFailed(
            f"/inference/v1/generate returned {len(token_ids)} tokens but {len(content)} logprobs"
        )
    out = []
    for tid, entry in zip(token_ids, content):
        got = entry.get("token_id")
        if got is None and isinstance(entry.get("token"), str) and entry["token"].startswith("token_id:"):
            got = int(entry["token"].removeprefix("token_id:"))
        if got != tid:
            raise RequestFailed(f"/inference/v1/generate: logprob entry for token {got}, expected {tid}")
        out.append(float(entry["logprob"]))
    return out


def tool_calls_of(parsed: Any) -> list[dict[str, Any]] | None:
    """The renderer's well-formed tool calls in OpenAI's shape (malformed attempts stay text)."""
    import json

    from renderers import ToolCallParseStatus

    calls = [
        {
            "id": tc.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": tc.name,
                "arguments": tc.arguments
                if isinstance(tc.arguments, str)
                else json.dumps(tc.arguments or {}),
            },
        }
        for tc in parsed.tool_calls
        if tc.status == ToolCallParseStatus.OK and tc.name
    ]
    return calls or None


class RendererClient(ConversationClient):
    """One conversation's ChatClient: renders, bridges, samples token-in/token-out, parses."""

    def __init__(
        self,
        pool: ServerPool,
        renderers: Renderers,
        seq_len: int,
        seed: int | None,
        default_policy: Callable[[], int],
    ):
        super().__init__(pool, seq_len, seed, default_policy)
        self.renderers = renderers

    def prompt(
        self, renderer: Any, messages: list[Message], tools: list[dict] | None
    ) -> tuple[list[int], bool, bytes | None]:
        """(prompt ids, whether they had to be re-rendered although a previous turn exists, the role
        of each env-provided token a bridge added: hpcrl.orchestrator.env_roles)."""
        if self.continues(messages):
            prev, history = self.prev, self.history
            assert prev is not None and history is not None
            new_messages = messages[len(history) :]
            bridged = renderer.bridge_to_next_turn(
                prev.prompt_token_ids, prev.completion_token_ids, new_messages, tools=tools
            )
            if bridged is not None:
                prior = len(prev.prompt_token_ids) + len(prev.completion_token_ids)
                roles = bridge_env_roles(bridged, prior, new_messages) if self.env_roles else None
                return list(bridged.token_ids), False, roles
        ids = list(renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids)
        return ids, self.prev is not None, None

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        renderer = self.renderers.get(sampling.get("chat_template_kwargs"))
        ids, rerendered, roles = self.prompt(renderer, messages, tools)
        body = self.request_body(sampling, len(ids))
        if body is None:  # the conversation filled seq_len: a truncated rollout, not an error
            turn = Turn("", ids, [], [], [], finish_reason="length", rerendered=rerendered)
        else:
            sp = generate_sampling(body, body["max_tokens"], renderer.get_stop_token_ids())
            resp = await self.pool.call(
                self.server, "generate", ids, model=self.pool.request_model, sampling_params=sp
            )
            turn = self.to_turn(renderer, resp, ids, tools, rerendered)
        turn.env_roles = roles
        return self.record(messages, turn)

    async def chat_group(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any], n: int
    ) -> list[Turn]:
        """`n` samples of a first turn in one request with `n` choices (choice i draws from seed + i)."""
        assert self.turn == 0, "a group request is a conversation's first turn"
        renderer = self.renderers.get(sampling.get("chat_template_kwargs"))
        ids = list(renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids)
        body = self.request_body(sampling, len(ids))
        if body is None:
            return [Turn("", ids, [], [], [], finish_reason="length") for _ in range(n)]
        sp = generate_sampling(body, body["max_tokens"], renderer.get_stop_token_ids())
        resp = await self.pool.call(
            self.server, "generate", ids, model=self.pool.request_model, sampling_params={**sp, "n": n}
        )
        return [
            self.to_turn(renderer, {**resp, "choices": [c]}, ids, tools, False) for c in self.choices(resp, n)
        ]

    def to_turn(
        self,
        renderer: Any,
        resp: Mapping[str, Any],
        ids: list[int],
        tools: list[dict] | None,
        rerendered: bool,
    ) -> Turn:
        choice = (resp.get("choices") or [{}])[0]
        out = [int(t) for t in choice.get("token_ids") or []]
        prompt = resp.get("prompt_token_ids")
        if prompt is not None and list(prompt) != ids:
            raise RequestFailed("/inference/v1/generate answered for another prompt than the one sent")
        parsed = renderer.parse_response(out, prompt_ids=ids, tools=tools)
        return Turn(
            text=parsed.content or "",
            prompt_token_ids=ids,
            completion_token_ids=out,
            completion_logprobs=completion_logprobs(choice, out),
            policy_steps=self.steps(choice, resp),
            finish_reason=choice.get("finish_reason") or "stop",
            tool_calls=tool_calls_of(parsed),
            reasoning=parsed.reasoning_content,
            rerendered=rerendered,
            routed_experts=completion_rows(choice.get("routed_experts"), len(ids), len(out)),
            prompt_routed_experts=prompt_rows(choice, len(ids)),
        )
