"""`hpcrl run` hardening: the run's servers demand the per-run key (which never lands in a file of the
run directory), and roles leave within 10 s of SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hpcrl.paths import RunPaths
from tests.integration.tiny_run import TINY_RL


def _pids(out: Path, role: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpcrl.cli" in cmd and role.encode() in cmd and any(str(out).encode() in c for c in cmd):
            found.append(int(p.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _gone_within(pid: int, seconds: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds + 5:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return time.monotonic() - t0
        if state == "Z":  # exited, not yet reaped by the launcher
            return time.monotonic() - t0
        time.sleep(0.05)
    return float("inf")


@pytest.mark.timeout(300)
def test_run_key_and_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=200))
    env = {k: v for k, v in os.environ.items() if k != "HPCRL_API_KEY"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        paths = RunPaths(out)
        deadline = time.monotonic() + 180
        while not paths.prompts_log.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert paths.prompts_log.exists(), (
            launcher.stderr.read() if launcher.poll() is not None else "no batch"
        )
        url = json.loads(paths.server_file(0).read_text())["base_url"]
        (server_pid,) = _pids(out, "inference")
        key = _environ(server_pid)["HPCRL_API_KEY"]
        assert len(key) >= 32
        # Unauthenticated admin calls are refused; the orchestrator (which has the key) keeps working.
        for route in ("/update_weights", "/pause", "/init_broadcaster"):
            r = httpx.post(url + route, json={"step": 1, "path": str(out)}, timeout=10)
            assert r.status_code == 401, r.text
        assert (
            httpx.get(url + "/weights", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code
            == 200
        )
        # The key is nowhere in the run directory (configs, logs, bus files).
        # The run is live: tmp files and broadcast dirs come and go while we scan (os.walk skips a
        # directory that vanished; a file that vanished had nothing left to leak).
        for root, _dirs, files in os.walk(out):
            for name in files:
                f = Path(root) / name
                try:
                    data = f.read_bytes()
                except (FileNotFoundError, IsADirectoryError):
                    continue
                assert key.encode() not in data, f"run key leaked into {f}"
        # SIGTERM: the orchestrator leaves within 10 s whatever it was waiting for.
        (orch,) = _pids(out, "orchestrator")
        os.kill(orch, signal.SIGTERM)
        took = _gone_within(orch, 10)
        assert took < 10, f"orchestrator took {took:.1f} s after SIGTERM"
    finally:
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
        assert time.monotonic() - t0 < 25
    assert not _pids(out, "inference") and not _pids(out, "trainer")
