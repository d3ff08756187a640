"""`hpcrl cancel [--checkpoint] DIR`: which signal reaches a local launcher, and the SLURM refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch import manage
from hpcrl.paths import RunPaths

# A stand-in launcher: reports which of the two stop signals it got, then exits.
LAUNCHER = """
import signal, sys, time
def got(name):
    def handler(*_):
        print(name, flush=True)
        sys.exit(0)
    return handler
signal.signal(signal.SIGUSR2, got("USR2"))
signal.signal(signal.SIGTERM, got("TERM"))
print("ready", flush=True)
time.sleep(60)
"""


def _run_dir(tmp_path: Path, job: dict) -> Path:
    (tmp_path / "configs").mkdir()
    manage.write_job(RunPaths(tmp_path), job)
    return tmp_path


@pytest.mark.parametrize(("flags", "expected"), [([], "TERM"), (["--checkpoint"], "USR2")])
def test_local_cancel_signals_the_launcher(tmp_path: Path, capsys, flags: list[str], expected: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        d = _run_dir(tmp_path, {"target": "local", "pid": proc.pid})
        assert manage.cancel([*flags, str(d)]) == 0
        assert proc.stdout.readline().strip() == expected
        assert f"sent SIG{expected}" in capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait()


def test_checkpoint_cancel_of_a_slurm_job_without_scancel_fails_in_one_line(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """No scancel here: one error line naming the command, exit 1, and no stop request left behind
    (it would keep a later preemption from requeueing)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    d = _run_dir(tmp_path, {"target": "slurm", "job_id": 4242})
    assert manage.cancel(["--checkpoint", "--output-dir", str(d)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scancel --batch --signal=USR2 4242 failed" in err
    assert not RunPaths(d).stop_request_file.exists()
