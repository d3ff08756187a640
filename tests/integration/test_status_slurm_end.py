"""`hpcrl status` names what ended a SLURM run once its job left the queue (hpcrl.launch.slurm_end), on
the real one-machine SLURM (scripts/slurm/up.sh; no accounting there: scontrol answers).

Two hetjobs shaped like `hpcrl submit`'s (components trainer + inference, the orchestrator a step
beside the trainer, logs in the run's logs/slurm/): in one the trainer logs an ERROR line and exits 1,
and the orchestrator logs a newer ERROR line of its own before the trainer exits; the other
completes after its trainer logged max_steps. A real `hpcrl status` of each names SLURM's state and exit
code, and the trainer's ERROR line (the step that ended the job, not the newest line) or "run finished".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch.hetjob import HetComponent, HetJobSpec, HetStep, submit_hetjob
from hpcrl.launch.manage import write_job
from hpcrl.paths import RunPaths
from tests.integration.test_slurm_cluster import cluster, ended, jobs, sh, wait_for  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

LOG = '"$HPCRL_RUN_DIR/logs/$1.log"'
ERROR = 'echo "$(date +%T) ERROR [$1] $2" >> ' + LOG
WAIT = 'until grep -q ERROR "$HPCRL_RUN_DIR/logs/{}.log" 2>/dev/null; do sleep 0.2; done'
# The trainer logs its ERROR line, waits for the orchestrator's newer one (a second later), then fails.
FAILING_TRAINER = (
    f"set -- trainer 'trainer failed: cannot write checkpoint step 65: disk full'; {ERROR}; "
    f"{WAIT.format('orchestrator')}; exit 1"
)
ORCHESTRATOR = (
    f"set -- orchestrator 'orchestrator failed: lost the trainer'; {WAIT.format('trainer')}; sleep 1.1; "
    f"{ERROR}; exec sleep 300"
)
METRIC = '{"role": "trainer", "step": 2, "loss/mean": 0.5}'
FINISHING_TRAINER = f"echo '{METRIC}' >> \"$HPCRL_RUN_DIR/metrics.jsonl\"; sleep 1"


def _run_dir(tmp: Path, name: str) -> RunPaths:
    paths = RunPaths(tmp / name)
    paths.configs_dir.mkdir(parents=True)
    paths.logs_dir.mkdir()
    paths.resolved_config.write_text("max_steps = 2\n")
    return paths


def _submit(paths: RunPaths, trainer: str, orchestrator_ends: bool) -> str:
    orch = ORCHESTRATOR if not orchestrator_ends else "sleep 0"
    spec = HetJobSpec(
        f"hpcrl-test-{paths.root.name}",
        [HetComponent("trainer", sh(trainer)), HetComponent("inference", sh("exec sleep 300"))],
        steps=[HetStep("orchestrator", 0, sh(orch), nodes=1, ntasks=1, end_job_on_success=False)],
        env={"HPCRL_RUN_DIR": str(paths.root)},
        time=10,
        signal_before_s=60,
        stop_grace_s=5,
    )
    job_id = submit_hetjob(spec, paths.slurm_logs_dir)
    write_job(paths, {"target": "slurm", "job_id": job_id})
    return job_id


def _ended_line(paths: RunPaths) -> str | None:
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "status", str(paths.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return next((x.split(None, 1)[1] for x in r.stdout.splitlines() if x.startswith("ended:")), None)


def test_status_names_what_ended_a_slurm_run(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    failed, done = _run_dir(tmp_path, "failed"), _run_dir(tmp_path, "done")
    jobs.append(fid := _submit(failed, FAILING_TRAINER, orchestrator_ends=False))
    jobs.append(did := _submit(done, FINISHING_TRAINER, orchestrator_ends=True))
    assert wait_for(lambda: ended(fid), 120, f"job {fid} to end") == "FAILED"
    assert wait_for(lambda: ended(did), 120, f"job {did} to end") == "COMPLETED"
    # status waits for the job to leave the queue (squeue) before it says what ended it
    line = wait_for(lambda: _ended_line(failed), 60, "status of the failed run to have an ended: line")
    orch_log = failed.log_file("orchestrator").read_text()
    assert "orchestrator failed: lost the trainer" in orch_log  # the newer ERROR line, not the cause
    assert line == (
        f"SLURM job {fid} FAILED (exit 1:0): trainer failed: cannot write checkpoint step 65: disk full "
        "(logs/trainer.log)"
    ), json.dumps([line, orch_log])
    line = wait_for(lambda: _ended_line(done), 60, "status of the finished run to have an ended: line")
    assert line == f"SLURM job {did} COMPLETED (exit 0:0): run finished (trained step 2 of 2)"
    print(f"failed run: ended:        {_ended_line(failed)}\nfinished run: ended:        {line}")
