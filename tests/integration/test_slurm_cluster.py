"""Heterogeneous jobs on the real one-machine SLURM (scripts/slurm/up.sh: 4 fake nodes n1..n4).

Skipped, with the reason, when SLURM is not installed or the cluster is down.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hpcrl.launch.hetjob import (
    HetComponent,
    HetJobSpec,
    HetStep,
    job_state,
    release_now,
    requeue_now,
    submit_hetjob,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _idle_nodes() -> int:
    p = subprocess.run(["sinfo", "-h", "-N", "-t", "idle,mixed", "-o", "%N"], capture_output=True, text=True)
    return len(set(p.stdout.split())) if p.returncode == 0 else 0


# One test module at a time on the one local cluster, across processes: the suite's SLURM tests, and
# verifiers 0.3's, which .ci/run runs beside the suite from their own venv. scripts/test.sh holds it
# while it reshapes the cluster for seed 000 (and sets HPCRL_SLURM_LOCK_HELD for the test it runs).
SLURM_TEST_LOCK = Path(tempfile.gettempdir()) / "hpcrl-slurm-tests.lock"


def _hold_cluster() -> int | None:
    """The cluster lock (fcntl, freed when the holder dies), or None where the caller already holds it.
    Blocks: the kernel wakes a waiter when the lock is freed, and the test's timeout bounds the wait."""
    if os.environ.get("HPCRL_SLURM_LOCK_HELD"):
        return None
    fd = os.open(SLURM_TEST_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        pytest.skip("SLURM is not installed (sudo bash scripts/slurm/up.sh installs and starts it)")
    fd = _hold_cluster()
    threads = pytest.MonkeyPatch()
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
        if ping.returncode != 0 or "UP" not in ping.stdout:
            pytest.skip("SLURM controller is down (start it: sudo bash scripts/slurm/up.sh)")
        if _idle_nodes() < 3:
            pytest.skip("fewer than 3 idle SLURM nodes (scripts/slurm/up.sh starts 4)")
        # The fake nodes are processes of one machine. On a real node torch takes that node's cores;
        # here every role of every fake node took all of this machine's and spun against the others
        # (test_env_nodes_slurm's trainer under load: 30 CPU-s, 5 with one thread). One thread per
        # task, as if each fake node had a core of its own: jobs inherit it (sbatch, srun --export=ALL).
        threads.setenv("OMP_NUM_THREADS", "1")
        yield
    finally:
        threads.undo()
        if fd is not None:
            os.close(fd)  # closing the last descriptor frees the flock


def wait_for(pred, timeout: float, what: str, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def ended(job_id: str) -> str | None:
    state = job_state(job_id)
    return None if state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED") else state


def restarts(job_id: str) -> int:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return max((int(n) for n in re.findall(r"\bRestarts=(\d+)", out)), default=0)


def sh(script: str) -> list[str]:
    return ["bash", "-c", script]


@pytest.fixture
def jobs():
    """Job ids a test submitted; cancelled at the end whatever happened."""
    ids: list[str] = []
    yield ids
    for j in ids:
        subprocess.run(["scancel", j], capture_output=True)


# Each task records who and where it is: SLURM_PROCID, SLURM_HET_SIZE, the fake node, the host.
RECORD = 'echo "$SLURM_PROCID $SLURM_HET_SIZE $SLURMD_NODENAME $(hostname -s) ${SLURM_RESTART_COUNT:-0}" > "$OUT/$HPCRL_STEP.$SLURM_PROCID"'


@pytest.mark.timeout(300)  # its module waits here while another process holds the cluster (SLURM_TEST_LOCK)
def test_hetjob_runs_components_on_distinct_nodes(cluster, jobs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = HetJobSpec(
        "hpcrl-test-ok",
        [
            HetComponent("trainer", sh(f"{RECORD}; sleep 1"), nodes=2),
            # only the trainer finishing ends the job: the others must not race it
            HetComponent("inference", sh(RECORD), nodes=1, end_job_on_success=False),
        ],
        steps=[HetStep("orchestrator", 0, sh(RECORD), nodes=1, ntasks=1, end_job_on_success=False)],
        env={"OUT": str(out)},
        time=10,
        signal_before_s=60,
    )
    jid = submit_hetjob(spec, tmp_path / "slurm")
    jobs.append(jid)
    assert wait_for(lambda: ended(jid), 60, f"job {jid} to end") == "COMPLETED"

    rec = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(rec) == ["inference.0", "orchestrator.0", "trainer.0", "trainer.1"]
    assert {r[0] for n, r in rec.items() if n.startswith("trainer")} == {"0", "1"}  # ranks within the step
    assert all(r[1] == "2" for r in rec.values())  # SLURM_HET_SIZE: two components
    trainer_nodes = {rec["trainer.0"][2], rec["trainer.1"][2]}
    assert len(trainer_nodes) == 2 and rec["inference.0"][2] not in trainer_nodes  # distinct fake nodes
    assert rec["orchestrator.0"][2] == rec["trainer.0"][2]  # beside trainer rank 0
    log = (tmp_path / "slurm" / f"hetjob_{jid}.log").read_text()
    assert "step 'orchestrator' finished (exit 0); the job goes on" in log
    assert "step 'trainer' finished (exit 0): ending the job" in log
    assert (tmp_path / "slurm" / jid / "trainer.1.log").exists()  # per-step logs under <folder>/<job id>/


@pytest.mark.timeout(120)
def test_failing_component_ends_the_job(cluster, jobs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = HetJobSpec(
        "hpcrl-test-fail",
        [
            HetComponent("trainer", sh(f"{RECORD}; exec sleep 300")),
            HetComponent("inference", sh(f"{RECORD}; sleep 1; echo boom >&2; exit 1")),
        ],
        env={"OUT": str(out)},
        time=10,
        signal_before_s=60,
        stop_grace_s=5,
    )
    jid = submit_hetjob(spec, tmp_path / "slurm")
    jobs.append(jid)
    wait_for(lambda: (out / "inference.0").exists(), 60, "the inference component to start")
    t0 = time.monotonic()
    assert wait_for(lambda: ended(jid), 30, "the job to end after a component failed") == "FAILED"
    assert time.monotonic() - t0 < 30
    log = (tmp_path / "slurm" / f"hetjob_{jid}.log").read_text()
    assert "step 'inference' FAILED (exit 1): ending the job" in log
    assert "boom" in (tmp_path / "slurm" / jid / "inference.0.log").read_text()


@pytest.mark.timeout(300)
def test_usr2_checkpoints_then_requeues(cluster, jobs, tmp_path):
    """Pre-timeout/preemption: USR2 reaches the trainer, it 'checkpoints', the job requeues itself."""
    out = tmp_path / "out"
    out.mkdir()
    # The trap first: the test signals as soon as start.N exists, and a USR2 that lands before the
    # trap takes bash's default action (the trainer dies, nothing is checkpointed).
    trainer = (
        "trap 'echo ckpt > \"$OUT/checkpoint.${SLURM_RESTART_COUNT:-0}\"; exit 0' USR2; "
        f'{RECORD}; cp "$OUT/trainer.0" "$OUT/start.${{SLURM_RESTART_COUNT:-0}}"; '
        "sleep 300 & wait"
    )
    spec = HetJobSpec(
        "hpcrl-test-requeue",
        [
            HetComponent("trainer", sh(trainer)),
            HetComponent("inference", sh("exec sleep 300"), forward_signal=False),
        ],
        env={"OUT": str(out)},
        time=10,
        signal_before_s=60,
        checkpoint_grace_s=20,
        stop_grace_s=3,
    )
    jid = submit_hetjob(spec, tmp_path / "slurm")
    jobs.append(jid)
    wait_for(lambda: (out / "start.0").exists(), 60, "the first start")

    # what SLURM does `signal_before_s` before the limit (or on preemption): USR2 to the batch shell
    subprocess.run(["scancel", "--batch", "--signal=USR2", jid], check=True)
    wait_for(lambda: (out / "checkpoint.0").exists(), 30, "the trainer to checkpoint on USR2")
    wait_for(lambda: restarts(jid) >= 1, 30, "the job to requeue itself")
    # SLURM would hold a requeued job ~120 s (EligibleTime); the components requeue one after the
    # other, which on a loaded machine took longer than release_now's default 20 s once; release_now
    # clears the hold only 2 s after, as a start in the second of the kill is refused for good.
    assert release_now(jid, wait_s=90)
    wait_for(lambda: (out / "start.1").exists(), 60, "the requeued job to start again")
    log = (tmp_path / "slurm" / f"hetjob_{jid}.log").read_text()
    assert "requeueing job" in log and f"job {jid} start (restart 1)" in log

    # and an external `scontrol requeue` + StartTime=now restarts it too
    requeue_now(jid)
    wait_for(lambda: (out / "start.2").exists(), 60, "the job to start after scontrol requeue")


@pytest.mark.timeout(120)
def test_sbatch_role_scripts_under_srun(cluster, jobs, tmp_path):
    """sbatch/{trainer,inference,orchestrator}.sh: rank variables, config path, args, role logs."""
    from hpcrl.launch.slurm import sbatch_dir

    run = tmp_path / "run"
    fake_python = tmp_path / "python"  # stands in for `python -m hpcrl.cli ...`: prints what it got
    fake_python.write_text(
        "#!/bin/bash\n"
        'echo "ARGS=$* RANK=${RANK:-} WORLD_SIZE=${WORLD_SIZE:-} LOCAL_RANK=${LOCAL_RANK:-} '
        'LWS=${LOCAL_WORLD_SIZE:-} BUS=$HPCRL_BUS_HOST NODE=$SLURMD_NODENAME"\n'
        "[[ $3 == trainer ]] && sleep 1\nexit 0\n"
    )
    fake_python.chmod(0o755)
    sb = sbatch_dir()
    spec = HetJobSpec(
        "hpcrl-test-roles",
        [
            HetComponent("trainer", [str(sb / "trainer.sh"), "--resume"], nodes=2),
            HetComponent("inference", [str(sb / "inference.sh")], nodes=1, end_job_on_success=False),
        ],
        steps=[
            HetStep(
                "orchestrator", 0, [str(sb / "orchestrator.sh")], nodes=1, ntasks=1, end_job_on_success=False
            )
        ],
        env={"HPCRL_RUN_DIR": str(run), "HPCRL_PYTHON": str(fake_python)},
        time=10,
        signal_before_s=60,
    )
    jid = submit_hetjob(spec, tmp_path / "slurm")
    jobs.append(jid)
    assert wait_for(lambda: ended(jid), 60, f"job {jid} to end") == "COMPLETED"
    logs = run / "logs"
    t0, t1 = (logs / "trainer.log").read_text(), (logs / "trainer" / "rank_1.log").read_text()
    assert f"ARGS=-m hpcrl.cli trainer @ {run}/configs/trainer.toml --resume RANK=0 WORLD_SIZE=2" in t0
    assert "RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LWS=1 BUS=auto" in t1
    inf = (logs / "inference.log").read_text()
    assert f"inference @ {run}/configs/inference.toml --run-dir {run} --server-index 0" in inf
    orch = (logs / "orchestrator.log").read_text()
    assert f"orchestrator @ {run}/configs/orchestrator.toml" in orch
    assert orch.split("NODE=")[1].split()[0] == t0.split("NODE=")[1].split()[0]  # beside rank 0
