"""Liveness of a role: a hard exit deadline after SIGTERM, and a no-progress watchdog.

SLURM SIGKILLs a step KillWait (often 30 s) after SIGTERM, and a role stuck in a collective or a
blocked event loop never reaches its own exit path. Both helpers run on a daemon thread, so they work
while the main thread (or the asyncio loop) is stuck, and end the process with `os._exit`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("hpcrl.watchdog")

TERM_DEADLINE_ENV = "HPCRL_TERM_DEADLINE_S"
TERM_DEADLINE_S = 9.0  # under the 10 s every role promises; leaves SLURM's KillWait unused
EXIT_TERM = 143
EXIT_STALLED = 3

_armed = threading.Lock()

# Told (exit code, the line) just before a watchdog or the SIGTERM deadline ends the process, which
# os._exit does without atexit or `finally`: `hpcrl sft`, its rank in its own process, records it as
# what ended the run (hpcrl.launch.sft). A hook, not an import: this module imports no launcher.
_last_words: list[Callable[[int, str], None]] = []
LAST_WORDS_S = 5.0  # a hung filesystem under a hook must not keep the process from ending


def on_exit(fn: Callable[[int, str], None]) -> None:
    _last_words.append(fn)


def say_last(code: int, line: str, timeout_s: float = LAST_WORDS_S) -> None:
    """Every on_exit hook with (code, line), for at most `timeout_s` in all; a hook's error is its own."""

    def say() -> None:
        for fn in list(_last_words):
            try:
                fn(code, line)
            except Exception:  # noqa: BLE001 - the process ends next whatever a hook does
                pass

    t = threading.Thread(target=say, name="hpcrl-last-words", daemon=True)
    try:
        t.start()  # 3.12 refuses a new thread at interpreter shutdown: no last words then
    except RuntimeError:
        return
    t.join(timeout_s)


def _exit(code: int, line: str) -> NoReturn:
    try:
        say_last(code, line)
    finally:  # whatever the hooks do, the process ends: that is what this exit is for
        os._exit(code)


def term_deadline_s() -> float:
    try:
        return max(0.5, float(os.environ.get(TERM_DEADLINE_ENV, TERM_DEADLINE_S)))
    except ValueError:
        return TERM_DEADLINE_S


def arm_exit_deadline(role: str, seconds: float | None = None) -> None:
    """After a SIGTERM: exit with 143 in `seconds` unless the process has exited by then (idempotent)."""
    if not _armed.acquire(blocking=False):
        return
    wait = term_deadline_s() if seconds is None else seconds

    def expire() -> None:
        time.sleep(wait)
        line = f"{role}: still running {wait:.0f} s after SIGTERM; exiting now"
        log.error("%s (stacks follow)", line)
        _dump_stacks()
        _exit(EXIT_TERM, line)

    threading.Thread(target=expire, name="hpcrl-term-deadline", daemon=True).start()


def _dump_stacks() -> None:
    for h in logging.getLogger().handlers:
        stream = getattr(h, "stream", None)
        if stream is not None:
            try:
                h.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
                return
            except (OSError, ValueError, AttributeError):
                continue
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


class Watchdog:
    """`beat(what)` whenever the role makes progress; no beat for `timeout_s` names the role and what
    it last did in the log, dumps every thread's stack, and ends the process (the launcher / SLURM
    script then ends the job instead of holding the allocation)."""

    def __init__(self, role: str, timeout_s: float, poll_s: float | None = None):
        self.role, self.timeout_s = role, timeout_s
        self.last, self.what = time.monotonic(), "started"
        self._stop = threading.Event()
        self._poll = poll_s if poll_s is not None else max(0.1, min(5.0, timeout_s / 10))
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="hpcrl-watchdog", daemon=True).start()

    def beat(self, what: str = "") -> None:
        self.last = time.monotonic()
        if what:
            self.what = what

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                line = f"watchdog: {self.role} made no progress for {idle:.0f} s (last: {self.what}); ending the job"
                log.error("%s", line)
                _dump_stacks()
                _exit(EXIT_STALLED, line)


# -- the process's watchdog: one per role process, beaten from wherever the role makes progress ----
_process_dog: Watchdog | None = None


def start(role: str, timeout_s: float) -> Watchdog:
    """This process's watchdog (config field watchdog_s; 0 = off). Deep code calls `beat(...)`
    without being handed the object."""
    global _process_dog
    if _process_dog is not None:
        _process_dog.stop()
    _process_dog = Watchdog(role, timeout_s)
    if timeout_s > 0:
        log.info("watchdog: %s ends itself after %.0f s without progress", role, timeout_s)
    return _process_dog


def stop() -> None:
    """No watchdog from here on: what is left is bounded otherwise (SFT's wait for its online evals,
    which run under their own timeouts)."""
    if _process_dog is not None:
        _process_dog.stop()


def beat(what: str = "") -> None:
    """Progress of this process (no-op without a watchdog)."""
    if _process_dog is not None:
        _process_dog.beat(what)
