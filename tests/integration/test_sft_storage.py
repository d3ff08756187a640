"""The SFT trainer under the storage policy (hpcrl.storage, issue 52): a real `hpcrl sft` whose
checkpoints/ the filesystem refuses (`chattr +i` as root, chmod 0555 as a user). Briefly refused: named
once, retried, the run finishes with exit 0 and complete checkpoints. Refused past storage_timeout_s:
the run ends in one line naming the role, the path and the field."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import child_env
from tests.integration.faults import _make_unwritable, _until
from tests.integration.test_sft import REPO, write_config


def _sft(cfg: Path) -> subprocess.Popen:
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    from hpcrl.trainer.sft_data import make_demo

    return make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=200, seed=0)[0]


@pytest.mark.timeout(600)
def test_sft_checkpoints_wait_out_a_refusal_and_end_in_one_line_past_the_bound(
    tiny_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    paths = RunPaths(out)
    paths.checkpoints_dir.mkdir(parents=True)
    _, undo = _make_unwritable(paths.checkpoints_dir)
    try:
        # refused for good, storage_timeout_s = 2: one line at the first checkpoint (step 2)
        proc = _sft(write_config(tmp_path / "a.toml", tiny_model_dir, data, out, storage_timeout_s="2"))
        _, err = proc.communicate(timeout=300)
        last = err.strip().splitlines()[-1]
        assert proc.returncode != 0, err[-3000:]
        assert "sft trainer failed: cannot write checkpoint step 2 for 2 s: not writable (" in last, last
        assert str(paths.checkpoints_dir) in last and last.endswith("(storage_timeout_s = 2)"), last
        # refused until the trainer names it, then cleared: the run finishes with both checkpoints
        out2 = tmp_path / "run2"
        paths2 = RunPaths(out2)
        paths2.checkpoints_dir.mkdir(parents=True)
        _, undo2 = _make_unwritable(paths2.checkpoints_dir)
        proc = _sft(write_config(tmp_path / "b.toml", tiny_model_dir, data, out2, storage_timeout_s="120"))
        lines: list[str] = []

        def named() -> bool:
            line = proc.stderr.readline()
            lines.append(line)
            return "sft trainer: cannot write checkpoint step 2" in line or proc.poll() is not None

        _until(named, 300, "the sft trainer naming the refused checkpoint")
        time.sleep(1.5)
        subprocess.run(undo2, check=True)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, "".join(lines)[-2000:] + err[-3000:]
        assert "sft trainer: wrote checkpoint step 2 after" in err, err[-3000:]
        assert checkpoint.verify(paths2, 2) is None and checkpoint.latest_complete(paths2) == 4
    finally:
        subprocess.run(undo, check=False)
        if "undo2" in locals():
            subprocess.run(undo2, check=False)
