"""Resume reloads old policies: a deterministic orchestrator resumed from checkpoint C at batch B
generates batch B+1 with exactly policy B - max_async_level, which can be older than C. The trainer
restores only C's weights, so those policies' broadcast files must have outlived the trainer's
clean-up (hpcrl.trainer.publish._resume_pins). Before that fix, with max_async_level 2, the resumed
orchestrator failed: "weights path .../broadcasts/step_3 does not exist".

Real processes: `hpcrl run`, SIGKILL of every process of the run after checkpoint 4 (or while
checkpoint 8 is half written), `hpcrl resume --step -1`; the prompt sequence and final weights must
equal an uninterrupted run's, and the orchestrator must log the old policy as checksum-verified.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.test_reliability import ROLES, _env, _hpcrl, _role_pids, kill_and_reap, resume_run

ASYNC = 2
MAX_STEPS = 10
CONFIG = rl_toml(
    MAX_STEPS,
    seq_len=64,
    batch_size=8,
    max_tokens=8,
    top="deterministic = true\nseed = 11\n",
    orchestrator=f"max_async_level = {ASYNC}\n",
    tables='[trainer.optim]\nlr = 3e-3\n[trainer.broadcast]\ntransport = "filesystem"\n'
    "[ckpt]\ninterval = 4\nkeep_last = 2\n",
)


def _final(out: Path) -> tuple[list[tuple[int, list[int]]], dict[str, bytes]]:
    from safetensors.torch import load_file

    paths = RunPaths(out)
    rows = [json.loads(line) for line in paths.prompts_log.read_text().splitlines()]
    weights = load_file(str(paths.weights_dir(MAX_STEPS) / "model.safetensors"))
    return [(r["step"], r["example_ids"]) for r in rows], {k: v.numpy().tobytes() for k, v in weights.items()}


def _policy_steps(paths: RunPaths) -> list[int]:
    return RunPaths.steps_in(paths.policy_dir)


def _after_checkpoint_4(paths: RunPaths) -> bool:
    """Checkpoint 4 complete and the trainer at policy 7: without the fix policies <= 3 are gone."""
    return paths.complete_file(4).is_file() and max(_policy_steps(paths), default=-1) >= 7


def _checkpoint_8_half_written(paths: RunPaths) -> bool:
    return paths.trainer_ckpt_dir(8).is_dir() and not paths.complete_file(8).is_file()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple]:
    root = tmp_path_factory.mktemp("resume_window")
    cfg = root / "cfg.toml"
    cfg.write_text(CONFIG)
    done = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(root / "ref")),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cfg, _final(root / "ref")


def _kill_run_when(cfg: Path, out: Path, moment: Callable[[RunPaths], bool]) -> bool:
    launcher = subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    paths, deadline = RunPaths(out), time.monotonic() + 300
    while launcher.poll() is None and time.monotonic() < deadline and not moment(paths):
        time.sleep(0.01)
    hit = launcher.poll() is None and moment(paths)
    victims = [launcher.pid] + [p for r in ROLES[:3] for p in _role_pids(out, r)]
    kill_and_reap(
        victims, launcher, out, "processes outlived the kill"
    )  # the whole run, as a node failure would
    return hit


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("moment", [_after_checkpoint_4, _checkpoint_8_half_written], ids=["after", "mid"])
def test_resume_reloads_policies_older_than_the_checkpoint(reference, tmp_path: Path, moment) -> None:
    cfg, (ref_prompts, ref_weights) = reference
    out = tmp_path / "run"
    assert _kill_run_when(cfg, out, moment), "the run ended before the kill moment came"
    paths = RunPaths(out)
    c = checkpoint.latest_complete(paths)
    assert c is not None and c < MAX_STEPS
    b = json.loads((paths.orchestrator_ckpt_dir(c) / "state.json").read_text())["step"]
    needed = range(max(0, b - ASYNC), c)  # policies older than C the resumed orchestrator loads
    # What decides the case is timing (the orchestrator writes its part of C at the first batch
    # boundary that sees policy C): with generation slower than training, as on 2 CPU cores, B = C+1.
    assert len(needed) > 0, f"checkpoint {c} saved the orchestrator at batch {b}: no older policy needed"
    assert all(paths.broadcast_dir(s).is_dir() for s in needed), RunPaths.steps_in(paths.broadcasts_dir)

    resumed = resume_run(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    prompts, weights = _final(out)
    assert prompts == ref_prompts, "prompt sequence differs from the uninterrupted run"
    assert weights == ref_weights, "final weights differ from the uninterrupted run"
    log = paths.log_file("orchestrator").read_text()
    after = log[log.rindex(f"resumed from checkpoint {c}") :]
    for s in needed:
        assert re.search(rf"policy {s} loaded on 1 server\(s\) \(checksum verified", after), after[:2000]


# -- issue 52: faults checked against the run that never failed --------------------------------------
# The same deterministic config and its reference run: a trainer killed alone (the launcher ends the
# run in one line, `hpcrl resume --step -1` finishes it), and the trainer's storage refused for a while
# (broadcasts/ then checkpoints/ immutable for HOLD_S each: named, retried, the run finishes by itself).
# Either way the prompts and the final weights must equal the reference's, bit for bit.
HOLD_S = 6.0


def _start(cfg: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(launcher: subprocess.Popen, cond: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert launcher.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_killed_then_resumed_equals_the_run_that_never_failed(reference, tmp_path: Path) -> None:
    import os
    import signal

    cfg, (ref_prompts, ref_weights) = reference
    out = tmp_path / "run"
    launcher, paths = _start(cfg, out), RunPaths(out)
    _wait(launcher, lambda: _after_checkpoint_4(paths), "checkpoint 4 and policy 7")
    for pid in _role_pids(out, "trainer"):
        os.kill(pid, signal.SIGKILL)
    console, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "trainer" in console and "killed by signal 9" in console, console[-2000:]
    resumed = resume_run(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    prompts, weights = _final(out)
    assert prompts == ref_prompts, "prompt sequence differs from the uninterrupted run"
    assert weights == ref_weights, "final weights differ from the uninterrupted run"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storage_refused_for_a_while_equals_the_run_that_never_failed(reference, tmp_path: Path) -> None:
    from tests.integration.faults import _make_unwritable

    cfg, (ref_prompts, ref_weights) = reference
    out = tmp_path / "run"
    launcher, paths = _start(cfg, out), RunPaths(out)
    held: list[str] = []
    for d, before in ((paths.broadcasts_dir, 2), (paths.checkpoints_dir, 3)):
        # the first publish / checkpoint after policy `before` meets a directory nobody can write in
        _wait(launcher, lambda b=before: max(_policy_steps(paths), default=-1) >= b, f"policy {before}")
        d.mkdir(parents=True, exist_ok=True)
        _, undo = _make_unwritable(d)
        try:
            time.sleep(HOLD_S)
        finally:
            subprocess.run(undo, check=True)
        held.append(d.name)
    console, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, console[-3000:]
    trainer_log = paths.log_file("trainer").read_text()
    for name in held:  # each refusal was named (path and cause) and the write went through later
        named = [x for x in trainer_log.splitlines() if "cannot write" in x and f"/{name}/" in x]
        assert named and "not writable" in named[0], (name, trainer_log[-3000:])
        assert any(x for x in trainer_log.splitlines() if "wrote" in x and f"/{name}/" in x), name
    assert "WARNING" in console and "cannot write" in console, "the console names the refusal too"
    prompts, weights = _final(out)
    assert prompts == ref_prompts, "prompt sequence differs from the uninterrupted run"
    assert weights == ref_weights, "final weights differ from the uninterrupted run"
