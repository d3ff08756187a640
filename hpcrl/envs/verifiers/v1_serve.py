"""The processes of a verifiers v1 env server (see hpcrl.envs.verifiers.v1_env) and their tie to their owner.

`serve` is what V1Environment spawns: verifiers' own `serve_env` (a lone EnvServer, or an
EnvServerPool broker over spawned workers), run unchanged. verifiers guards each spawned process
with a death pipe only (EOF -> one SIGTERM -> KeyboardInterrupt -> teardown). That pipe keeps a
server alive as long as any process holds the owner's end (a fork of the owner inherits it), and a
teardown that stalls after the SIGTERM is never ended (verifiers ignores every later SIGTERM): the
server and its workers were seen running as orphans (PPID 1) hours after a run. So each process of
the tree also gets hpcrl.envs.runtime.lifeline.die_with_parent: SIGTERM when its parent dies, SIGKILL
GRACE_S later. The pool's workers get it through `serve_worker`, the target EnvServerPool spawns
them with once `serve` has put it in place of the module's `serve_env` (the pool looks that name
up when it spawns, and its spawned workers unpickle the target by name).

`stop_server` is the owner's side: close the death pipe, SIGTERM, wait, SIGKILL. V1Environment
registers it as a multiprocessing finalizer, so it also runs at interpreter exit *before*
multiprocessing joins its non-daemon children: without it, an owner whose V1Environment was still
alive at exit (kept by a reference cycle the garbage collector had not reached) waited in that
join for a server that waited for the owner's end of the death pipe to close: a deadlock.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

GRACE_S = 5.0  # SIGTERM -> SIGKILL, for a server (or worker) whose owner died
STOP_S = 10.0  # the owner waits this long for a server it stops, then kills it
PARENT_ENV = "HPCRL_V1_SERVER"  # "<pid> <grace_s>" of the broker, for its workers


def serve(parent: int, grace_s: float = GRACE_S, **kwargs: Any) -> None:
    """The spawned env server: verifiers' serve_env(**kwargs), tied to `parent` and with every pool
    worker it spawns tied to this process."""
    from hpcrl.envs.runtime.lifeline import die_with_parent

    os.setsid()  # the orchestrator's signals are not its own (hpcrl.envs.runtime.hosting.popen_server)
    die_with_parent(parent, grace_s)
    os.environ[PARENT_ENV] = f"{os.getpid()} {grace_s}"  # spawned workers inherit the environment
    from verifiers.v1.serve import pool

    serve_env = pool.serve_env
    pool.serve_env = serve_worker  # EnvServerPool._spawn_worker's target (looked up at each spawn)
    serve_env(**kwargs)


def serve_worker(**kwargs: Any) -> None:
    """A pool worker: verifiers' serve_env (max_workers=1, its own EnvServer), tied to the broker."""
    from hpcrl.envs.runtime.lifeline import die_with_parent

    parent, grace_s = os.environ[PARENT_ENV].split()
    die_with_parent(int(parent), float(grace_s))
    from verifiers.v1.serve.pool import serve_env

    serve_env(**kwargs)


def stop_server(proc: Any, death: Any, timeout_s: float = STOP_S) -> None:
    """Stop a spawned server (a multiprocessing Process) within ~timeout_s + 5 s: close our end of its
    death pipe and SIGTERM it (verifiers' teardown stops its workers), SIGKILL it if still running.
    Workers of a killed broker follow it through their own ties (see the module doc)."""
    with contextlib.suppress(OSError):
        death.close()
    if proc.is_alive():
        proc.terminate()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def worker_pids(server: int) -> list[int]:
    """The pool workers of a running server: its children that multiprocessing spawned (a lone server's
    children are its runtime's programs, not workers)."""
    pids: list[int] = []
    for task in Path(f"/proc/{server}/task").glob("*"):
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    out = []
    for pid in sorted(set(pids)):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def exited(pid: int) -> bool:
    """True once `pid` has exited (gone, or a zombie its parent has not reaped)."""
    from hpcrl.envs.runtime.components import alive

    return alive(pid, None) == "exited"
