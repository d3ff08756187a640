"""hpcrl.launch.keepalive (what the SLURM server step runs) with real processes: a killed server is
started again in place (its stale address file removed), SIGTERM stops it without a restart, and a
server that keeps dying ends the task once the restarts are used up."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.launch.keepalive import max_restarts_of, restart_delay
from hpcrl.paths import RunPaths

# Each run appends its pid to runs.txt and writes the "address file"; the first run SIGKILLs itself,
# later ones wait to be stopped.
SERVER = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # before it says it runs: the test may stop it then
runs, addr = Path(sys.argv[1]), Path(sys.argv[2])
n = len(runs.read_text().split()) if runs.exists() else 0
with open(runs, "a") as f:
    f.write(f"{os.getpid()}\\n")
addr.parent.mkdir(parents=True, exist_ok=True)
addr.write_text(str(os.getpid()))
if n == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _keepalive(tmp: Path, script: str, *flags: str) -> subprocess.Popen:
    (tmp / "server.py").write_text(script)
    addr = RunPaths(tmp / "run").server_file(0)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcrl.launch.keepalive",
            *flags,
            "--run-dir",
            str(tmp / "run"),
            "--server-index",
            "0",
            "--",
            sys.executable,
            str(tmp / "server.py"),
            str(tmp / "runs.txt"),
            str(addr),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def _runs(tmp: Path) -> list[str]:
    p = tmp / "runs.txt"
    return p.read_text().split() if p.exists() else []


@pytest.mark.timeout(60)
def test_a_killed_server_is_restarted_in_place_and_sigterm_stops_it(tmp_path: Path) -> None:
    ka = _keepalive(tmp_path, SERVER, "--max-restarts", "3")
    deadline = time.monotonic() + 30
    while len(_runs(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    runs = _runs(tmp_path)
    assert len(runs) == 2, runs
    addr = RunPaths(tmp_path / "run").server_file(0)
    deadline = time.monotonic() + 5
    while not (addr.exists() and addr.read_text() == runs[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert addr.read_text() == runs[1]  # the new process's address, the dead one's was removed
    ka.send_signal(signal.SIGTERM)
    out, _ = ka.communicate(timeout=20)
    assert ka.returncode == 143, out
    assert "inference server 0 was killed by signal 9; restarting it (1/3) in 1s" in out
    assert len(_runs(tmp_path)) == 2  # stopped, not restarted


@pytest.mark.timeout(60)
def test_a_server_that_keeps_dying_ends_the_task_after_its_restarts(tmp_path: Path) -> None:
    cfg = tmp_path / "inference.toml"
    cfg.write_text("[deployment]\nmax_server_restarts = 2\n")
    assert max_restarts_of(cfg) == 2
    ka = _keepalive(
        tmp_path, "import sys; open(sys.argv[1], 'a').write('x\\n'); sys.exit(7)", "--config", str(cfg)
    )
    out, _ = ka.communicate(timeout=30)
    assert ka.returncode == 7
    assert len(_runs(tmp_path)) == 3  # the first run and two restarts
    assert "restarting it (2/2) in 2s" in out and "exited with code 7; 2 restart(s) used, giving up" in out


def test_restart_backoff_doubles_and_is_capped() -> None:
    assert [restart_delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


# Never exits by itself: it appends its pid to runs.txt and sleeps until killed or stopped.
FOREVER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # before it says it runs
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(120)
"""


def _wait_runs(tmp: Path, n: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(_runs(tmp)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return _runs(tmp)


@pytest.mark.timeout(60)
def test_a_kill_order_for_the_running_pid_kills_and_restarts_it_and_a_stale_one_is_dropped(
    tmp_path: Path,
) -> None:
    """What the orchestrator's kill order does on the server's node (a server frozen past
    orchestrator.server_down_timeout_s on another host): the named pid is killed and restarted as a
    crashed one; an order naming a pid that is not the running server is removed unexecuted."""
    order = RunPaths(tmp_path / "run").kill_order_file(0)
    order.parent.mkdir(parents=True)
    ka = _keepalive(tmp_path, FOREVER, "--max-restarts", "3")
    (first,) = _wait_runs(tmp_path, 1)
    order.write_text("999999999\n")  # an older process's pid: dropped, nothing killed
    deadline = time.monotonic() + 10
    while order.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not order.exists()
    time.sleep(1.0)
    assert _runs(tmp_path) == [first]
    order.write_text(f"{first}\n")
    runs = _wait_runs(tmp_path, 2)
    assert len(runs) == 2 and runs[0] == first and runs[1] != first, runs
    assert not order.exists()
    ka.send_signal(signal.SIGTERM)
    out, _ = ka.communicate(timeout=20)
    assert ka.returncode == 143, out
    assert f"inference server 0: the orchestrator found pid {first} frozen; killing it" in out
    assert "inference server 0 was killed by signal 9; restarting it (1/3) in 1s" in out
