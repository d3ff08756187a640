"""Every poll_interval_s: scrape each inference server's /metrics (Prometheus text: vLLM's, or the
embedded engine's under the same names), feed the controller, apply its decision to the pool's gate,
and keep the gauges for metrics.jsonl (`concurrency/*`, `inference/<server>/*`).

A server that does not answer a scrape is left out of that poll (the dead-server path in
hpcrl.orchestrator.servers owns its fate); a scrape never ends the run."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from hpcrl.orchestrator.concurrency.controller import Controller, Decision
from hpcrl.orchestrator.concurrency.prometheus import ServerLoad, parse, server_load

log = logging.getLogger("hpcrl.orchestrator.concurrency")

SCRAPE_TIMEOUT_S = 5.0
LOST_REPEAT_S = 60.0  # while a server keeps losing log lines, said again at most this often


class LostLines:
    """When to name a server process's lost log lines (its log's disk full, read-only or over quota,
    so its own log cannot say it): at once when its count starts to grow after LOST_REPEAT_S without
    growth, or with another cause; then at most every LOST_REPEAT_S while it keeps growing. Keyed by
    process (a restarted server's counter starts again). Pure: counts and times in, a line or None out."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}  # process -> its count at the last scrape
        self.grew_at: dict[str, float] = {}  # process -> when its count last grew
        self.said_at: dict[str, float] = {}
        self.said_why: dict[str, str | None] = {}
        self.told: dict[str, int] = {}  # process -> its count at the last line said

    def note(self, proc: str, count: int, why: str | None, now: float) -> str | None:
        before = self.count.get(proc, 0)
        self.count[proc] = count
        if count <= before:
            return None
        quiet = now - self.grew_at.get(proc, -math.inf) >= LOST_REPEAT_S
        self.grew_at[proc] = now
        news = (
            quiet
            or why != self.said_why.get(proc)
            or now - self.said_at.get(proc, -math.inf) >= LOST_REPEAT_S
        )
        if not news:
            return None
        new = count - self.told.get(proc, 0)
        self.said_at[proc], self.said_why[proc], self.told[proc] = now, why, count
        return f"{new} log line(s) lost: {why or 'its log refused them'} ({count} in all)"


def server_name(i: int) -> str:
    return f"server{i}"


def load_metrics(loads: dict[str, ServerLoad]) -> dict[str, float]:
    """The gauges of the last poll, per server, as metrics.jsonl keys."""
    out: dict[str, float] = {}
    for name, ld in sorted(loads.items()):
        out[f"inference/{name}/kv_cache_usage"] = ld.kv_usage
        out[f"inference/{name}/running"] = float(ld.running)
        out[f"inference/{name}/waiting"] = float(ld.waiting)
        out[f"inference/{name}/preemptions"] = float(ld.preemptions)
        if ld.kv_capacity_tokens:
            out[f"inference/{name}/kv_capacity_tokens"] = float(ld.kv_capacity_tokens)
        if ld.log_lines_lost:  # its log refused them (disk full, read-only, quota)
            out[f"inference/{name}/log_lines_lost"] = float(ld.log_lines_lost)
    return out


class Poller:
    """Owns the scrape loop of one ServerPool (the run's student servers) and its controller."""

    def __init__(self, pool: Any, controller: Controller, max_model_len: int, api_key: str | None):
        self.pool, self.ctl, self.max_model_len = pool, controller, max_model_len
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.loads: dict[str, ServerLoad] = {}
        self.lost = LostLines()
        self.peak: dict[str, float] = {}  # maxima since the last metrics(): one step's worth
        self._http: Any = None
        pool.limiter.set_limit(controller.limit)
        pool.on_answer = self.on_answer
        pool.per_sequence = controller.adaptive  # the cap counts sequences, as KV capacity does

    # -- the pool's hook -----------------------------------------------------------------------------
    def on_answer(self, inflight: int, ok: bool, weight: int = 1) -> None:
        self._peak("concurrency/inflight_max", inflight + weight)
        self.apply(self.ctl.completed(inflight, ok, time.monotonic(), weight))

    def _peak(self, key: str, value: float) -> None:
        self.peak[key] = max(self.peak.get(key, 0.0), value)

    def apply(self, d: Decision | None) -> None:
        if d is None:
            return
        self.pool.limiter.set_limit(d.limit)
        if self.ctl.adaptive:
            names = [server_name(i) for i in range(len(self.pool.clients))]
            caps = self.ctl.per_server(names)
            self.pool.caps = {i: caps[n] for i, n in enumerate(names)}
        if d.cancel:
            self.pool.limiter.shed_youngest(d.cancel)

    # -- polling -------------------------------------------------------------------------------------
    async def scrape(self) -> dict[str, ServerLoad]:
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, headers=self.headers)

        async def one(url: str) -> ServerLoad | None:
            try:
                r = await self._http.get(f"{url}/metrics")
                r.raise_for_status()
                return server_load(parse(r.text))
            except (httpx.HTTPError, ValueError) as e:
                log.debug("scrape of %s/metrics failed: %s", url, e)
                return None

        got = await asyncio.gather(*(one(u) for u in self.pool.base_urls))
        return {server_name(i): ld for i, ld in enumerate(got) if ld is not None}

    async def poll_once(self) -> None:
        loads = await self.scrape()
        self.loads.update(loads)
        self.name_lost_lines(loads, time.monotonic())
        for name, ld in loads.items():
            self._peak(f"inference/{name}/kv_cache_usage_max", ld.kv_usage)
            self._peak(f"inference/{name}/waiting_max", float(ld.waiting))
        self.apply(self.ctl.observe(loads, self.pool.limiter.count, self.max_model_len, time.monotonic()))

    def name_lost_lines(self, loads: dict[str, ServerLoad], now: float) -> None:
        """A server's log lines its disk refused: a WARNING here (the console shows the orchestrator's),
        and the count beside its state in `hpcrl status` (ServerSet.log_lost)."""
        servers = getattr(self.pool, "servers", None)
        for i in range(len(self.pool.base_urls)):
            ld = loads.get(server_name(i))
            if ld is None:
                continue
            known = servers is not None and i < len(servers)
            proc = server_name(i)
            if known:
                servers.log_lost[i] = ld.log_lines_lost
                proc += f" pid {servers.infos[i].pid}"  # a restarted server counts from 0 again
            line = self.lost.note(proc, ld.log_lines_lost, ld.log_lost_why, now)
            if line is not None:
                log.warning("%s: %s", servers.name(i) if known else self.pool.base_urls[i], line)

    async def run(self) -> None:
        """The poll loop (a watcher task of the orchestrator: cancelled at the end of the run)."""
        try:
            while True:
                try:
                    await self.poll_once()
                except Exception:  # the gauges must never end a run; the cap stays where it was
                    log.warning("concurrency poll failed", exc_info=True)
                await asyncio.sleep(self.ctl.poll_interval_s)
        finally:
            if self._http is not None:
                http, self._http = self._http, None
                await http.aclose()

    def metrics(self) -> dict[str, float]:
        """concurrency/* and inference/<server>/* now (counters cumulative), plus the maxima since
        the last call (one step: in flight, KV usage, waiting)."""
        lim = self.pool.limiter
        out = {
            **self.ctl.metrics(),
            "concurrency/inflight": float(lim.count),
            "concurrency/cancelled": float(lim.shed_total),  # each sent again exactly once
            **load_metrics(self.loads),
            **self.peak,
        }
        out.setdefault("concurrency/inflight_max", float(lim.count))
        self.peak = {}
        return out
