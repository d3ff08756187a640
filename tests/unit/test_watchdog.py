"""The liveness helpers end a stuck process for real (subprocesses: os._exit cannot be faked)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])

STALL = """
import logging, time
logging.basicConfig(level=logging.INFO)
from hpcrl.monitor.watchdog import Watchdog
w = Watchdog("orchestrator", timeout_s=0.5, poll_s=0.05)
w.beat("generated batch 3")
time.sleep(30)  # a hung event loop
"""

TERM = """
import signal, time
from hpcrl.monitor.watchdog import arm_exit_deadline
signal.signal(signal.SIGTERM, lambda *_: arm_exit_deadline("trainer", 0.5))
print("ready", flush=True)
while True:
    time.sleep(0.1)  # ignores the stop request
"""


def test_watchdog_names_the_stalled_role_and_ends_it():
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", STALL], capture_output=True, text=True, timeout=20, cwd=REPO)
    assert p.returncode == 3 and time.monotonic() - t0 < 10
    assert "watchdog: orchestrator made no progress" in p.stderr and "generated batch 3" in p.stderr


def test_exit_deadline_after_sigterm():
    p = subprocess.Popen(
        [sys.executable, "-c", TERM], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.terminate()
    assert p.wait(timeout=10) == 143 and time.monotonic() - t0 < 5
    p.stdout.close()
    assert "still running" in p.stderr.read()
    p.stderr.close()
