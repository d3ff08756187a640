"""The orchestrator's side of stall detection (hpcrl.monitor.progress): whom it waits on, and frozen
inference servers kept out of the way.

`StallWatch.run` is an asyncio task: every TICK_S it measures the event loop's lag (the metric
`orchestrator/event_loop_lag_s`: the largest since the last step), and every PROBE_S it asks /health
of each server whose in-flight requests have had no answer for PROBE_AFTER_S:

- no answer: the server is *unresponsive* (ServerSet.unresponsive): one WARNING, no new requests to
  it while another server answers (its in-flight ones stay: a frozen process answers them once it
  runs again); it answers again: one line, it takes requests again;
- unresponsive for longer than orchestrator.server_down_timeout_s: it is ended and marked down, so
  its supervisor restarts it like a dead one and `revive` brings it back with the current policy.
  hpcrl.orchestrator.server_end says how: SIGKILL where it runs on this host; through SLURM
  (`srun ... -w NODE kill -9 PID` in the job) where it runs on another node of this SLURM job; else a
  kill order that the server's keepalive on that node carries out (RunPaths.kill_order_file,
  hpcrl.launch.keepalive), with the same outcome.

`culprit` runs on the progress thread (it works while the event loop is blocked) and names what the
orchestrator waits on: unanswered requests per server with the age and whether /health answers, a
blocked event loop, the env worker (env, index, pid) whose rollouts sit in env code, the trainer (with
the age of its own progress report) while a policy is awaited.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from hpcrl.monitor import progress
from hpcrl.monitor.progress import stacks_of_other
from hpcrl.orchestrator.server_end import end
from hpcrl.orchestrator.servers import PROBE_TIMEOUT_S, ServerSet, is_dead
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.orchestrator")

TICK_S = 0.25
PROBE_S = 2.0
PROBE_AFTER_S = 10.0  # requests unanswered this long make the server's /health worth asking
LOOP_BLOCKED_S = 5.0  # the culprit names the event loop once it has not run for this long


class StallWatch:
    def __init__(
        self,
        paths: RunPaths,
        servers: ServerSet,
        pools: Sequence[Any],
        probe_after_s: float,
        sync: Any = None,
        envs: Sequence[Any] = (),
    ):
        self.paths, self.servers, self.sync = paths, servers, sync
        # env servers' workers (RemoteEnvironment.busy_workers): a stall names a worker by pid
        self.envs = [e for e in envs if hasattr(e, "busy_workers")]
        self.pools = [p for p in pools if getattr(p, "servers", None) is servers]
        self.probe_after_s = probe_after_s
        self.tick = time.monotonic()
        self.lag_max = 0.0  # since the last metrics()
        self._spied: set[int] = set()
        self._told: set[int] = set()  # unresponsive servers whose WARNING was logged

    # -- the asyncio task ----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        if (me := progress.current()) is not None:
            me.dumpers.append(lambda f: dump_tasks(loop, f))
        next_probe = 0.0
        while True:
            before = time.monotonic()
            await asyncio.sleep(TICK_S)
            self.tick = time.monotonic()
            self.lag_max = max(self.lag_max, self.tick - before - TICK_S)
            if self.tick >= next_probe:
                next_probe = self.tick + PROBE_S
                try:
                    await self.probe()
                except Exception as e:  # noqa: BLE001 - a report must not end the run
                    log.debug("stall probe failed: %s", e)

    def waiting(self) -> dict[int, tuple[int, float]]:
        """position -> (requests in flight, seconds since they last had an answer); a policy load
        in flight counts as one request."""
        now, out = time.monotonic(), {}
        for pos, (_, since) in list(getattr(self.sync, "loading", {}).items()):
            out[pos] = (1, now - since)
        for pool in self.pools:
            for pos, n in enumerate(pool.inflight):
                if n:
                    k, age = out.get(pos, (0, 0.0))
                    out[pos] = (k + n, max(age, now - pool.quiet_since[pos]))
        return out

    async def probe(self) -> None:
        s, now = self.servers, time.monotonic()
        waiting = self.waiting()
        for pos in range(len(s)):
            if pos in s.down:
                continue
            n, age = waiting.get(pos, (0, 0.0))
            if pos not in s.unresponsive and age < self.probe_after_s:
                continue
            client = self.pools[0].clients[pos] if self.pools else None
            if client is None:
                return
            if await is_dead(client):
                if pos not in s.unresponsive or pos not in self._told:
                    self._told.add(pos)
                    s.unresponsive.setdefault(pos, now - age)
                    others = [i for i in s.live() if i != pos and i not in s.unresponsive]
                    log.warning(
                        "%s does not answer /health: %d request(s) unanswered for %.0f s; %s",
                        s.name(pos),
                        n,
                        age,
                        "no new requests go to it" if others else "no other server to send requests to",
                    )
                elif now - s.unresponsive[pos] > s.down_timeout_s:
                    await self.kill(pos, now - s.unresponsive[pos])
            elif pos in s.unresponsive:
                self._told.discard(pos)
                since = s.unresponsive.pop(pos)
                log.warning(
                    "%s answers /health again after %.0f s: it takes requests again", s.name(pos), now - since
                )

    async def kill(self, pos: int, frozen_s: float) -> None:
        """Frozen past the down deadline: end the process so its supervisor restarts it
        (hpcrl.orchestrator.server_end: SIGKILL here, through SLURM on another node, or a kill order)."""
        s, info = self.servers, self.servers.infos[pos]
        s.unresponsive.pop(pos, None)
        self._told.discard(pos)
        what = await end(self.paths, info)
        log.warning(
            "%s frozen for %.0f s (> orchestrator.server_down_timeout_s = %.0f): %s",
            s.name(pos),
            frozen_s,
            s.down_timeout_s,
            what,
        )
        s.mark_down(pos, f"frozen for {frozen_s:.0f} s")

    # -- read by the progress thread and the step metrics ---------------------------------------------
    def culprit(self, idle: float) -> str | None:
        now, s, parts = time.monotonic(), self.servers, []
        if now - self.tick > LOOP_BLOCKED_S:
            parts.append(f"its event loop has not run for {now - self.tick:.0f} s")
        for pos, (n, age) in sorted(self.waiting().items()):
            if (
                pos not in s.unresponsive
                and age >= self.probe_after_s
                and not health_answers(s.infos[pos].base_url)
            ):
                s.unresponsive.setdefault(pos, now - age)  # probe() logs it and takes it back if it answers
            health = "/health unanswered" if pos in s.unresponsive else "/health answers"
            load = getattr(self.sync, "loading", {}).get(pos)
            what = f"{n} requests" + (f" (loading policy {load[0]})" if load else "")
            parts.append(f"{what} to {s.name(pos)} unanswered for {age:.0f} s; {health}")
            if pos in s.unresponsive and s.infos[pos].pid not in self._spied:
                self._spied.add(s.infos[pos].pid)
                parts.append(
                    stacks_of_other(
                        s.infos[pos].pid, f"inference_{s.infos[pos].index}", self.paths.stalls_dir
                    )
                )
        for pos in sorted(s.down):
            parts.append(f"{s.name(pos)} is down since {now - s.down[pos]:.0f} s")
        for env in self.envs:  # workers whose rollouts sat in env code for half the stall or more
            try:
                parts += [w for w, age in env.busy_workers(now) if age >= idle / 2][:3]
            except RuntimeError:  # the event loop changed the table while this thread read it
                pass
        me = progress.current()
        if me is not None and (wait := me.describe_wait(now)) is not None:
            parts.append(wait)
        return "; ".join(parts) or None

    def extra(self) -> dict[str, Any]:  # noqa: D102 - fields of logs/progress/orchestrator.json
        s = self.servers
        return {
            "event_loop_lag_s": round(max(0.0, time.monotonic() - self.tick - TICK_S), 2),
            "servers": {
                s.name(pos): (
                    "down" if pos in s.down else "unresponsive" if pos in s.unresponsive else "answering"
                )
                for pos in range(len(s))
            },
            # log lines a server's process could not write (its /metrics; hpcrl status shows them)
            "servers_log_lost": {s.name(pos): n for pos, n in s.log_lost.items() if n and pos < len(s)},
            "inflight": {s.name(pos): [n, round(age)] for pos, (n, age) in self.waiting().items()},
        }

    def metrics(self) -> dict[str, float]:
        out = {"orchestrator/event_loop_lag_s": round(self.lag_max, 4)}
        self.lag_max = 0.0
        return out


def health_answers(base_url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """GET /health from the progress thread (the event loop may be the thing that is stuck)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/health", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # an error answer (503 while loading) is still an answer
    except (OSError, ValueError):
        return False


def dump_tasks(loop: asyncio.AbstractEventLoop, f: Any) -> None:
    """Where each asyncio task of the orchestrator awaits (a thread stack shows only the selector).
    Read from the progress thread: a diagnostic snapshot, not synchronized with the loop."""
    tasks = list(asyncio.all_tasks(loop))
    f.write(f"\n# {len(tasks)} asyncio tasks\n")
    for t in tasks:
        f.write(f"\n{t.get_name()} {t.get_coro()!r}\n")
        t.print_stack(limit=12, file=f)
