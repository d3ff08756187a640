"""Run a test file as a script on N gloo ranks (torchrun-style environment), for the trainer's
distributed tests: the ranks go through the same ``init_distributed`` / FSDP2 code as a real trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcrl.net import free_port
from hpcrl.runtime import rank_env

REPO = Path(__file__).resolve().parents[2]


def run_ranks(script: str, world: int, *args: str, timeout: float = 240) -> list[str]:
    """Start ``python script *args`` as ranks 0..world-1 and wait; fail with the failing rank's output.
    Returns every rank's output."""
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
        log = tempfile.TemporaryFile("w+", dir=log_dir)  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen([sys.executable, script, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    deadline = time.monotonic() + timeout
    try:
        # A rank that fails leaves the others blocked in a collective: stop them at once.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    for rank, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-4000:]}"
    return outs


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
