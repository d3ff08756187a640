"""The SFT trainer's rows of the fault matrix (docs/fault_matrix.md, scripts/fault_matrix.sh): a real
`hpcrl sft` killed with SIGKILL once a checkpoint of its own is complete; `hpcrl sft ...
--ckpt.resume-step -1` then continues from the newest complete checkpoint to the last step and lands
on bitwise the same final weights as a run that was never killed (the data cursor, optimizer and RNG
come back with it). A frozen SFT trainer named by `hpcrl status`; a frozen rank of two ending the run
past watchdog_s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.integration.faults import _until, row
from tests.integration.naming import Console, Watch
from tests.integration.test_sft import losses, run_sft, write_config
from tests.integration.test_sft_storage import _sft

STEPS = 12
WATCHDOG_S = 20  # the frozen-rank case


def _config(path: Path, model: Path, data: Path, out: Path) -> Path:
    cfg = write_config(path, model, data, out)
    cfg.write_text(cfg.read_text().replace("max_steps = 4", f"max_steps = {STEPS}"))
    return cfg


@pytest.mark.timeout(600)
def test_sft_trainer_killed_then_resumed_reaches_the_last_step_unchanged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch

    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.trainer.sft_data import make_demo

    data = make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=200, seed=0)[0]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_sft(str(_config(tmp_path / "ref.toml", tiny_model_dir, data, ref)))
    cfg = _config(tmp_path / "run.toml", tiny_model_dir, data, out)
    paths = RunPaths(out)
    proc = _sft(cfg)
    try:
        _until(
            lambda: (checkpoint.latest_complete(paths) or 0) >= 4 or proc.poll() is not None,
            300,
            "the sft trainer's checkpoint 4",
        )
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        # `hpcrl status`: its report no longer refreshed and no job running: trainer_0 exited
        seen = Watch(None, out, [], [["trainer_0", "exited"]])
        seen.t0 = t0
        _until(seen.poll, 30, "`hpcrl status` naming the killed trainer exited")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, err[-3000:]  # killed mid-run, not finished
    start = checkpoint.latest_complete(paths)
    assert start is not None and 4 <= start < STEPS, start
    assert time.monotonic() - t0 < 60
    resumed = run_sft(str(cfg), "--ckpt.resume-step", "-1")
    assert f"steps {start + 1}..{STEPS}" in resumed.stderr, resumed.stderr[-2000:]
    assert checkpoint.latest_complete(paths) == STEPS and checkpoint.verify(paths, STEPS) is None
    assert sorted(losses(out)) == list(range(1, STEPS + 1))  # every step logged, the redone ones once more
    got = load_safetensors_dir(str(paths.weights_dir(STEPS)))
    want = load_safetensors_dir(str(RunPaths(ref).weights_dir(STEPS)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    row(
        "SFT trainer",
        f"kill -9 once checkpoint 4 of {STEPS} is complete",
        0,
        "its caller (exit -9: one rank, nothing outlives it to say more)",
        "hpcrl sft killed by signal 9; `--ckpt.resume-step -1`: "
        + next(x for x in resumed.stderr.splitlines() if f"steps {start + 1}..{STEPS}" in x).split("] ", 1)[
            -1
        ][:160],
        f"run ends (killed); resume continues from step_{start} to step {STEPS}, exit 0",
        f"final weights bitwise equal to a run never killed; steps 1..{STEPS} each logged",
        "- (`hpcrl sft` is the killed process (one rank): no console outlives it)",
        seen.status_s,
    )


def _status(out: Path) -> str:
    import subprocess
    import sys

    from tests.integration.test_sft import REPO

    cmd = [sys.executable, "-m", "hpcrl.cli", "status", str(out)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60).stdout


def _trainer_row(status: str) -> str:
    return next((x for x in status.splitlines() if x.strip().startswith("trainer_0 ")), "")


@pytest.mark.timeout(600)
def test_a_frozen_sft_trainer_is_named_unresponsive(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGSTOP of `hpcrl sft` (one rank: the process itself) mid-run: its progress report stops being
    refreshed and `hpcrl status` names it `unresponsive` (a process cannot refresh it: frozen) within
    a few seconds, as it names a frozen RL role; after SIGCONT it says running again and training
    goes on."""
    import json

    from hpcrl.trainer.sft_data import make_demo

    data = make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=200, seed=0)[0]
    out = tmp_path / "run"
    cfg = _config(tmp_path / "run.toml", tiny_model_dir, data, out)
    cfg.write_text(cfg.read_text().replace(f"max_steps = {STEPS}", "max_steps = 100000"))
    paths = RunPaths(out)
    report = paths.progress_dir / "trainer_0.json"

    def step() -> int:
        try:
            return int(json.loads(report.read_text()).get("step") or 0)
        except (OSError, ValueError):
            return 0

    proc = _sft(cfg)
    try:
        _until(lambda: step() >= 2 or proc.poll() is not None, 300, "the sft trainer's step 2")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert "running" in _trainer_row(_status(out)), _status(out)
        proc.send_signal(signal.SIGSTOP)
        took = _until(lambda: "unresponsive" in _trainer_row(_status(out)), 60, "`hpcrl status` naming it")
        line = _trainer_row(_status(out))
        proc.send_signal(signal.SIGCONT)
        frozen_at = step()
        _until(lambda: step() > frozen_at + 1, 120, "training going on after SIGCONT")
        assert "running" in _trainer_row(_status(out)), _status(out)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=60)
    print(f"named unresponsive {took:.1f} s after SIGSTOP: {line.strip()}")
    # stale after 5 s (progress.STALE_S); `hpcrl status` itself takes seconds under load
    assert took < 30, took
    assert line.split()[:2] == ["trainer_0", "unresponsive"], line
    row(
        "SFT trainer",
        "SIGSTOP (one rank), then SIGCONT",
        took,
        "hpcrl status",
        " ".join(line.split())[:200],
        "after SIGCONT: running again, training goes on",
        f"- (no step lost: step {frozen_at} then on, no resume)",
        "- (one rank: the console is the frozen process's own stderr)",
        took,
    )


