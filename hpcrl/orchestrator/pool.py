"""The inference servers a run samples from, as one pool: least-loaded routing, bounded concurrency
(fixed, or sized by hpcrl.orchestrator.concurrency), retries with backoff, moving requests off a dead
server, and one clear error when inference is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from hpcrl.monitor import progress, watchdog
from hpcrl.orchestrator.concurrency.limiter import Limiter, Slot
from hpcrl.orchestrator.servers import InferenceUnavailable, ServerSet, is_dead

RETRIES = 5
BACKOFF_S = 0.5
FAILURE_STREAK = 16  # consecutive failed requests (after retries) that mean inference is gone


class _Shed(Exception):
    """The concurrency controller cancelled this request's HTTP call: it goes again."""


class RequestFailed(RuntimeError):
    """One request failed after its retries (or was refused): the rollout is counted as errored."""


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
        # The in-flight gate; an adaptive run's poller (hpcrl.orchestrator.concurrency.poller) resizes
        # it, sets per-server caps and hears each answer (on_answer: growth is paced by completions).
        self.limiter = Limiter(max_concurrent)
        self.caps: dict[int, int] | None = None
        self.on_answer: Callable[[int, bool, int], None] | None = None
        self.per_sequence = False  # adaptive: a request for n completions weighs n in the gate
        self.inflight = [0] * len(self.clients)
        # Per server: since when its in-flight requests have had no answer (the last answer, or the
        # first request sent while none was in flight); read by the stall report (hpcrl.orchestrator.stalls).
        self.quiet_since = [0.0] * len(self.clients)
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
        live = self.servers.live() if self.servers is not None else list(range(len(self.clients)))
        # An unresponsive (frozen) server gets no new requests while another one answers.
        answering = [i for i in live if self.servers is None or i not in self.servers.unresponsive]
        pool = answering or live or range(len(self.clients))
        if self.caps:  # adaptive: servers under their own cap first
            pool = [i for i in pool if self.inflight[i] < self.caps.get(i, self.limiter.limit)] or pool
        return min(pool, key=lambda i: (self.inflight[i], i))

    async def call(self, server: int, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`InferenceClient.<method>(*args, **kwargs)` on one server, retried; see the class doc. A
        request the concurrency controller sheds is sent again (at the head of the line): exactly
        one answer per call."""
        front = False
        weight = 1
        if self.per_sequence:
            weight = int(kwargs.get("n") or (kwargs.get("sampling_params") or {}).get("n") or 1)
        while True:
            slot = await self.limiter.acquire(weight, front)
            ok = False
            try:
                out = await self._attempts(slot, server, method, args, kwargs)
                ok = True
                return out
            except _Shed:
                front = True
            finally:
                self.limiter.release(slot)
                if self.on_answer is not None and (ok or not slot.shed):
                    self.on_answer(self.limiter.count, ok, weight)

    async def _attempts(
        self, slot: Slot, server: int, method: str, args: tuple, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        import httpx

        from hpcrl.inference.client import InferenceError

        err = ""
        attempt = 0
        while attempt <= self.retries:
            server = await self._route(server)
            client = self.clients[server]
            if not self.inflight[server]:
                self.quiet_since[server] = time.monotonic()
            self.inflight[server] += 1
            try:
                slot.task = asyncio.ensure_future(getattr(client, method)(*args, **kwargs))
                try:
                    out = await slot.task
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if slot.shed and (me is None or not me.cancelling()):
                        raise _Shed() from None
                    raise
                self.failure_streak = 0
                self.quiet_since[server] = time.monotonic()
                watchdog.beat("inference answered")
                progress.moved("inference answered")
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
                slot.task = None
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
