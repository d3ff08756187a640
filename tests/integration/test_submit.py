"""`hpcrl submit` on the real one-machine SLURM (scripts/slurm/up.sh, fake nodes n1..n4).

The CPU demo as one hetjob over 3 fake nodes finishes with a checkpoint; a preemption signal mid-run
checkpoints, requeues and the requeued job resumes and finishes on its own; `hpcrl cancel
--checkpoint` checkpoints and ends the job without a requeue; killing the trainer
ends the whole job within 30 s and the job log names it, while a killed inference server is
restarted in place (hpcrl.launch.keepalive) and the job completes; a server frozen (SIGSTOP) on its
fake node past server_down_timeout_s is named, ended through SLURM (`srun --jobid ... -w NODE kill -9
PID`, hpcrl.orchestrator.server_end), restarted by its keepalive and given the policy, and the job
completes.
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
from tests.conftest import rl_toml
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


# Frozen past server_down_timeout_s on another fake node: detected after probe_after_s = min(10,
# stall_warning_s / 2) = 3 s of unanswered requests, ended after DOWN_S more; DOWN_S also bounds its
# restart (a restart under load took 25 to 40 s in the fault matrix).
DOWN_S = 40
FROZEN_RL = rl_toml(
    "{steps}",
    seq_len=64,
    max_tokens=8,
    top="stall_warning_s = 6\n",
    orchestrator=f"server_down_timeout_s = {DOWN_S}\n",
    tables='[orchestrator.advantage]\nzero_advantage = "keep"\n',
).replace(
    'id = "reverse-text"\n',
    'id = "tests.integration.faulty_env"\nname = "faulty"\nargs = {{do = "sleep", sleep_s = 0.1, num_examples = 16}}\n',
)


def _log_line(path: Path, *needles: str, after: int = 0) -> tuple[int, str] | None:
    """(offset, line) of the first line of `path` past `after` holding every needle."""
    text = path.read_text(errors="replace") if path.exists() else ""
    at = after
    for line in text[after:].splitlines(keepends=True):
        if all(n in line for n in needles):
            return at, line.strip()
        at += len(line)
    return None


def _status_names(paths: RunPaths, *needles: str) -> str | None:
    """The line of `hpcrl status` holding every needle, if one does."""
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "status", str(paths.root)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return next((line.strip() for line in out.splitlines() if all(n in line for n in needles)), None)


@pytest.mark.waits  # for server_down_timeout_s
def test_a_frozen_server_on_another_node_is_ended_through_slurm_and_restarted(
    cluster,  # noqa: F811
    jobs,  # noqa: F811
    tmp_path: Path,
) -> None:
    steps = 100  # ~1.6 s a step: the freeze, its end and the restart fit well inside the run
    paths, job_id = _submit(tmp_path, steps=steps, interval=steps, config=FROZEN_RL + SLURM)
    jobs.append(job_id)
    wait_for(
        lambda: paths.prompts_log.exists() and len(_prompt_steps(paths)) >= 2, 300, "two batches", every=0.5
    )
    announced = json.loads(paths.server_file(1).read_text())
    victim, task = announced["pid"], announced["slurm"]
    orch_node = json.loads(paths.placement_file("orchestrator", 0).read_text()).get("node")
    assert task is not None and task["supervised"] and task["het_group"] == 1, announced
    assert task["job_id"] == job_id and task["node"] != orch_node, (announced, orch_node)
    orch = paths.log_file("orchestrator")
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        at, named = wait_for(
            lambda: _log_line(orch, "inference server 1 (", "does not answer /health"),
            120,
            "the freeze named",
        )
        t_named = time.monotonic() - t0
        status = wait_for(lambda: _status_names(paths, "inference server 1 (", "unresponsive"), 60, "status")
        t_status = time.monotonic() - t0
        at, ended_line = wait_for(
            lambda: _log_line(orch, "inference server 1 (", "frozen for", after=at), DOWN_S + 60, "its end"
        )
        t_ended = time.monotonic() - t0
        wait_for(
            lambda: _log_line(orch, "inference server 1 (", "is back (pid", after=at), 180, "its restart"
        )
        t_back = time.monotonic() - t0
    finally:
        try:  # SIGCONT first: a stopped process takes SIGKILL too, but a live leftover never should stay
            os.kill(victim, signal.SIGCONT)
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(
        f"\nSIGSTOP -> named in the log {t_named:.1f} s, in hpcrl status {t_status:.1f} s, "
        f"ended through SLURM {t_ended:.1f} s, back {t_back:.1f} s\n{named}\n{status}\n{ended_line}"
    )
    assert f"ended pid {victim} through SLURM (srun --jobid={job_id} --het-group=1" in ended_line, ended_line
    assert f"it runs on {task['node']} (SLURM step {task['step']})" in ended_line, ended_line
    state = wait_for(lambda: ended(job_id), 600, "the job to finish", every=2)
    log = _job_log(paths, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == steps
    assert json.loads(paths.server_file(1).read_text())["pid"] != victim
    server_log = paths.rank_log_file("inference", 1).read_text()
    assert "[keepalive] inference server 1 was killed by signal 9; restarting it (1/5)" in server_log
    text = orch.read_text()
    assert "ordered its keepalive" not in text and not paths.kill_order_file(1).exists()  # SLURM did it
    back = text.index("is back (pid", text.index(ended_line))
    assert "policy loaded and verified" in text[back : back + 300]
