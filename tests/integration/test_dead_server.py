"""A dead inference server under `hpcrl run`: restarted by the launcher, brought back by the
orchestrator (current policy loaded and verified), its requests moved to the other server meanwhile;
and a server that never answers again ends the run within orchestrator.server_down_timeout_s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.integration.tiny_run import SLOW_RL, TINY_RL


def _start(tmp: Path, steps: int, *flags: str, config: str = TINY_RL) -> tuple[subprocess.Popen, RunPaths]:
    cfg = tmp / "cfg.toml"
    cfg.write_text(config.format(steps=steps))
    out = tmp / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, RunPaths(out)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _published_steps(paths: RunPaths) -> int:
    return len(paths.prompts_log.read_text().splitlines()) if paths.prompts_log.exists() else 0


def _server_pid(paths: RunPaths, index: int) -> int:
    return json.loads(paths.server_file(index).read_text())["pid"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("dead_server")  # one after the other: each mostly sleeps, beside busier tests
@pytest.mark.parametrize("transport", ["filesystem", "collective"])
def test_kill_9_of_one_of_two_servers_mid_run_reaches_max_steps(tmp_path: Path, transport: str) -> None:
    steps = 30  # ~50 s: long enough for the restarted server to come back
    launcher, paths = _start(
        tmp_path,
        steps,
        "--deployment.num-inference-servers",
        "2",
        "--trainer.broadcast.transport",
        transport,
        config=SLOW_RL,
    )
    try:
        _wait(lambda: _published_steps(paths) >= 2, 240, "two published batches")
        victim = _server_pid(paths, 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = _published_steps(paths)
        stdout, stderr = launcher.communicate(timeout=480)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert f"step {steps:4d}/{steps}" in stdout and "hpcrl: run finished" in stdout
    assert "inference[1] was killed by signal 9; restarting it (1/5)" in stdout
    assert _server_pid(paths, 1) != victim  # a new process announced itself
    orch = paths.log_file("orchestrator").read_text()
    assert "inference server 1 (" in orch and "is down" in orch
    assert "is back (pid" in orch and "policy loaded and verified" in orch
    rows = [
        m
        for m in read_metrics(paths.metrics_file)
        if m["role"] == "orchestrator" and "inference/server_restarts" in m
    ]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    assert rows[-1]["inference/server_restarts"] == 1 and rows[-1]["inference/servers_up"] == 2
    assert min(m["inference/servers_up"] for m in rows) == 1  # steps were trained on one server meanwhile
    assert killed_at < steps, "the run ended before the kill mattered: make it longer"
    # After it came back, policies were loaded into both servers again.
    back = orch.index("is back (pid")
    assert "loaded on 2 server(s)" in orch[back:]
    if transport == "collective":  # the group cannot take the new process in: files from then on
        assert "policies travel as files" in orch
        assert "as files" in paths.log_file("trainer").read_text()
        assert paths.weights_fallback_file.exists()


@pytest.mark.waits  # for server_down_timeout_s
@pytest.mark.timeout(300)
def test_the_only_server_never_answering_again_ends_the_run_naming_it(tmp_path: Path) -> None:
    # SIGSTOP: the process lives (so its supervisor does not restart it) but never answers again.
    launcher, paths = _start(
        tmp_path, 200, "--orchestrator.server-down-timeout-s", "8", "--orchestrator.request-timeout-s", "4"
    )
    stopped = None
    try:
        _wait(lambda: _published_steps(paths) >= 1, 240, "a published batch")
        stopped = _server_pid(paths, 0)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert launcher.returncode == 1, stdout[-2000:] + stderr[-2000:]
    # detection (request timeout 4 s + 2 s probe) + 8 s down timeout + stopping the others
    assert took < 4 + 2 + 8 + 15, took
    last = stderr.strip().splitlines()[-1]
    assert "orchestrator exited with code 1" in last
    assert "inference server 0 (http://127.0.0.1:" in last and "did not come back within 8s" in last
    assert "orchestrator.server_down_timeout_s" in last