@pytest.mark.slow
def test_a_frozen_rank_ends_an_sft_run_past_watchdog_s(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two ranks, rank 1 frozen (SIGSTOP) mid-run: rank 0 waits in a collective that never completes,
    its watchdog names it past watchdog_s and ends it (exit 3), and `hpcrl sft` ends the run in a line
    instead of holding the allocation for ever (before: SFT had no watchdog, so it waited until the
    collective's own timeout, an hour by default)."""
    import json

    from hpcrl.trainer.sft_data import make_demo

    data = make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=200, seed=0)[0]
    out = tmp_path / "run"
    cfg = _config(tmp_path / "run.toml", tiny_model_dir, data, out)
    # watchdog_s bounds the model's loading too: 8 s was hit by `import torch` on 2 cores shared with
    # other test runs
    text = cfg.read_text().replace(f"max_steps = {STEPS}", f"max_steps = 100000\nwatchdog_s = {WATCHDOG_S}")
    cfg.write_text(text + "[deployment]\nnum_trainer_ranks = 2\n")
    report = RunPaths(out).progress_dir / "trainer_1.json"

    def rank1() -> dict:
        try:
            return json.loads(report.read_text())
        except (OSError, ValueError):
            return {}

    proc = _sft(cfg)
    console = Console(proc.stdout, proc.stderr)
    try:
        _until(lambda: int(rank1().get("step") or 0) >= 2 or proc.poll() is not None, 300, "rank 1's step 2")
        assert proc.poll() is None, console.text(1)[-3000:]
        frozen = int(rank1()["pid"])
        os.kill(frozen, signal.SIGSTOP)
        # the console (rank 0's watchdog line) and `hpcrl status` (rank 1 unresponsive) name it
        seen = Watch(console, out, [["made no progress"]], [["trainer_1", "unresponsive"]])
        took = _until(lambda: (seen.poll(), proc.poll() is not None)[1], 120, "the run to end")
        proc.wait(60)
        console.join()
        seen.poll()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        if "frozen" in locals():
            try:  # never leave a stopped process behind
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"the run ended {took:.1f} s after rank 1 froze")
    assert proc.returncode != 0
    log = (RunPaths(out).logs_dir / "trainer.log").read_text()
    assert "watchdog: sft[0] made no progress" in log, log[-3000:]
    assert took < WATCHDOG_S + 50, took
    assert seen.console_s is not None and seen.status_s is not None, seen.missing()
    assert max(seen.console_s, seen.status_s) <= took, (seen.cells(), took)
    said = next(x for x in log.splitlines() if "watchdog: sft[0] made no progress" in x)
    row(
        "SFT trainer (rank 1 of 2)",
        f"SIGSTOP past watchdog_s ({WATCHDOG_S} s)",
        took,
        "rank 0's watchdog, then hpcrl sft",
        said.split("] ", 1)[-1][:220],
        f"run ends (exit {proc.returncode}), no rank left waiting in the collective",
        "- (resume as after kill -9: the row above)",
        seen.console_s,
        seen.status_s,
    )
