"""Run a test file as a script on N gloo ranks (torchrun-style environment), for the trainer's
distributed tests: the ranks go through the same ``init_distributed`` / FSDP2 code as a real trainer.

Every launch is bounded and says why it failed: a rank that exits non-zero stops the others at once
(they would wait in a collective for it until gloo's timeout, 30 min); ranks still running at the
deadline first write their Python stacks to their logs (faulthandler on SIGUSR1), then are killed;
the failure names every rank's state with the tail of its log.

The rendezvous store is this test process's, as torchrun's agent hosts it
(``TORCHELASTIC_USE_AGENT_STORE``: every rank joins as a client), bound to a port of the kernel's
choice and held until the ranks end. With rank 0 hosting it on a ``free_port()`` the port was free
only when picked: another process's socket (a concurrent test's gloo listener or server, under
pytest-xdist) could take it before rank 0 bound it; rank 0 then failed with EADDRINUSE and the other
ranks, connected to that stranger, waited past any timeout (reproduced: > 90 s at a 60 s timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpcrl.runtime import rank_env

REPO = Path(__file__).resolve().parents[2]
DUMP_SIGNAL = signal.SIGUSR1  # a rank writes every thread's Python stack to its log on it
TAIL = 4000  # characters of a rank's log in a failure message


def run_ranks(script: str, world: int, *args: str, timeout: float = 240) -> list[str]:
    """Start ``python script *args`` as ranks 0..world-1 and wait; fail with the failing rank's output.
    Returns every rank's output. The ranks are forks of a warm interpreter (tests/integration/zygote.py)
    unless HPCRL_TEST_ZYGOTE=0, which starts each as a fresh ``python``."""
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    logs: list[Path] = []
    for rank in range(world):
        fd, name = tempfile.mkstemp(prefix=f"rank{rank}-", suffix=".log", dir=log_dir)
        os.close(fd)
        logs.append(Path(name))
    try:
        wait_ranks(Ranks(script, list(args), logs), timeout=timeout)
        return [log.read_text(errors="replace") for log in logs]
    finally:
        for log in logs:
            log.unlink(missing_ok=True)


@dataclass
class _Rank:
    name: str
    proc: Any  # Popen or _Forked
    log: Path
    stopped: bool = False  # killed by wait_ranks (not its own exit)


class Ranks:
    """``python script *args`` started as ranks 0..len(logs)-1 of one group, rank r's output to
    ``logs[r]``, around a rendezvous store this process hosts. Wait with `wait_ranks`."""

    def __init__(
        self, script: str, args: list[str], logs: list[Path], name: str = "", command: list[str] | None = None
    ) -> None:
        """With `command`, each rank is that command (`python -m hpcrl.cli trainer …`) in a fresh
        process instead of `python script *args`."""
        from torch.distributed import TCPStore

        world = len(logs)
        # port 0: the kernel's pick, bound at once, so no other socket can take it before the ranks come
        store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
        self.store: TCPStore | None = store
        self.ranks: list[_Rank] = []
        try:
            for rank, log in enumerate(logs):
                env = {
                    **os.environ,
                    **rank_env(rank, world, "127.0.0.1", store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",  # torch: every rank a client of our store
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                }
                proc = (
                    start_rank(script, args, env, str(log)) if command is None else _start(command, env, log)
                )
                self.ranks.append(_Rank(f"{name}rank {rank}", proc, Path(log)))
        except BaseException:
            self.stop()
            raise

    def stop(self, dump: bool = False) -> None:
        """Kill the ranks still running (after a stack dump into their logs with `dump`)."""
        running = [r for r in self.ranks if r.proc.poll() is None]
        if dump and running:
            for r in running:
                r.proc.send_signal(DUMP_SIGNAL)
            time.sleep(2)  # the dump is written from the signal handler, even in a blocked collective
        for r in running:
            if r.proc.poll() is None:
                r.stopped = True
                r.proc.kill()
            r.proc.wait()
        self.store = None  # every rank has ended: close the rendezvous port


def wait_ranks(*groups: Ranks, timeout: float) -> None:
    """Wait for every rank of `groups` to exit 0. A rank that exits otherwise stops all the others at
    once; at `timeout` s those still running dump their stacks and are killed. Fails naming every
    rank's state, with the tail of the logs of those that failed or were stopped."""
    ranks = [r for g in groups for r in g.ranks]
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(r.proc.poll() is None for r in ranks):
            if any(r.proc.returncode not in (None, 0) for r in ranks):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for g in groups:
            g.stop(dump=timed_out)
    bad = [r for r in ranks if r.proc.returncode != 0]
    if not bad:
        return
    # the ranks that failed on their own first: the cause; then those stopped (their stacks)
    bad.sort(key=lambda r: r.stopped)
    head = (
        f"{len(bad)} rank(s) still running after {timeout:.0f} s, killed after a stack dump"
        if timed_out
        else "a rank failed; the others were stopped"
    )
    states = ", ".join(
        f"{r.name}: {'stopped' if r.stopped else f'exited {r.proc.returncode}'}" for r in ranks
    )
    parts = [f"{head} ({states})"]
    for r in bad:
        text = r.log.read_text(errors="replace") if r.log.exists() else "(no log)"
        how = "stopped, still running" if r.stopped else f"exited {r.proc.returncode}"
        parts.append(f"--- {r.name} {how} ({r.log}):\n{text[-TAIL:]}")
    raise AssertionError("\n".join(parts))


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)


