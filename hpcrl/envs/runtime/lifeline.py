"""A child process ends when its parent does, whatever the parent died of (kill -9 included) and
whatever the child is doing (env code blocking its event loop, a teardown that never finishes).

Two ties, both needed: the kernel's parent-death signal (PR_SET_PDEATHSIG, Linux) fires at once,
and a watcher thread polls getppid() for a parent that died before the prctl, a platform without
it, or a child whose own handling of that signal stalls. The signal is delivered when the *thread*
that started the child exits: start these children from a thread that lives as long as its process
(the main thread / event loop), never from a short-lived worker thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("hpcrl.envs")

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def _parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):  # not Linux: the watcher thread alone
        pass


def die_with_parent(parent: int, grace_s: float | None = None) -> None:
    """Tie this process to `parent` (its pid as the child knows it at start).

    grace_s None: die at once (SIGKILL from the kernel, else os._exit). With grace_s: SIGTERM at once,
    so the process's own teardown runs (verifiers' servers turn it into KeyboardInterrupt and close
    their runtimes), then SIGKILL `grace_s` later if that teardown has not ended it; verifiers ignores
    every SIGTERM after the first, so only this bound ends a teardown that stalls."""
    _parent_death_signal(signal.SIGKILL if grace_s is None else signal.SIGTERM)
    if grace_s is None and os.getppid() != parent:  # died before the prctl: the kernel will not tell us
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        log.warning("parent process %d is gone: exiting", parent)
        if grace_s is None:
            os._exit(0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.warning("still running %.0f s after its parent died: killing it", grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()
