"""`hpcrl cancel --checkpoint` (SIGUSR2 to a local `hpcrl run`): the trainer finishes its step, writes a
complete checkpoint with no deadline, the run stops with exit 0 and names that checkpoint, no process
is left, and `hpcrl resume --step -1` ends exactly where an uninterrupted run ends (deterministic mode:
same prompts, bitwise-equal weights). Ctrl-C / SIGTERM keep their "every process gone within seconds"
promise (test_run_key_and_sigterm); this is the stop that never loses a finished step, for models whose
checkpoint takes longer than that.
"""

from __future__ import annotations

import re
import signal
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
@pytest.mark.parametrize("ranks", [1, 2])
def test_cancel_checkpoint_stops_at_a_complete_checkpoint_and_resume_is_lossless(
    tmp_path: Path, ranks: int
) -> None:
    """With 2 trainer ranks the signal reaches them one after the other: they agree on the step to
    stop after (a collective), or one would save while the other waits for a batch."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG + f"[deployment]\nnum_trainer_ranks = {ranks}\n")
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
    # The orchestrator left through its own exit path (the launcher's bus Shutdown), not the 9 s
    # deadline after SIGTERM: its metrics and prompt log were closed.
    orch_log = paths.log_file("orchestrator").read_text()
    assert "shutdown requested" in orch_log or "stopped at a batch boundary" in orch_log, orch_log[-2000:]
    assert "still running" not in orch_log

    resumed = resume_run(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from checkpoint {c}" in paths.log_file("orchestrator").read_text()
    weights, prompts = _final_state(out, MAX_STEPS)
    assert prompts == ref_prompts, "prompt sequence differs from the uninterrupted run"
    assert weights.keys() == ref_weights.keys()
    assert all(weights[k] == ref_weights[k] for k in weights), (
        "final weights differ from the uninterrupted run"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_stop_during_start_up_ends_cleanly(tmp_path: Path) -> None:
    """USR2 while the trainer is still importing (it starts with USR2 blocked, so the signal waits for
    its handler instead of killing it): the run ends with exit 0 and says what it left."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "run"
    launcher = _run(cfg, out)
    paths = RunPaths(out)
    deadline = time.monotonic() + 60
    while not _role_pids(out, "trainer"):  # the trainer process exists, its imports have just begun
        assert time.monotonic() < deadline and launcher.poll() is None, "no trainer process"
        time.sleep(0.01)
    launcher.send_signal(signal.SIGUSR2)
    text, _ = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, text[-3000:]
    assert "stopped on SIGUSR2" in text, text[-3000:]
    assert "was killed by signal" not in text
    assert not any(_role_pids(out, r) for r in ROLES[:3]), "a process outlived the stopped run"
    assert checkpoint.latest_complete(paths) in (None, *range(1, MAX_STEPS))


def test_cancel_checkpoint_refuses_a_run_without_checkpoints(tmp_path: Path) -> None:
    """No [ckpt]: nothing resumable would be written, so `--checkpoint` is refused in one line (exit 2)
    and the run is left alone."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(rl_toml(3))
    out = tmp_path / "run"
    r = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out), "--dry-run"), env=_env(), capture_output=True
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        _hpcrl("cancel", "--checkpoint", str(out)), env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "writes no resumable checkpoints" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_run_in_a_stopped_runs_directory_ignores_its_bus_files(tmp_path: Path) -> None:
    """A stopped trainer leaves its stop announcement on the bus (and rollouts, policies): a fresh
    `hpcrl run` into the same directory (no --clean-output-dir, no resume) moves them aside instead
    of reading them, so it is not told to stop at its first step and trains on its own batches."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.replace(f"max_steps = {MAX_STEPS}", "max_steps = 6"))
    out = tmp_path / "run"
    paths = RunPaths(out)
    first = _run(cfg, out)
    deadline = time.monotonic() + 300
    while max(RunPaths.steps_in(paths.policy_dir), default=-1) < 2 and first.poll() is None:
        assert time.monotonic() < deadline, "the first run never reached policy 2"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert list(paths.control_dir.glob("shutdown_*")), "the stopped trainer announced nothing"
    # The stop is the orchestrator's, not its env server's: the server neither died under the
    # launcher's SIGTERM to the role's process group nor was restarted while the run stopped.
    orch_log = (paths.logs_dir / "orchestrator.log").read_text()
    assert "stopping at the next safe point" in orch_log
    assert " died " not in orch_log and "restarted" not in orch_log, orch_log[-3000:]
    second = _run(cfg, out)
    text, _ = second.communicate(timeout=300)
    assert second.returncode == 0 and "run finished" in text, text[-3000:]
    assert "moved" in text and "old bus file(s) aside" in text
    assert checkpoint.latest_complete(paths) == 6  # trained to the end, not stopped at step 1
