"""`hpcrl cancel --checkpoint` (SIGUSR2 to a local `hpcrl run`): the trainer finishes its step, writes a
complete checkpoint with no deadline, the run stops with exit 0 and names that checkpoint, no process
is left, and `hpcrl resume --step -1` ends exactly where an uninterrupted run ends (deterministic mode:
same prompts, bitwise-equal weights). Ctrl-C / SIGTERM keep their "every process gone within seconds"
promise (test_run_key_and_sigterm); this is the stop that never loses a finished step, for models whose
checkpoint takes longer than that.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.test_reliability import ROLES, _env, _final_state, _hpcrl, _role_pids, resume_run

MAX_STEPS = 12
STOP_AFTER = 3  # policies published before the stop is requested
CONFIG = rl_toml(
    MAX_STEPS,
    seq_len=64,
    batch_size=8,
    max_tokens=8,
    top="deterministic = true\nseed = 11\n",
    orchestrator="max_async_level = 1\n",
    # No periodic checkpoint before the end: the only one to resume from is the stop's.
    tables="[trainer.optim]\nlr = 3e-3\n[ckpt]\ninterval = 1000\n",
)


def _run(cfg: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cancel_checkpoint_stops_at_a_complete_checkpoint_and_resume_is_lossless(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    ref = tmp_path / "reference"
    reference = _run(cfg, ref)
    text, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, text[-3000:]
    ref_weights, ref_prompts = _final_state(ref, MAX_STEPS)

    out = tmp_path / "run"
    paths = RunPaths(out)
    launcher = _run(cfg, out)
    deadline = time.monotonic() + 300
    while max(RunPaths.steps_in(paths.policy_dir), default=-1) < STOP_AFTER and launcher.poll() is None:
        assert time.monotonic() < deadline, "the run never reached policy 3"
        time.sleep(0.05)
    sent = subprocess.run(
        _hpcrl("cancel", "--checkpoint", str(out)), env=_env(), capture_output=True, text=True, timeout=60
    )
    assert sent.returncode == 0 and "SIGUSR2" in sent.stdout, sent.stdout + sent.stderr
    text, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, text[-3000:]
    m = re.search(r"stopped on SIGUSR2 at checkpoint (\d+); continue with `hpcrl resume", text)
    assert m, text[-3000:]
    c = int(m.group(1))
    assert STOP_AFTER <= c < MAX_STEPS, text[-3000:]  # the step in flight, not a periodic one
    assert checkpoint.latest_complete(paths) == c
    assert not any(_role_pids(out, r) for r in ROLES[:3]), "a process outlived the stopped run"

    resumed = resume_run(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from checkpoint {c}" in paths.log_file("orchestrator").read_text()
    weights, prompts = _final_state(out, MAX_STEPS)
    assert prompts == ref_prompts, "prompt sequence differs from the uninterrupted run"
    assert weights.keys() == ref_weights.keys()
    assert all(weights[k] == ref_weights[k] for k in weights), (
        "final weights differ from the uninterrupted run"
    )
