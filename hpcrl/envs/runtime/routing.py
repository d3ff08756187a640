"""Which worker holds which rollout: the orchestrator's routing table for one env server's workers.

Workers talk to the orchestrator directly (one hop each way); the env server only starts, watches
and replaces them. So the table lives here, on the orchestrator's side, and is plain data: a `Run`
goes to the ready worker with the fewest rollouts in flight (or waits in `backlog`), a rollout's
time in env code is measured from when it was sent or last given a model turn, and a worker that
is gone takes its rollouts with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerSlot:
    ident: bytes
    order: int  # tie-break: the order workers became ready
    rids: set[int] = field(default_factory=set)


@dataclass
class Held:
    ident: bytes
    in_env_since: float | None  # None while it waits for a model turn


@dataclass
class Router:
    workers: dict[bytes, WorkerSlot] = field(default_factory=dict)
    held: dict[int, Held] = field(default_factory=dict)
    backlog: list[Any] = field(default_factory=list)  # Runs waiting for a ready worker
    _order: int = 0

    def ready(self, ident: bytes) -> list[Any]:
        """A worker said Ready; returns the backlog to dispatch now."""
        self._order += 1
        self.workers[ident] = WorkerSlot(ident, self._order)
        backlog, self.backlog = self.backlog, []
        return backlog

    def pick(self) -> bytes | None:
        if not self.workers:
            return None
        return min(self.workers.values(), key=lambda w: (len(w.rids), w.order)).ident

    def assign(self, rid: int, run: Any, now: float) -> bytes | None:
        """The worker `run` goes to, or None (queued until one is ready)."""
        ident = self.pick()
        if ident is None:
            self.backlog.append(run)
            return None
        self.workers[ident].rids.add(rid)
        self.held[rid] = Held(ident, now)
        return ident

    def asked_model(self, rid: int) -> None:
        if rid in self.held:
            self.held[rid].in_env_since = None

    def answered(self, rid: int, now: float) -> bytes | None:
        """A model turn goes back to its rollout: the worker holding it (None: it is gone)."""
        h = self.held.get(rid)
        if h is None:
            return None
        h.in_env_since = now
        return h.ident

    def done(self, rid: int) -> None:
        h = self.held.pop(rid, None)
        if h is not None and h.ident in self.workers:
            self.workers[h.ident].rids.discard(rid)

    def gone(self, ident: bytes) -> list[int]:
        """The worker died or was killed: the rollouts it held (now errored) and nothing routed to it."""
        slot = self.workers.pop(ident, None)
        rids = (
            sorted(slot.rids) if slot is not None else [r for r, h in self.held.items() if h.ident == ident]
        )
        for rid in rids:
            self.held.pop(rid, None)
        return rids

    def overdue(self, now: float, timeout_s: float) -> list[bytes]:
        """Workers holding a rollout that has spent more than `timeout_s` in env code."""
        out = []
        for h in self.held.values():
            if h.in_env_since is not None and now - h.in_env_since > timeout_s and h.ident not in out:
                out.append(h.ident)
        return out

    def clear(self) -> list[int]:
        """The whole server is gone: every rollout held or queued."""
        rids = sorted(self.held) + [run.rid for run in self.backlog]
        self.workers.clear()
        self.held.clear()
        self.backlog.clear()
        return rids
