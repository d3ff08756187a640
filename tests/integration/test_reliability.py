"""Lossless resume under SIGKILL (issue 7): kill a random role at a random moment of a short CPU run,
`hpcrl resume --step -1`, and check that the run completes, that the sequence of training prompts
equals an uninterrupted run's (none skipped, none repeated), and — deterministic mode — that the final
weights are bitwise identical.

HPCRL_RELIABILITY_TRIALS sets the number of trials (default 20).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml

TRIALS = int(os.environ.get("HPCRL_RELIABILITY_TRIALS", "20"))
MAX_STEPS = 6
ROLES = ("trainer", "orchestrator", "inference", "launcher")

CONFIG = rl_toml(
    "{max_steps}",
    seq_len=64,
    max_tokens=8,
    top="deterministic = true\nseed = 11\n",
    orchestrator="max_async_level = 1\n",
    tables="[trainer.optim]\nlr = 3e-3\n[ckpt]\ninterval = 1\nkeep_last = 2\n",
)


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _final_state(out: Path, max_steps: int = MAX_STEPS) -> tuple[dict[str, bytes], list[list[int]]]:
    """The final weights (bytes per tensor) and each step's training prompt ids of a finished run."""
    from safetensors.torch import load_file

    weights = load_file(str(RunPaths(out).weights_dir(max_steps) / "model.safetensors"))
    raw = {k: v.numpy().tobytes() for k, v in sorted(weights.items())}
    prompts = [json.loads(line) for line in RunPaths(out).prompts_log.read_text().splitlines()]
    by_step = {p["step"]: p["example_ids"] for p in prompts}
    assert sorted(by_step) == list(range(1, max_steps + 1)), f"prompt log steps: {sorted(by_step)}"
    return raw, [by_step[s] for s in range(1, max_steps + 1)]


def kill_and_reap(victims: list[int], launcher: subprocess.Popen, out: Path, what: str) -> None:
    """SIGKILL `victims`, wait for the launcher, and check no role process of run `out` outlived it."""
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=120)
    time.sleep(0.5)
    assert not any(_role_pids(out, r) for r in ROLES[:3]), what


def resume_run(out: Path) -> subprocess.CompletedProcess:
    """`hpcrl resume --step -1` on run `out`, waited for, output captured."""
    return subprocess.run(
        _hpcrl("resume", "--step", "-1", "--output-dir", str(out)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _role_pids(out: Path, role: str) -> list[int]:
    """Processes of this run that play `role` (found through /proc, like `pgrep -f`)."""
    marker = str(out)
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "hpcrl.cli" in args and role in args and marker.encode() in env:
            pids.append(int(d.name))
    return pids


def _until_first_checkpoint(paths: RunPaths, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while checkpoint.latest_complete(paths) is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, bytes], list[list[int]], float]:
    """The uninterrupted run, and how long its trainer ran after the first checkpoint (the window in
    which a trial's kill lands: measured, so kills stay mid-run however fast this machine is)."""
    root = tmp_path_factory.mktemp("reliability")
    cfg = root / "cfg.toml"
    cfg.write_text(CONFIG.format(max_steps=MAX_STEPS))
    out = root / "reference"
    proc = subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _until_first_checkpoint(RunPaths(out), proc)
    t_first = time.monotonic()
    while _role_pids(out, "trainer") and proc.poll() is None:  # the trainer ends first: its lifetime bounds
        time.sleep(0.05)  # the window in which every role is still there to be killed
    tail = time.monotonic() - t_first
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text[-4000:]
    weights, prompts = _final_state(out)
    return cfg, weights, prompts, tail


def _trial(cfg: Path, out: Path, role: str, delay: float) -> bool:
    """Start the run, wait for its first complete checkpoint, sleep `delay`, SIGKILL `role`'s
    processes (or the launcher) and reap. Returns whether anything was killed."""
    launcher = subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # A moment after the first checkpoint exists (before it there is nothing to resume: a rerun
    # from scratch is the answer, which needs no test) and before the run could end.
    _until_first_checkpoint(RunPaths(out), launcher)
    time.sleep(delay)
    victims = [launcher.pid] if role == "launcher" else _role_pids(out, role)
    killed = launcher.poll() is None and bool(victims)
    kill_and_reap(victims, launcher, out, f"{out.name}: processes outlived the launcher")
    return killed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_random_role_then_resume_is_lossless(reference, tmp_path: Path, trial: int) -> None:
    """One trial per test item, so pytest-xdist spreads the trials over its workers. The first
    four trials kill each role in turn, the others a random one, at a random moment within the
    first 60 % of what the reference's trainer ran after its first checkpoint. A trial whose run
    ended before the kill landed is run again with the kill right after the first checkpoint:
    every trial resumes from a real SIGKILL."""
    cfg, ref_weights, ref_prompts, tail = reference
    rng = random.Random(1234 + trial)
    role = ROLES[trial] if trial < len(ROLES) else rng.choice(ROLES)
    out = tmp_path / f"trial_{trial}"
    killed = _trial(cfg, out, role, rng.uniform(0.0, 0.6 * tail))
    if not killed:
        out = tmp_path / f"trial_{trial}_again"
        killed = _trial(cfg, out, role, 0.0)
    assert killed, f"trial {trial}: the run ended before {role} could be killed, twice"
    resumed = resume_run(out)
    detail = f"trial {trial} (killed {role}): {resumed.stdout[-1500:]}{resumed.stderr[-1500:]}"
    assert resumed.returncode == 0, detail
    weights, prompts = _final_state(out)
    assert prompts == ref_prompts, f"{detail}\nprompt sequence differs"
    assert weights.keys() == ref_weights.keys()
    assert all(weights[k] == ref_weights[k] for k in weights), f"{detail}\nfinal weights differ"
