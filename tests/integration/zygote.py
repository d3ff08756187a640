"""A warm interpreter that forks the gloo ranks of the distributed tests (tests/integration/ranks.py).

Every rank of those tests used to be a fresh ``python script``: ~5 CPU-seconds of importing torch,
torch._dynamo (AdamW's first step), torch.distributed.tensor and transformers before its first line
of work, on a 2-core CI machine where the suite is CPU-bound. This process imports them once; each
rank is then a ``fork`` of it that runs the same script as ``__main__`` (``runpy``), with the rank's
environment, argv and log file, and ends with the script's exit status: the code under test is the
same, only its start-up is shared. Forking after ``import torch`` is what torch's own DataLoader
workers do; nothing here runs a torch op or starts a thread before forking.

Protocol (one JSON object per line): the test writes ``{"script", "args", "env", "log", "cwd"}`` on the
zygote's stdin and reads ``{"pid"}`` back, then ``{"exit": pid, "rc"}`` when that rank ends (``rc``
as ``Popen.returncode``: negative for a signal). EOF on stdin ends the zygote.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import select
import signal
import sys
import traceback

PRELOAD = (
    "numpy",
    "safetensors.torch",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "transformers",
    "hpcrl.trainer.parallel",
    "hpcrl.trainer.packing",
    "hpcrl.trainer.loss",
    "hpcrl.trainer.model",
    "hpcrl.models.parallelize",
)


def _child(job: dict, channel: tuple[int, int]) -> None:
    """In the forked rank: become ``python script *args`` with the job's environment and log, run
    it, and leave with its status (atexit handlers and stream flushes as at a normal exit)."""
    for fd in channel:
        os.close(fd)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # every thread's Python stack into the log on SIGUSR1 (ranks.DUMP_SIGNAL): what a rank that
    # hangs was doing, even inside a blocked collective
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    script = job["script"]
    sys.argv = [script, *job["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _fresh_random_state()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a crashed rank reports like a crashed interpreter
        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fresh_random_state() -> None:
    """A fresh process draws new seeds; a fork would share the zygote's."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def serve() -> None:
    rd, wr = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # stray prints of imported modules go to stderr, not into the protocol
    for name in PRELOAD:
        __import__(name)
    out = os.fdopen(wr, "w", buffering=1)
    pending = b""
    alive: set[int] = set()
    while True:
        ready, _, _ = select.select([rd], [], [], 0.05)
        if ready:
            chunk = os.read(rd, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), (rd, wr))
                alive.add(pid)
                out.write(json.dumps({"pid": pid}) + "\n")
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                out.write(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
