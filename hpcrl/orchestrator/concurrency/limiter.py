"""The gate every inference request of a ServerPool passes: at most `limit` units in flight, first
come first served, resizable at any time, and able to shed the youngest requests in flight.

A unit is a request (fixed mode: hpcrl's cap before issue 53) or, in adaptive mode, a sequence: a
request for n completions weighs n, since KV pressure is per sequence. A request heavier than the
whole limit still goes, alone, so nothing waits forever.

A shed request is not lost: its HTTP call is cancelled (the server frees its KV when the client
goes), and the pool sends it again at the head of the line, once per shedding, so every request
still ends with exactly one answer (hpcrl.orchestrator.pool.ServerPool.call)."""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Slot:
    """One admitted request; `task` is its HTTP call while one runs (what shedding cancels)."""

    seq: int
    weight: int = 1
    task: asyncio.Task | None = None
    shed: bool = False


@dataclass(eq=False)
class Limiter:
    limit: int
    inflight: set[Slot] = field(default_factory=set)
    waiters: collections.deque[tuple[asyncio.Future, int]] = field(default_factory=collections.deque)
    shed_total: int = 0  # units shed (cumulative): each request shed was sent again once
    granted: int = 0  # units of waiters let in that have not taken their slot yet
    _seq: itertools.count = field(default_factory=itertools.count)

    @property
    def count(self) -> int:
        """Units in flight."""
        return sum(s.weight for s in self.inflight)

    def _fits(self, weight: int) -> bool:
        used = self.count + self.granted
        return used + weight <= self.limit or used == 0

    async def acquire(self, weight: int = 1, front: bool = False) -> Slot:
        """A slot once the request fits under `limit` and nobody earlier waits; `front` (a shed
        request going again) waits at the head of the line."""
        weight = max(1, int(weight))
        if not self.waiters and self._fits(weight):
            return self._take(weight)
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, weight)
        (self.waiters.appendleft if front else self.waiters.append)(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled: pass it on
                self.granted -= weight
                self._wake()
            else:
                self.waiters.remove(entry)
                self._wake()  # a heavy head that left may unblock lighter ones behind it
            raise
        self.granted -= weight
        return self._take(weight)

    def _take(self, weight: int) -> Slot:
        slot = Slot(next(self._seq), weight)
        self.inflight.add(slot)
        return slot

    def release(self, slot: Slot) -> None:
        self.inflight.discard(slot)
        self._wake()

    def _wake(self) -> None:
        """Let waiters in, in order, while the head fits (each takes its slot when it resumes)."""
        while self.waiters and self._fits(self.waiters[0][1]):
            fut, weight = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.granted += weight

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self._wake()

    def shed_youngest(self, n: int) -> int:
        """Cancel the HTTP calls of the youngest requests in flight until `n` units are shed (they go
        again); the units shed. The oldest request always stays (shedding it would only restart it)."""
        young = sorted((s for s in self.inflight if s.task is not None and not s.shed), key=lambda s: -s.seq)
        young = young[:-1] if len(young) == len(self.inflight) else young  # the oldest always stays
        done = 0
        for s in young:
            if done >= n:
                break
            if not s.task.cancel():  # answered already: nothing to shed
                continue
            s.shed = True
            done += s.weight
        self.shed_total += done
        return done
