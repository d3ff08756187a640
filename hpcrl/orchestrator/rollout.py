"""Rollouts over HTTP: token ids + logprobs from the server, exact multi-turn stitching, retries.

Turn 1 of a rollout goes to /v1/chat/completions (the server applies its chat template and returns
the prompt ids it used). Turn k > 1 goes to /v1/completions with a token-id prompt:

    prompt_k = prompt_{k-1} + completion_{k-1} + env_ids

where env_ids is the tokenization of what the chat template puts after the model's last sampled
token: the tail of the assistant turn it did not sample (e.g. "\n" after <|im_end|>) plus the
env's messages and the next generation prompt. The model is therefore conditioned on exactly the
tokens it sampled (never a re-tokenization of its text), and the rollout is one training sequence
whose loss mask covers only sampled tokens. When the template re-renders the history differently
(tool calls re-serialised, reasoning stripped), exact stitching is impossible: that turn's prompt
is the template's rendering and the rollout becomes one training sequence per turn.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcrl.envs.base import Environment, Message, Task, Trajectory, Turn, stitch_turns
from hpcrl.monitor import watchdog
from hpcrl.orchestrator.servers import InferenceUnavailable, ServerSet, is_dead
from hpcrl.orchestrator.state import Piece, RolloutRecord

log = logging.getLogger("hpcrl.orchestrator")

RETRIES = 5
BACKOFF_S = 0.5
FAILURE_STREAK = 16  # consecutive failed requests (after retries) that mean inference is gone


class RequestFailed(RuntimeError):
    """One request failed after its retries (or was refused): the rollout is counted as errored."""


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------
class ServerPool:
    """Inference servers (hpcrl.inference.client): least-loaded choice, bounded concurrency, retries
    with exponential backoff, and a streak limit that turns "no server answers" into one clear error.

    With a ServerSet (the student servers of a run), a server whose connection fails and whose
    /health does not answer is marked down and the request moves at once to another live server
    (not counted as a retry: the request never ran to an answer); requests wait for a server to come
    back only when none is up, bounded by the set's down_timeout_s."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str,
        timeout: float,
        max_concurrent: int,
        api_key: str | None = None,
        retries: int = RETRIES,
        backoff: float = BACKOFF_S,
        servers: ServerSet | None = None,
    ):
        self.timeout, self.api_key, self.max_concurrent = timeout, api_key, max_concurrent
        self.clients = [self._client(u) for u in base_urls]
        self.model = model
        # LoRA RL: the adapter the servers hold the policy under, once one is loaded (PolicySync.adapter).
        # vLLM applies an adapter only to requests naming it; the hf engine serves its merge under any name.
        self.adapter: Callable[[], str | None] = lambda: None
        self.sem = asyncio.Semaphore(max_concurrent)
        self.inflight = [0] * len(self.clients)
        self.retries, self.backoff = retries, backoff
        self.failure_streak = 0
        self.servers = servers
        self.moved = (
            0  # requests sent to another server because theirs died (metric inference/requests_moved)
        )
        self._closing: set[asyncio.Task] = set()
        if servers is not None:
            assert len(servers) == len(self.clients)
            servers.on_address.append(self.readdress)

    def _client(self, url: str):
        from hpcrl.inference.client import InferenceClient

        return InferenceClient(
            url, timeout=self.timeout, api_key=self.api_key, max_connections=self.max_concurrent + 8
        )

    def readdress(self, pos: int, url: str) -> None:
        """A restarted server listens elsewhere: new requests go there; the old client closes."""
        old, self.clients[pos] = self.clients[pos], self._client(url)
        task = asyncio.ensure_future(old.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @property
    def request_model(self) -> str:
        """The `model` of a request now: the loaded policy's adapter, else the served model."""
        return self.adapter() or self.model

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def pick(self) -> int:
        live = self.servers.live() if self.servers is not None else range(len(self.clients))
        return min(live or range(len(self.clients)), key=lambda i: (self.inflight[i], i))

    async def call(self, server: int, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`InferenceClient.<method>(*args, **kwargs)` on one server, retried; see the class doc."""
        import httpx

        from hpcrl.inference.client import InferenceError

        err = ""
        async with self.sem:
            attempt = 0
            while attempt <= self.retries:
                server = await self._route(server)
                client = self.clients[server]
                self.inflight[server] += 1
                try:
                    out = await getattr(client, method)(*args, **kwargs)
                    self.failure_streak = 0
                    watchdog.beat("inference answered")
                    return out
                except httpx.TransportError as e:
                    err = f"{type(e).__name__}: {e}"
                    if await self._died(server, client, err):
                        continue  # sent again at once to a live server
                except InferenceError as e:
                    err = str(e)
                    if e.status < 500 and e.status != 429:  # our request is wrong: retrying won't help
                        raise RequestFailed(err) from None
                finally:
                    self.inflight[server] -= 1
                if attempt < self.retries:
                    await asyncio.sleep(self.backoff * 2**attempt)
                attempt += 1
        self.failure_streak += 1
        if self.failure_streak >= FAILURE_STREAK:
            raise InferenceUnavailable(
                f"inference at {self.base_urls} stopped answering: {self.failure_streak} "
                f"requests in a row failed after {self.retries} retries; last: {err}"
            )
        raise RequestFailed(f"{self.clients[server].base_url} failed after {self.retries} retries: {err}")

    async def _route(self, server: int) -> int:
        """`server` if it is up, else the least-loaded live one (waiting, bounded, while none is)."""
        if self.servers is None or self.servers.is_up(server):
            return server
        await self.servers.wait_live()
        return self.pick()

    async def _died(self, server: int, client: Any, err: str) -> bool:
        """After a connection failure: is the server gone (then it is marked down)?"""
        if self.servers is None:
            return False
        if self.servers.is_up(server) and not await is_dead(client):
            return False  # a live server dropped one connection: an ordinary retry
        if self.clients[server] is client:  # else it already came back at a new address
            self.servers.mark_down(server, err)
        self.moved += 1
        return True

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)


def derive_seed(*key: object) -> int:
    """A stable 31-bit request seed from a key (same on every machine and Python version)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def openai_sampling(sampling: Any) -> dict[str, Any]:
    """SamplingConfig -> request fields (only those that differ from the API defaults)."""
    out: dict[str, Any] = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature}
    if sampling.top_p < 1:
        out["top_p"] = sampling.top_p
    if sampling.top_k > 0:
        out["top_k"] = sampling.top_k
    if sampling.min_p > 0:
        out["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1:
        out["repetition_penalty"] = sampling.repetition_penalty
    kwargs = {}
    if sampling.enable_thinking is not None:
        kwargs["enable_thinking"] = sampling.enable_thinking
    if sampling.reasoning_effort is not None:
        kwargs["reasoning_effort"] = sampling.reasoning_effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


# ---------------------------------------------------------------------------------------------
# Token stitching (pure functions)
# ---------------------------------------------------------------------------------------------
def render(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text. `template_kwargs` (enable_thinking, reasoning_effort) must be the
    request's on every render: a later turn's prompt is rendered here, not by the server, and a
    template that changes with them (Qwen3's empty think block) would otherwise differ from turn 1."""
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )


def template_kwargs(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-template switches of a request's sampling fields (see openai_sampling)."""
    return dict(sampling.get("chat_template_kwargs") or {})


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def env_response_ids(
    tokenizer: Any,
    history: list[Message],
    messages: list[Message],
    tools: list[dict] | None,
    completion_ids: list[int],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int] | None:
    """Token ids the template puts after the last sampled token of `history` (which ends with the
    assistant turn that produced `completion_ids`) up to the next generation prompt of `messages`.
    None when the template does not render `history` as a prefix of `messages` plus what the model
    sampled (then no exact stitching exists)."""
    before = render(tokenizer, history[:-1], tools, True, template_kwargs)
    through = render(tokenizer, history, tools, False, template_kwargs)
    full = render(tokenizer, messages, tools, True, template_kwargs)
    if not (through.startswith(before) and full.startswith(through)):
        return None
    assistant_text = through[len(before) :]
    sampled = tokenizer.decode(completion_ids, skip_special_tokens=False)
    if not assistant_text.startswith(sampled):
        return None
    return encode(tokenizer, assistant_text[len(sampled) :] + full[len(through) :])


def stitch_prompt(
    prev_prompt: Sequence[int], prev_completion: Sequence[int], env_ids: Sequence[int]
) -> list[int]:
    return [*prev_prompt, *prev_completion, *env_ids]


def pieces_from_turns(turns: Sequence[Turn], branching: bool = False) -> list[Piece]:
    """One Piece for a rollout whose turns stitch exactly, else one Piece per turn (always one per
    turn with ``branching``: orchestrator.trajectory_strategy = "branching")."""
    whole = None if branching else stitch_turns(turns)
    if whole is not None:
        return [
            Piece(
                input_ids=whole.input_ids.tolist(),
                loss_mask=whole.loss_mask.tolist(),
                logprobs=whole.logprobs.tolist(),
            )
        ]
    return [
        Piece(
            input_ids=[*t.prompt_token_ids, *t.completion_token_ids],
            loss_mask=[False] * len(t.prompt_token_ids) + [True] * len(t.completion_token_ids),
            logprobs=[0.0] * len(t.prompt_token_ids) + [float(x) for x in t.completion_logprobs],
        )
        for t in turns
    ]


def to_record(index: int, traj: Trajectory, branching: bool = False) -> RolloutRecord:
    sampled = [t for t in traj.turns if t.completion_token_ids]
    return RolloutRecord(
        index=index,
        pieces=pieces_from_turns(traj.turns, branching) if sampled else [],
        reward=float(traj.reward),
        policy_version=min((t.oldest_policy_step for t in sampled), default=0),
        num_turns=len(traj.turns),
        completion_tokens=sum(len(t.completion_token_ids) for t in traj.turns),
        truncated=traj.truncated,
        error=traj.error,
        metrics={k: float(v) for k, v in traj.metrics.items()},
    )


# ---------------------------------------------------------------------------------------------
# The ChatClient environments talk to
# ---------------------------------------------------------------------------------------------
class RolloutClient:
    """One conversation's ChatClient (hpcrl.envs.ChatClient): remembers the previous turn's ids so
    the next turn's prompt extends them exactly."""

    def __init__(
        self,
        pool: ServerPool,
        tokenizer: Any,
        seq_len: int,
        seed: int | None,
        default_policy: Callable[[], int],
    ):
        self.pool, self.tokenizer, self.seq_len = pool, tokenizer, seq_len
        self.seed, self.default_policy = seed, default_policy
        self.server = pool.pick()
        self.history: list[Message] | None = None
        self.prev: Turn | None = None
        self.turn = 0

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Turn:
        body = {**sampling}
        kw = template_kwargs(sampling)
        if self.seed is not None:
            body["seed"] = derive_seed(self.seed, self.turn)
        ids = None
        if (
            self.prev is not None
            and self.history is not None
            and messages[: len(self.history)] == self.history
        ):
            env_ids = env_response_ids(
                self.tokenizer, self.history, messages, tools, self.prev.completion_token_ids, kw
            )
            if env_ids is not None:
                ids = stitch_prompt(self.prev.prompt_token_ids, self.prev.completion_token_ids, env_ids)
        if ids is None and self.turn > 0:
            log.debug("turn %d re-rendered by the chat template (no exact stitching)", self.turn)
            ids = encode(self.tokenizer, render(self.tokenizer, messages, tools, True, kw))
        prompt_len = (
            len(ids)
            if ids is not None
            else len(encode(self.tokenizer, render(self.tokenizer, messages, tools, True, kw)))
        )
        room = self.seq_len - prompt_len
        if room <= 0:  # the conversation filled seq_len: a truncated rollout, not an error
            turn = Turn("", ids or [], [], [], [], finish_reason="length")
        else:
            body["max_tokens"] = min(int(body.get("max_tokens") or room), room)
            turn = await (
                self._chat(messages, tools, body) if ids is None else self._complete(ids, tools, body)
            )
        self.history = copy.deepcopy([*messages, turn.message()])
        self.prev = turn
        self.turn += 1
        return turn

    async def chat_group(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any], n: int
    ) -> list[Turn]:
        """`n` samples of a first turn in one request with `n` choices: one HTTP round trip and one
        prefill instead of n. With a seed, choice i draws from seed + i (the server's rule), so every
        rollout still has its own reproducible stream."""
        assert self.turn == 0, "a group request is a conversation's first turn"
        body = {**sampling}
        if self.seed is not None:
            body["seed"] = derive_seed(self.seed, self.turn)
        room = self.seq_len - len(
            encode(self.tokenizer, render(self.tokenizer, messages, tools, True, template_kwargs(sampling)))
        )
        if room <= 0:
            return [Turn("", [], [], [], [], finish_reason="length") for _ in range(n)]
        body["max_tokens"] = min(int(body.get("max_tokens") or room), room)
        resp = await self.pool.call(
            self.server, "chat_completion", messages, model=self.pool.request_model, tools=tools, n=n, **body
        )
        choices = resp.get("choices") or []
        if len(choices) != n:
            raise RequestFailed(f"asked for {n} choices, the server returned {len(choices)}")
        return [self._chat_turn(c, resp, messages, tools, template_kwargs(body)) for c in choices]

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
            policy_steps=self._steps(choice, resp),
            finish_reason=choice.get("finish_reason") or "stop",
            tool_calls=msg.get("tool_calls") or None,
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
            policy_steps=self._steps(choice, resp),
            finish_reason=choice.get("finish_reason") or "stop",
            tool_calls=tool_calls,
        )

    def _steps(self, choice: dict[str, Any], resp: dict[str, Any]) -> list[int]:
        # Our server reports the policies that produced the choice; vLLM does not: then we assume
        # the policy loaded when the request was sent.
        steps = choice.get("policy_steps") or resp.get("policy_steps")
        return [int(s) for s in steps] if steps else [self.default_policy()]


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


# ---------------------------------------------------------------------------------------------
# One group
# ---------------------------------------------------------------------------------------------
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
    if type(env).rollout_group is Environment.rollout_group:
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
    try:
        trajs = await env.rollout_group(task, GroupClient(make_client), sampling, n)
    except InferenceUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - any env bug must cost only its rollouts
        return [_errored(i, e, env.name) for i in range(n)]
    return [_record(task, i, t, branching, sink) for i, t in enumerate(trajs)]


def _record(task: Task, index: int, traj: Trajectory, branching: bool, sink: Sink | None) -> RolloutRecord:
    if sink is not None:
        sink(task, index, traj)
    return to_record(index, traj, branching)


async def _one(
    env: Environment,
    task: Task,
    sampling: Mapping[str, Any],
    client: RolloutClient | _SharedView,
    index: int,
    branching: bool = False,
    sink: Sink | None = None,
) -> RolloutRecord:
    try:
        return _record(task, index, await env.rollout(task, client, sampling), branching, sink)
    except InferenceUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - an env that raises errors its rollout, the run goes on
        return _errored(index, e, env.name)
    finally:
        if isinstance(client, _SharedView):
            client.close()


def single_turn(env: Environment) -> bool:
    """Rollouts of this env make exactly one chat call (the reference driver, one turn, no tools), so
    a group's n calls can be one request with n choices."""
    return env.max_turns <= 1 and not env.tools and type(env).rollout is Environment.rollout


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


def _errored(index: int, e: BaseException, env_name: str) -> RolloutRecord:
    from hpcrl.monitor.logging import env_logger

    env_logger(env_name).warning("rollout %d errored: %s: %s", index, type(e).__name__, e)
    return RolloutRecord(index=index, pieces=[], error=f"{type(e).__name__}: {e}"[:500])


async def teacher_logprobs(pool: ServerPool, ids: list[int]) -> list[float]:
    """Teacher log-probabilities of every token of `ids` given its prefix (first token: 0), from a
    vLLM-style `prompt_logprobs` completion request."""
    resp = await pool.call(
        pool.pick(),
        "completion",
        ids,
        model=pool.request_model,
        max_tokens=1,
        tokens=False,
        prompt_logprobs=0,
    )
    choice = resp["choices"][0]
    plp = choice.get("prompt_logprobs") or resp.get("prompt_logprobs")
    if not plp or len(plp) != len(ids):
        raise InferenceUnavailable(
            f"teacher at {pool.base_urls[0]} did not return prompt_logprobs for {len(ids)} tokens "
            "(opd needs a server that supports prompt_logprobs, e.g. vLLM)"
        )
    out = [0.0]
    for tok, entry in zip(ids[1:], plp[1:]):
        e = entry.get(str(tok)) if isinstance(entry, dict) else None
        out.append(float(e["logprob"] if isinstance(e, dict) else e) if e is not None else 0.0)
    return out


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
    ):
        assert strategy in ("interleaved", "branching"), strategy
        self.pool, self.tokenizer, self.seq_len = pool, tokenizer, seq_len
        self.default_policy, self.seed, self.strategy = default_policy, seed, strategy
        self.branching = strategy == "branching"  # also: one training sample per assistant turn
        self._example_lock: asyncio.Lock | None = None

    def client_factory(self, *key: object) -> Callable[[int], RolloutClient]:
        def make(i: int) -> RolloutClient:
            seed = None if self.seed is None else derive_seed(self.seed, *key, i)
            return RolloutClient(self.pool, self.tokenizer, self.seq_len, seed, self.default_policy)

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