# A fresh interpreter's rank (HPCRL_TEST_ZYGOTE=0): `python script *args` with the zygote's stack dump.
_BOOT = (
    "import faulthandler, os, runpy, signal, sys; "
    f"faulthandler.register(signal.Signals({int(DUMP_SIGNAL)}), all_threads=True); "
    "sys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def start_rank(script: str, args: list[str], env: dict[str, str], log: str):
    """Start ``python script *args`` with `env`, its output to `log`: a fork of the zygote, or (with
    HPCRL_TEST_ZYGOTE=0) a fresh interpreter. The result has Popen's poll / wait / kill / send_signal
    / returncode; either way the rank writes its Python stacks to `log` on DUMP_SIGNAL."""
    if os.environ.get("HPCRL_TEST_ZYGOTE", "1") == "0":
        with open(log, "w") as fh:
            return subprocess.Popen(
                [sys.executable, "-c", _BOOT, script, *args], env=env, stdout=fh, stderr=subprocess.STDOUT
            )
    return _zygote().start(script, args, env, log)


class _Forked:
    """A rank forked by the zygote, with the part of Popen's interface run_ranks uses."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, block=False)
        return self.returncode

    def wait(self, timeout: float = 60) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, block=True, timeout=timeout)
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this rank's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class _Zygote:
    """This test process's warm interpreter (one per pytest worker, started at first use)."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        self.cond = threading.Condition()
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "pid" in msg:
                    self.pids.append(msg["pid"])
                else:
                    self.exits[msg["exit"]] = msg["rc"]
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def start(self, script: str, args: list[str], env: dict[str, str], log: str) -> _Forked:
        job = {"script": os.path.abspath(script), "args": args, "env": env, "log": log, "cwd": os.getcwd()}
        with self.cond:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: self.pids or self.proc.poll() is not None, timeout=300):
                raise RuntimeError("the test zygote did not answer in 300 s")
            if not self.pids:
                raise RuntimeError(f"the test zygote exited {self.proc.returncode}")
            return _Forked(self, self.pids.pop(0))

    def exit_code(self, pid: int, *, block: bool, timeout: float = 60) -> int | None:
        with self.cond:
            if block:
                self.cond.wait_for(lambda: pid in self.exits or self.proc.poll() is not None, timeout=timeout)
            return self.exits.get(pid)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def two_rank_batch(
    rank: int, vocab: int, seed: int, lens: tuple[int, int], step: int = 1, logprob: float = -4.0
):
    """Rank ``rank`` of 2's random 4-sample TrainBatch (second half of each sample trained), the
    loss normalised by both ranks' loss tokens, as the orchestrator would. ``seed + rank`` seeds it."""
    import msgspec
    import numpy as np

    from hpcrl.bus import TrainBatch

    def one(r: int) -> TrainBatch:
        rng = np.random.default_rng(seed + r)
        n = rng.integers(lens[0], lens[1], size=4)
        mask = np.concatenate([np.arange(k) >= k // 2 for k in n])
        return TrainBatch(
            step=step,
            rank=r,
            world_size=2,
            input_ids=rng.integers(3, vocab, size=int(n.sum())),
            position_ids=np.concatenate([np.arange(k) for k in n]),
            seq_lens=n,
            loss_mask=mask,
            advantages=(rng.normal(size=mask.size) * mask).astype(np.float32),
            inference_logprobs=np.where(mask, logprob, 0.0).astype(np.float32),
            policy_versions=np.zeros(4),
            temperatures=np.ones(4),
            env_names=["x"] * 4,
            example_ids=np.arange(4),
            rewards=np.zeros(4),
            total_loss_tokens=0,
        )

    total = sum(int(one(r).loss_mask.sum()) for r in range(2))
    return msgspec.structs.replace(one(rank), total_loss_tokens=total)
