"""`hpcrl run --dry-run` as a real process: exit 0, the summary, per-process configs, nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _hpcrl() -> list[str]:
    exe = shutil.which("hpcrl")
    return [exe] if exe else [sys.executable, "-m", "hpcrl.cli"]


def test_demo_dry_run_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            *_hpcrl(),
            "run",
            "@",
            str(REPO / "configs/demo/rl.toml"),
            "--dry-run",
            "--output-dir",
            str(out),
            "--ckpt.interval",
            "5",
            "--no-wandb",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[0] == "hpcrl run (this machine): dry run OK"
    assert "checkpoints:  every 5 step(s)" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["configs"]
    assert sorted(p.name for p in (out / "configs").iterdir()) == [
        "inference.toml",
        "orchestrator.toml",
        "resolved.toml",
        "trainer.toml",
    ]
