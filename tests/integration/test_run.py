"""`hpcrl run` as a user runs it: every role a real process on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.integration.tiny_run import TINY_RL

CONFIG = TINY_RL


def _cfg(tmp: Path, steps: int) -> Path:
    p = tmp / "cfg.toml"
    p.write_text(CONFIG.format(steps=steps))
    return p


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_fsdp_ranks_two_servers_collective_weights(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        _hpcrl(
            "run",
            str(_cfg(tmp_path, 3)),
            "--output-dir",
            str(out),
            "--ckpt",
            "--deployment.num-trainer-ranks",
            "2",
            "--deployment.num-inference-servers",
            "2",
            "--trainer.broadcast.transport",
            "collective",
        ),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    paths = RunPaths(out)
    assert "step    3/3" in r.stdout and "hpcrl: run finished" in r.stdout
    # [log] plots = false (the tests' base config): no PNGs, no "plots:" line; the demo test sees them
    assert "plots:" not in r.stdout + r.stderr and not list(paths.plots_dir.glob("*.png"))
    assert checkpoint.latest_complete(paths) == 3
    assert sorted(p.name for p in paths.trainer_ckpt_dir(3).glob("rank_*.json")) == [
        "rank_0.json",
        "rank_1.json",
    ]
    orch = paths.log_file("orchestrator").read_text()
    assert "policy 3 loaded on 2 server(s) (checksum verified" in orch
    assert "collective" in paths.log_file("trainer").read_text()
    trainer = [m for m in read_metrics(paths.metrics_file) if m["role"] == "trainer" and "loss/mean" in m]
    assert [m["step"] for m in trainer] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(paths.weights_dir(3)))


@pytest.mark.timeout(300)
def test_a_dying_role_stops_the_run_and_is_named(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        _hpcrl("run", str(_cfg(tmp_path, 200)), "--output-dir", str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    paths = RunPaths(out)
    deadline = time.monotonic() + 180
    while not paths.prompts_log.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert paths.prompts_log.exists(), "the run never published a batch"
    info = json.loads(paths.job_file.read_text())
    assert info["target"] == "local" and info["pid"] == launcher.pid
    # The orchestrator is the launcher's child whose command line says so.
    pids = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and b"orchestrator" in (p / "cmdline").read_bytes()
        and str(out).encode() in (p / "cmdline").read_bytes()
    ]
    assert pids
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    stdout, stderr = launcher.communicate(timeout=60)
    assert time.monotonic() - t0 < 20, "the other processes were not stopped within seconds"
    assert launcher.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "orchestrator was killed by signal 9" in last and str(paths.log_file("orchestrator")) in last
    time.sleep(0.5)
    leftovers = [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(out).encode() in _safe_read(p / "cmdline")
    ]
    assert not leftovers, "processes outlived the run"


def _safe_read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""
