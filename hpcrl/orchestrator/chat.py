"""The ChatClients environments talk to: request fields (sampling, per-request seeds), one conversation's
client that extends the previous turn's token ids exactly (hpcrl.orchestrator.stitching), and the
client a group-run environment shares among its rollouts."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from hpcrl.envs.base import Message, Turn
from hpcrl.inference.routed import completion_rows, prompt_rows
from hpcrl.models.vision_inputs import image_refs
from hpcrl.orchestrator.env_roles import template_env_ids
from hpcrl.orchestrator.pool import RequestFailed, ServerPool
from hpcrl.orchestrator.stitching import encode, env_response_text, render, stitch_prompt, template_kwargs

log = logging.getLogger("hpcrl.orchestrator")


def derive_seed(*key: object) -> int:
    """A stable 31-bit request seed from a key (same on every machine and Python version)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def openai_sampling(sampling: Any) -> dict[str, Any]:
    """SamplingConfig -> request fields (only those that differ from the API defaults), then its
    extra_body (checked at load: hpcrl.config.prime_names.check_extra_body)."""
    extra = dict(sampling.extra_body)
    out: dict[str, Any] = {**extra, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature}
    if sampling.top_p < 1:
        out["top_p"] = sampling.top_p
    if sampling.top_k > 0:
        out["top_k"] = sampling.top_k
    if sampling.min_p > 0:
        out["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1:
        out["repetition_penalty"] = sampling.repetition_penalty
    kwargs = dict(extra.pop("chat_template_kwargs", None) or {})
    out.pop("chat_template_kwargs", None)
    if sampling.enable_thinking is not None:
        kwargs["enable_thinking"] = sampling.enable_thinking
    if sampling.reasoning_effort is not None:
        kwargs["reasoning_effort"] = sampling.reasoning_effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


class ConversationClient:
    """The one base of every conversation's ChatClient (hpcrl.envs.ChatClient) that samples from the
    run's inference servers: the server it sticks to, the previous turn it extends, per-turn request
    seeds, the room left in seq_len, and the n-choice check of a group request. Subclasses say how a
    prompt is made and sampled: `RolloutClient` (the chat template, OpenAI routes, exact stitching),
    `hpcrl.orchestrator.renderer_client.RendererClient` (a renderer, token-in/token-out)."""

    def __init__(self, pool: ServerPool, seq_len: int, seed: int | None, default_policy: Callable[[], int]):
        self.pool, self.seq_len = pool, seq_len
        self.seed, self.default_policy = seed, default_policy
        self.server = pool.pick()
        self.history: list[Message] | None = None
        self.prev: Turn | None = None
        self.turn = 0
        self.env_roles = False  # record each env-provided token's message role (echo): Turn.env_roles
        self.images: Any = None  # [model.vlm]: hpcrl.orchestrator.images.SampleImages (prompt lengths)

    def continues(self, messages: list[Message]) -> bool:
        """Whether `messages` extend this conversation's previous turn."""
        return (
            self.prev is not None
            and self.history is not None
            and messages[: len(self.history)] == self.history
        )

    async def image_tokens(self, messages: list[Message]) -> int:
        """Tokens the server adds to the template's rendering when it expands each image's one
        placeholder token to the image's merged patches (0 for a text conversation). The image
        processor runs in a worker thread: never on the event loop."""
        refs = image_refs(messages)
        if not refs or self.images is None:
            return 0
        return await asyncio.to_thread(self.images.extra_tokens, refs)

    def request_body(self, sampling: Mapping[str, Any], prompt_len: int) -> dict[str, Any] | None:
        """The request's sampling fields with this turn's seed and max_tokens capped to the room left
        in seq_len; None when the prompt already fills it (a truncated rollout, not an error)."""
        room = self.seq_len - prompt_len
        if room <= 0:
            return None
        body = dict(sampling)
        if self.seed is not None:
            body["seed"] = derive_seed(self.seed, self.turn)
        body["max_tokens"] = min(int(body.get("max_tokens") or room), room)
        return body

    def record(self, messages: list[Message], turn: Turn) -> Turn:
        """Remember the turn: the next one extends it."""
        self.history = copy.deepcopy([*messages, turn.message()])
        self.prev = turn
        self.turn += 1
        return turn

    @staticmethod
    def choices(resp: Mapping[str, Any], n: int) -> list[Any]:
        choices = resp.get("choices") or []
        if len(choices) != n:
            raise RequestFailed(f"asked for {n} choices, the server returned {len(choices)}")
        return choices

    def steps(self, choice: Mapping[str, Any], resp: Mapping[str, Any]) -> list[int]:
        # Our server reports the policies that produced the choice; vLLM does not: then we assume
        # the policy loaded when the request was sent.
        steps = choice.get("policy_steps") or resp.get("policy_steps")
        return [int(s) for s in steps] if steps else [self.default_policy()]


class RolloutClient(ConversationClient):
    """One conversation's ChatClient through the chat template: remembers the previous turn's ids so
    the next turn's prompt extends them exactly."""

    def __init__(
        self,
        pool: ServerPool,
        tokenizer: Any,
        seq_len: int,
        seed: int | None,
        default_policy: Callable[[], int],
    ):
        super().__init__(pool, seq_len, seed, default_policy)
        self.tokenizer = tokenizer

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        kw = template_kwargs(sampling)
        ids = None
        roles = None
        # images go with the messages (the server expands their tokens): no token-id prompt for them
        images = bool(image_refs(messages))
        if self.continues(messages) and not images:
            assert self.prev is not None and self.history is not None
            got = env_response_text(
                self.tokenizer, self.history, messages, tools, self.prev.completion_token_ids, kw
            )
            if got is not None:
                if self.env_roles:
                    new = messages[len(self.history) :]
                    env_ids, roles = template_env_ids(self.tokenizer, got[0], got[1], new)
                else:
                    env_ids = encode(self.tokenizer, got[0])
                ids = stitch_prompt(self.prev.prompt_token_ids, self.prev.completion_token_ids, env_ids)
        rerendered = ids is None and self.turn > 0
        if rerendered and not images:
            log.debug("turn %d re-rendered by the chat template (no exact stitching)", self.turn)
            ids = encode(self.tokenizer, render(self.tokenizer, messages, tools, True, kw))
        prompt_len = (
            len(ids)
            if ids is not None
            else len(encode(self.tokenizer, render(self.tokenizer, messages, tools, True, kw)))
            + await self.image_tokens(messages)
        )
        body = self.request_body(sampling, prompt_len)
        if body is None:  # the conversation filled seq_len: a truncated rollout, not an error
            turn = Turn("", ids or [], [], [], [], finish_reason="length")
        else:
            turn = await (
                self._chat(messages, tools, body) if ids is None else self._complete(ids, tools, body)
            )
        turn.rerendered = rerendered
        turn.env_roles = roles
        return self.record(messages, turn)

    async def chat_group(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any], n: int
    ) -> list[Turn]:
        """`n` samples of a first turn in one request with `n` choices: one HTTP round trip and one
        prefill instead of n. With a seed, choice i draws from seed + i (the server's rule), so every
        rollout still has its own reproducible stream."""
        assert self.turn == 0, "a group request is a conversation's first turn"
        body = self.request_body(
            sampling,
            len(
                encode(
                    self.tokenizer, render(self.tokenizer, messages, tools, True, template_kwargs(sampling))
                )
            )
            + await self.image_tokens(messages),
        )
        if body is None:
            return [Turn("", [], [], [], [], finish_reason="length") for _ in range(n)]
        resp = await self.pool.call(
            self.server, "chat_completion", messages, model=self.pool.request_model, tools=tools, n=n, **body
        )
        return [
            self._chat_turn(c, resp, messages, tools, template_kwargs(body)) for c in self.choices(resp, n)
        ]

    async def _chat(self, messages: list[Message], tools: list[dict] | None, body: dict[str, Any]) -> Turn:
        resp = await self.pool.call(
            self.server, "chat_completion", messages, model=self.pool.request_model, tools=tools, **body
        )
        return self._chat_turn(resp["choices"][0], resp, messages, tools, template_kwargs(body))

    def _chat_turn(
        self,
        choice: dict[str, Any],
        resp: dict[str, Any],
        messages: list[Message],
        tools: list[dict] | None,
        kw: Mapping[str, Any] | None = None,
    ) -> Turn:
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        ids = choice.get("token_ids")
        lps = [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
        prompt_ids = resp.get("prompt_token_ids")
        if ids is None or prompt_ids is None:  # an endpoint without token ids (a hosted teacher)
            prompt_ids = encode(self.tokenizer, render(self.tokenizer, messages, tools, True, kw))
            ids = encode(self.tokenizer, text)
        if len(lps) != len(ids):
            lps = [0.0] * len(ids)
        return Turn(
            text=text,
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(ids),
            completion_logprobs=[float(x) for x in lps],
            policy_steps=self.steps(choice, resp),
            finish_reason=choice.get("finish_reason") or "stop",
            tool_calls=msg.get("tool_calls") or None,
            routed_experts=completion_rows(choice.get("routed_experts"), len(prompt_ids), len(ids)),
            prompt_routed_experts=prompt_rows(choice, len(prompt_ids)),
            images=[str(r) for r in image_refs(messages)] or None,
        )

    async def _complete(self, ids: list[int], tools: list[dict] | None, body: dict[str, Any]) -> Turn:
        # The prompt is token ids rendered here with the same template kwargs (see chat()).
        body = {k: v for k, v in body.items() if k != "chat_template_kwargs"}
        resp = await self.pool.call(self.server, "completion", ids, model=self.pool.request_model, **body)
        choice = resp["choices"][0]
        text = choice.get("text") or ""
        out = list(choice.get("token_ids") or [])
        lps = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(lps) != len(out):
            raise RequestFailed(f"/v1/completions returned {len(out)} token ids but {len(lps)} logprobs")
        tool_calls = None
        if tools:
            from hpcrl.inference.protocol import extract_tool_calls

            content, calls = extract_tool_calls(text)
            if calls:
                text, tool_calls = content or "", calls
        return Turn(
            text=text,
            prompt_token_ids=ids,
            completion_token_ids=out,
            completion_logprobs=lps,
            policy_steps=self.steps(choice, resp),
            finish_reason=choice.get("finish_reason") or "stop",
            tool_calls=tool_calls,
            routed_experts=completion_rows(choice.get("routed_experts"), len(ids), len(out)),
            prompt_routed_experts=prompt_rows(choice, len(ids)),
        )


class GroupClient:
    """A ChatClient shared by the rollouts of one group (environments that run a group themselves,
    e.g. verifiers group rewards): routes each request to the conversation it continues."""

    def __init__(self, make: Callable[[int], RolloutClient]):
        self.make = make
        self.convs: list[RolloutClient] = []
        self.busy: set[int] = set()

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        for i, c in enumerate(self.convs):
            # A busy conversation is never claimed twice, so identical conversations stay apart.
            if (
                i not in self.busy
                and c.history is not None
                and len(messages) > len(c.history)
                and messages[: len(c.history)] == c.history
            ):
                return await self._send(i, messages, tools, sampling)
        self.convs.append(self.make(len(self.convs)))
        return await self._send(len(self.convs) - 1, messages, tools, sampling)

    async def _send(
        self, i: int, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        self.busy.add(i)
        try:
            return await self.convs[i].chat(messages, tools, sampling)
        finally:
            self.busy.discard(i)
