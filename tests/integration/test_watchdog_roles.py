"""The watchdog wired into a real role: a trainer rank stuck in its rendezvous (its peer never
comes) is named in its log and exits 3 after `watchdog_s`, instead of holding its allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.net import free_port
from hpcrl.paths import RunPaths
from hpcrl.runtime import rank_env
from tests.integration.tiny_run import TINY_RL


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


@pytest.mark.timeout(180)
def test_a_trainer_stuck_in_its_rendezvous_is_named_and_exits(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=2))
    out = tmp_path / "run"
    dry = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out), "--dry-run"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    paths = RunPaths(out)
    # Rank 0 of a world of 2 whose rank 1 never starts: init_process_group waits for it forever
    # (its own timeout is 30 min); the watchdog ends it after 3 s.
    env = {**os.environ, **rank_env(0, 2, "127.0.0.1", free_port()), "HPCRL_RUN_DIR": str(out)}
    t0 = time.monotonic()
    p = subprocess.run(
        _hpcrl("trainer", "@", str(paths.process_config("trainer")), "--watchdog-s", "3"),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    took = time.monotonic() - t0
    log = paths.log_file("trainer").read_text() if paths.log_file("trainer").exists() else ""
    text = p.stdout + p.stderr + log
    assert p.returncode == 3, text[-3000:]
    assert (
        "watchdog: trainer[0] made no progress for 3 s (last: joining the trainer group (2 rank(s))" in text
    )
    assert took < 60, took  # startup (imports, tiny model) + 3 s, not the rendezvous' 30 min


@pytest.mark.timeout(120)
def test_watchdog_off_and_bad_values(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=2))
    for bad in ("-1", "nan", "inf", "abc"):
        r = subprocess.run(
            _hpcrl("run", str(cfg), "--output-dir", str(tmp_path / "r"), "--dry-run", "--watchdog-s", bad),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert "watchdog_s" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
