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
