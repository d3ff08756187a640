"""Progress of a role, and a stall named once with its culprit.

Each role process has one `Progress` (like its watchdog, reached through module functions, so deep
code reports without being handed the object):

    moved(what)          something advanced (a request answered, a batch published, a step trained)
    step(n)              a training/orchestrator step ended: also sizes the bound to the step time
    waiting(on) / done() what the role is blocked on now (the bus file, the trainer's policy ...)

A daemon thread (it runs while the main thread or the event loop is stuck) writes
logs/progress/<role>.json every few seconds and, when nothing moved for the bound (stall_warning_s,
or 3x the recent step time where that is longer), logs one WARNING naming whom the role waits on and
since when: the role's `culprit()` callback says that (the orchestrator names the inference server
with unanswered requests and whether its /health answers), else the `waiting` text. It then writes
its own stacks to logs/stalls/ (faulthandler) and drops a request there that every other live role's
thread answers with its stacks. Progress after a named stall is logged once too ("moving again").

Nothing here ends a process: the watchdog and the timeouts do that. The cost on the hot path is one
time.monotonic() per report.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.progress")

WRITE_EVERY_S = 2.0  # logs/progress/<role>.json refresh: what `hpcrl status` reads
SELF_FROZEN_S = 5.0  # the thread itself slept this much longer than asked: the process was stopped
STALE_S = 2.5 * WRITE_EVERY_S  # a report older than this: the process cannot run its threads
STEP_FACTOR = 3.0  # the bound grows to this many times the recent (median) step time


class Progress:
    def __init__(
        self,
        role: str,
        progress_dir: Path | None,
        stalls_dir: Path | None,
        bound_s: float,
        poll_s: float | None = None,
    ):
        self.role, self.bound_s = role, bound_s
        self.progress_dir, self.stalls_dir = progress_dir, stalls_dir
        now = time.monotonic()
        self.last, self.what = now, "started"
        self.on: str | None = None  # what the role waits on now
        self.peer: str | None = None  # the role that `on` comes from (its own report is quoted)
        self.on_since = now
        # writes the storage policy retries (what -> (its line, since)), whichever thread makes them
        self.refused: dict[str, tuple[str, float]] = {}
        self.step_no: int | None = None
        self.step_times: deque[float] = deque(maxlen=8)
        self._step_at: float | None = None
        self.culprit: Callable[[float], str | None] = lambda idle: None
        self.extra: Callable[[], dict] = dict  # more fields for the progress file (loop lag, servers)
        self.dumpers: list[
            Callable[[Any], None]
        ] = []  # more stacks for a dump (asyncio tasks), given the file
        self.stalled_since: float | None = None  # monotonic time the stall was named
        self.named_at: float | None = None  # seconds of no progress when it was named (measured)
        self._seen_requests: set[str] = set()
        # one writer at a time: a doc built before another thread's newer one must not land after it
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # nudge(): write the progress file now
        self._poll = poll_s if poll_s is not None else max(0.2, min(2.0, bound_s / 10 if bound_s else 2.0))
        threading.Thread(target=self._watch, name="hpcrl-progress", daemon=True).start()

    # -- reports (hot path: cheap) -----------------------------------------------------------------
    def moved(self, what: str = "") -> None:
        self.last = time.monotonic()
        if what:
            self.what = what

    def step(self, n: int, what: str = "") -> None:
        now = time.monotonic()
        if self._step_at is not None:
            self.step_times.append(now - self._step_at)
        self._step_at, self.step_no = now, n
        self.moved(what or f"step {n}")

    def waiting(self, on: str, peer: str | None = None) -> None:
        if on != self.on:
            self.on, self.on_since, self.peer = on, time.monotonic(), peer

    def done(self) -> None:
        self.on = None

    def nudge(self) -> None:
        """Write the progress file at once (not at the next refresh): `hpcrl status` shows it now."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- the thread ------------------------------------------------------------------------------
    def bound(self) -> float:
        if not self.step_times:
            return self.bound_s
        recent = sorted(self.step_times)[len(self.step_times) // 2]
        return max(self.bound_s, STEP_FACTOR * recent)

    def _watch(self) -> None:
        next_write, before = 0.0, time.monotonic()
        while True:
            self._wake.wait(self._poll)
            if self._stop.is_set():
                return
            if self._wake.is_set():
                self._wake.clear()
                next_write = 0.0
            try:
                now = time.monotonic()
                if now - before > max(SELF_FROZEN_S, 5 * self._poll):
                    # This thread did not run either: the whole process was stopped (SIGSTOP) or
                    # starved; blaming whoever it waited on would be wrong. Its clock restarts.
                    log.warning(
                        "%s: this process did not run for %.0f s (stopped, or starved of CPU)",
                        self.role,
                        now - before,
                    )
                    self.last = max(self.last, now)
                    self.on_since = now
                before = now
                idle = now - self.last
                if self.bound_s > 0:
                    self._check(now, idle)
                self._answer_requests()
                if now >= next_write:
                    self.write(now, idle)
                    next_write = now + WRITE_EVERY_S
            except Exception as e:  # noqa: BLE001 - reporting must never end the role
                log.debug("progress report failed: %s", e)

    def _check(self, now: float, idle: float) -> None:
        if self.stalled_since is not None:
            if idle < now - self.stalled_since:  # moved since the stall was named
                log.warning(
                    "%s: moving again (%s) after %.0f s without progress",
                    self.role,
                    self.what,
                    self.named_at + (now - self.stalled_since) - idle,
                )
                self.stalled_since = self.named_at = None
            return
        if idle <= self.bound():
            return
        who = self.culprit(idle) or self.describe_wait(now) or "it reports waiting on nothing"
        self.stalled_since, self.named_at = now, idle
        log.warning(
            "%s: no progress for %.0f s (last: %s); %s; stacks in %s",
            self.role,
            idle,
            self.what,
            who,
            self.stalls_dir or "the log",
        )
        self.write(now, idle, stall=who)
        self.dump_stacks("stall")
        self._request_stacks()

    def describe_wait(self, now: float) -> str | None:
        """ "waiting on <what> for N s", with the peer's own progress report when there is a peer."""
        parts = [
            f"waiting on {on} for {now - t:.0f} s" for on, t in list(self.refused.values()) if on != self.on
        ]
        if self.on is not None:
            text = f"waiting on {self.on} for {now - self.on_since:.0f} s"
            if self.peer and self.progress_dir is not None:
                text += "; " + report_of(self.progress_dir, self.peer)
            parts.insert(0, text)
        return "; ".join(parts) or None

    # -- stacks ------------------------------------------------------------------------------------
    def dump_stacks(self, why: str) -> Path | None:
        """This process's Python stacks (every thread) to logs/stalls/<role>-<pid>-<why>.txt."""
        if self.stalls_dir is None:
            return None
        self.stalls_dir.mkdir(parents=True, exist_ok=True)
        path = self.stalls_dir / f"{_safe(self.role)}-{os.getpid()}-{_safe(why)}-{int(time.time())}.txt"
        with open(path, "w") as f:
            f.write(f"# {self.role} pid {os.getpid()} at {time.strftime('%H:%M:%S')}: {why}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            for dump in self.dumpers:
                try:
                    dump(f)
                except Exception as e:  # noqa: BLE001 - best effort, from another thread
                    f.write(f"\n(could not dump more: {type(e).__name__}: {e})\n")
        return path

    def _request_stacks(self) -> None:
        if self.stalls_dir is None:
            return
        name = f"request-{_safe(self.role)}-{int(time.time() * 1000)}"
        self._seen_requests.add(name)
        (self.stalls_dir / name).write_text(f"{self.role} named a stall\n")

    def _answer_requests(self) -> None:
        """Another role named a stall: write our stacks too (once per request)."""
        if self.stalls_dir is None or not self.stalls_dir.is_dir():
            return
        for p in self.stalls_dir.glob("request-*"):
            if p.name not in self._seen_requests:
                self._seen_requests.add(p.name)
                self.dump_stacks(p.name)

    # -- the progress file -------------------------------------------------------------------------
    def write(self, now: float, idle: float, stall: str | None = None) -> None:
        if self.progress_dir is None:
            return
        with self._write_lock:
            self._write(now, idle, stall)

    def _write(self, now: float, idle: float, stall: str | None) -> None:
        from hpcrl.fileio import write_text

        doc = {
            "role": self.role,
            "pid": os.getpid(),
            "time": time.time(),
            "state": "stalled" if self.stalled_since is not None else "running",
            "step": self.step_no,
            "last": self.what,
            "idle_s": round(idle, 1),
            "bound_s": round(self.bound(), 1),
            "waiting_on": self.on,
            "waiting_s": round(now - self.on_since, 1) if self.on else None,
            "refused": [[on, round(now - t, 1)] for on, t in list(self.refused.values()) if on != self.on],
            "stall": stall,
            **self.extra(),
        }
        if stall is None and self.stalled_since is not None:
            doc["stall"] = self._last_stall
        self._last_stall = doc["stall"]
        write_text(self.progress_dir / f"{_safe(self.role)}.json", json.dumps(doc), durable=False)

    _last_stall: str | None = None


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)


def stacks_of_other(pid: int, name: str, stalls_dir: Path | None) -> str:
    """Stacks of a process that cannot answer (frozen, blocked): py-spy where installed and permitted,
    else a sentence saying why not. Returns where they went or why there are none."""
    spy = shutil.which("py-spy")
    if spy is None:
        return f"no stacks of {name} (pid {pid}): py-spy is not installed"
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no stacks of {name} (pid {pid}): py-spy failed: {e}"
    if out.returncode != 0:
        why = " ".join((out.stderr or out.stdout).split())[:200]
        return f"no stacks of {name} (pid {pid}): py-spy refused ({why})"
    if stalls_dir is None:
        return out.stdout
    stalls_dir.mkdir(parents=True, exist_ok=True)
    path = stalls_dir / f"{_safe(name)}-{pid}-py-spy.txt"
    path.write_text(out.stdout)
    return f"stacks of {name} in {path}"


# -- the process's Progress --------------------------------------------------------------------------
_current: Progress | None = None


def start(role: str, progress_dir: Path | None, stalls_dir: Path | None, bound_s: float) -> Progress:
    global _current
    if _current is not None:
        _current.stop()
    _current = Progress(role, progress_dir, stalls_dir, bound_s)
    from hpcrl import storage  # a write the storage policy retries shows in the stall line and in status

    storage.report_to(_storage_waiting, _storage_done)
    return _current


def _storage_waiting(what: str, on: str) -> None:
    """A refused write (hpcrl.storage): what the role waits on, in its progress file at once. Kept
    apart too (`refused`): the main loop's next wait must not hide a write a background thread (a
    checkpoint's finaliser) still retries."""
    if _current is not None:
        _current.waiting(on)
        _current.refused[what] = (on, _current.refused.get(what, (on, time.monotonic()))[1])
        _current.nudge()


def _storage_done(what: str) -> None:
    if _current is not None:
        on, _ = _current.refused.pop(what, (None, 0.0))
        if _current.on == on:  # not a wait the role took up since
            _current.done()
        _current.nudge()


def current() -> Progress | None:
    return _current


def moved(what: str = "") -> None:
    if _current is not None:
        _current.moved(what)


def step(n: int, what: str = "") -> None:
    if _current is not None:
        _current.step(n, what)


def waiting(on: str, peer: str | None = None) -> None:
    if _current is not None:
        _current.waiting(on, peer)


def done() -> None:
    if _current is not None:
        _current.done()


def report_of(progress_dir: Path, role_prefix: str) -> str:
    """What a peer role's progress file says, and how long ago it was written: a process whose
    file stopped being refreshed cannot run its threads (frozen, or gone)."""
    rows = [r for r in read_progress(progress_dir) if str(r.get("role", "")).startswith(role_prefix)]
    if not rows:
        return f"the {role_prefix} has not reported progress"
    r = max(rows, key=lambda r: r["age_s"])  # the one that reported longest ago
    state = "unresponsive" if r["age_s"] > STALE_S else r.get("state", "running")
    return f"{r['role']} {state}, last reported {r['age_s']:.0f} s ago (last: {r.get('last')})"


def read_progress(progress_dir: Path) -> list[dict]:
    """Every role's newest progress file, with `age_s` (how long ago it was written): a file that
    stopped being refreshed is a process that cannot run its threads (frozen, or gone)."""
    rows = []
    for p in sorted(progress_dir.glob("*.json")) if progress_dir.is_dir() else []:
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        doc["age_s"] = max(0.0, time.time() - float(doc.get("time", 0)))
        rows.append(doc)
    return rows
