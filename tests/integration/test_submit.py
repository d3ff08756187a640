"""`hpcrl submit` on the real one-machine SLURM (scripts/slurm/up.sh, fake nodes n1..n4).

The CPU demo as one hetjob over 3 fake nodes finishes with a checkpoint; a preemption signal mid-run
checkpoints, requeues and the requeued job resumes and finishes on its own; `hpcrl cancel
--checkpoint` checkpoints and ends the job without a requeue; killing the trainer
ends the whole job within 30 s and the job log names it, while a killed inference server is
restarted in place (hpcrl.launch.keepalive) and the job completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.launch.hetjob import release_now
from hpcrl.paths import RunPaths
from tests.integration.test_slurm_cluster import cluster, ended, jobs, restarts, wait_for  # noqa: F401
from tests.integration.tiny_run import SLOW_RL, TINY_RL

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

SLURM = """
[slurm]
gpus_per_node = 0
time = "00:20:00"
[ckpt]
interval = {interval}
"""
CONFIG = TINY_RL + SLURM


def _submit(tmp: Path, steps: int, interval: int, config: str = CONFIG) -> tuple[RunPaths, str]:
    cfg = tmp / "cfg.toml"
    cfg.write_text(config.format(steps=steps, interval=interval))
    out = tmp / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--nodes", "3", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    paths = RunPaths(out)
    job_id = json.loads(paths.job_file.read_text())["job_id"]
    return paths, str(job_id)


def _job_log(paths: RunPaths, job_id: str) -> str:
    return "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob(f"hetjob_{job_id}.log"))


def _prompt_steps(paths: RunPaths) -> list[int]:
    return [json.loads(line)["step"] for line in paths.prompts_log.read_text().splitlines()]


def test_submit_runs_the_demo_over_three_nodes(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    paths, job_id = _submit(tmp_path, steps=4, interval=2)
    jobs.append(job_id)
    state = wait_for(lambda: ended(job_id), 400, "the hetjob to finish", every=2)
    log = _job_log(paths, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == 4
    assert (paths.weights_dir(4) / "config.json").is_file()
    servers = sorted(json.loads(p.read_text())["index"] for p in paths.servers_dir.glob("*.json"))
    assert servers == [0, 1]  # one server per inference node
    assert _prompt_steps(paths) == [1, 2, 3, 4]


def test_preemption_checkpoints_requeues_and_resumes(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    paths, job_id = _submit(tmp_path, steps=10, interval=2)
    jobs.append(job_id)
    wait_for(lambda: checkpoint.latest_complete(paths) is not None, 400, "a first checkpoint", every=0.5)
    # What SLURM sends before the time limit or on preemption (--signal=B:USR2@N): to the batch shell.
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    wait_for(
        lambda: restarts(job_id) >= 1, 330, "the job to requeue itself", every=1
    )  # checkpoint grace is 285 s
    assert release_now(job_id, wait_s=60)  # skip SLURM's ~120 s requeue hold
    state = wait_for(lambda: ended(job_id), 600, "the requeued job to finish", every=2)
    log = _job_log(paths, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert "requeueing job" in log
    assert checkpoint.latest_complete(paths) == 10
    steps = _prompt_steps(paths)
    assert sorted(set(steps)) == list(range(1, 11)) and len(steps) == 10, steps  # none skipped or repeated
    trainer_log = paths.log_file("trainer").read_text()
    assert "resumed trainer state" in trainer_log
    # From a login node: resubmit the finished run to train further; it resumes from step 10. Its
    # --dry-run checks the hetjob against the partition and writes nothing.
    resume = [sys.executable, "-m", "hpcrl.cli", "resume", "--step", "-1", "--output-dir", str(paths.root)]
    before = {f: f.read_bytes() for f in paths.root.rglob("*") if f.is_file()}
    r = subprocess.run(
        [*resume, "--max-steps", "12", "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hpcrl resume (SLURM hetjob): dry run OK" in r.stdout
    assert "resume:       from checkpoint step_10 (verified), steps 11..12" in r.stdout
    assert {f: f.read_bytes() for f in paths.root.rglob("*") if f.is_file()} == before
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "resume",
            "--step",
            "-1",
            "--output-dir",
            str(paths.root),
            "--max-steps",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout + r.stderr
    job2 = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job2)
    assert job2 != job_id
    assert wait_for(lambda: ended(job2), 400, "the resubmitted job to finish", every=2) == "COMPLETED"
    assert checkpoint.latest_complete(paths) == 12
    steps = _prompt_steps(paths)
    assert sorted(set(steps)) == list(range(1, 13)) and len(steps) == 12, steps


def test_cancel_checkpoint_ends_the_job_without_requeue(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    """`hpcrl cancel --checkpoint` on a requeue = true job: the trainer checkpoints its step (no periodic
    checkpoint is due), the job ends instead of requeueing, and a later resume clears the request so
    that the resumed job would requeue on preemption again."""
    paths, job_id = _submit(tmp_path, steps=200, interval=1000)
    jobs.append(job_id)
    wait_for(lambda: max(RunPaths.steps_in(paths.policy_dir), default=-1) >= 2, 400, "policy 2", every=0.5)
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "cancel", "--checkpoint", str(paths.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "no requeue" in r.stdout, r.stdout + r.stderr
    state = wait_for(lambda: ended(job_id), 330, "the job to end", every=1)
    log = _job_log(paths, job_id)
    assert "not requeueing: a stop was requested" in log, log[-3000:]
    assert restarts(job_id) == 0 and state == "COMPLETED", (state, log[-3000:])
    c = checkpoint.latest_complete(paths)
    assert c is not None and 2 <= c < 200, c
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "resume", "--step", "-1", "--output-dir", str(paths.root)]
        + ["--max-steps", str(c + 2)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout + r.stderr
    assert not paths.stop_request_file.exists()
    job2 = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job2)
    assert wait_for(lambda: ended(job2), 400, "the resumed job to finish", every=2) == "COMPLETED"
    assert checkpoint.latest_complete(paths) == c + 2
    steps = _prompt_steps(paths)
    assert sorted(set(steps)) == list(range(1, c + 3)) and len(steps) == c + 2, steps


def test_killing_the_trainer_ends_the_job(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    # A dead trainer (or orchestrator) really ends the job; a dead inference server does not (below).
    paths, job_id = _submit(tmp_path, steps=50, interval=25)
    jobs.append(job_id)
    wait_for(lambda: paths.placement_file("trainer", 0).exists(), 300, "the trainer", every=0.5)
    pid = json.loads(paths.placement_file("trainer", 0).read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    state = wait_for(lambda: ended(job_id), 60, "the job to end after a component died", every=0.5)
    assert time.monotonic() - t0 < 30
    assert state in ("FAILED", "CANCELLED", "NODE_FAIL"), state
    assert "step 'trainer' FAILED" in _job_log(paths, job_id)


def test_killing_an_inference_server_restarts_it_and_the_job_completes(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    steps = 30  # slow steps (~1.6 s, env code that sleeps): long enough for the restarted server to come back
    paths, job_id = _submit(tmp_path, steps=steps, interval=steps, config=SLOW_RL + SLURM)
    jobs.append(job_id)
    wait_for(
        lambda: paths.prompts_log.exists() and len(_prompt_steps(paths)) >= 2, 300, "two batches", every=0.5
    )
    victim = json.loads(paths.server_file(1).read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    state = wait_for(lambda: ended(job_id), 600, "the job to finish", every=2)
    log = _job_log(paths, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == steps
    assert json.loads(paths.server_file(1).read_text())["pid"] != victim
    server_log = paths.rank_log_file("inference", 1).read_text()
    assert "[keepalive] inference server 1 was killed by signal 9; restarting it (1/5)" in server_log
    orch = paths.log_file("orchestrator").read_text()
    assert "inference server 1 (" in orch and "is back (pid" in orch
    from hpcrl.monitor.metrics import read_metrics

    rows = [
        m
        for m in read_metrics(paths.metrics_file)
        if m["role"] == "orchestrator" and "inference/server_restarts" in m
    ]
    assert rows[-1]["step"] == steps and rows[-1]["inference/server_restarts"] == 1
