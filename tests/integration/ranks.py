"""Run a test file as a script on N gloo ranks (torchrun-style environment), for the trainer's
distributed tests: the ranks go through the same ``init_distributed`` / FSDP2 code as a real trainer."""

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
from pathlib import Path

from hpcrl.net import free_port
from hpcrl.runtime import rank_env

REPO = Path(__file__).resolve().parents[2]


def run_ranks(script: str, world: int, *args: str, timeout: float = 240) -> list[str]:
    """Start ``python script *args`` as ranks 0..world-1 and wait; fail with the failing rank's output.
    Returns every rank's output. The ranks are forks of a warm interpreter (tests/integration/zygote.py)
    unless HPCRL_TEST_ZYGOTE=0, which starts each as a fresh ``python``."""
    port = free_port()
    procs, logs = [], []
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for rank in range(world):
        env = {
            **os.environ,
            **rank_env(rank, world, "127.0.0.1", port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        fd, log = tempfile.mkstemp(prefix=f"rank{rank}-", suffix=".log", dir=log_dir)
        os.close(fd)
        logs.append(Path(log))
        procs.append(start_rank(script, list(args), env, log))
    deadline = time.monotonic() + timeout
    try:
        # A rank that fails leaves the others blocked in a collective: stop them at once.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        outs.append(log.read_text(errors="replace"))
        log.unlink()
    for rank, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-4000:]}"
    return outs


def start_rank(script: str, args: list[str], env: dict[str, str], log: str):
    """Start ``python script *args`` with `env`, its output to `log`: a fork of the zygote, or (with
    HPCRL_TEST_ZYGOTE=0) a fresh interpreter. The result has Popen's poll / wait / kill / returncode."""
    if os.environ.get("HPCRL_TEST_ZYGOTE", "1") == "0":
        with open(log, "w") as fh:
            return subprocess.Popen(
                [sys.executable, script, *args], env=env, stdout=fh, stderr=subprocess.STDOUT
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


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
