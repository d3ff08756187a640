"""`hpcrl submit` of an SFT config on the real one-machine SLURM (fake nodes n1..n4): the job runs
deployment.num_train_nodes = 2 nodes of one rank each, trains to its last step and checkpoints;
the dry run renders the same script and asks `sbatch --test-only`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.launch.hetjob import release_now
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.integration.test_slurm_cluster import cluster, ended, jobs, restarts, wait_for  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = """
max_steps = 4
seq_len = 64
[model]
name = "{model}"
[data]
name = "{data}"
batch_size = 8
[optim]
lr = 3e-3
[deployment]
num_train_nodes = 2
[slurm]
gpus_per_node = 0
time = "00:10:00"
[ckpt]
interval = 2
"""


def _submit(cfg: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--output-dir", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sft_submit_runs_to_its_last_step_over_two_nodes(cluster, jobs, tiny_model_dir, tmp_path):  # noqa: F811
    from hpcrl.trainer.sft_data import make_demo

    data, _ = make_demo(tmp_path / "train.jsonl", "reverse-text", n=100, seed=0)
    cfg = tmp_path / "sft.toml"
    cfg.write_text(CONFIG.format(model=tiny_model_dir, data=data))

    dry = _submit(cfg, tmp_path / "dry", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "hpcrl submit (SLURM): dry run OK" in dry.stdout
    assert "trainer:      2 rank(s) on 2 node(s) (CPU, gloo)" in dry.stdout
    assert "sbatch --test-only: OK" in dry.stdout

    out = tmp_path / "run"
    r = _submit(cfg, out)
    assert r.returncode == 0, r.stdout + r.stderr
    paths = RunPaths(out)
    job_id = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job_id)
    state = wait_for(lambda: ended(job_id), 400, "the SFT job to finish", every=2)
    log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob("hetjob_*.log"))
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == 4
    steps = [m["step"] for m in read_metrics(paths.metrics_file) if m.get("role") == "trainer"]
    assert steps == [1, 2, 3, 4]
    # sbatch/sft.sh names each rank's node in the step log before it redirects to logs/sft*.log
    starts = "".join(p.read_text() for p in (paths.slurm_logs_dir / job_id).glob("sft.*.log"))
    nodes = set(re.findall(r"\[sbatch/sft.sh\] rank \d on (\S+)", starts))
    assert len(nodes) == 2, starts


def test_sft_job_checkpoints_requeues_and_resumes(cluster, jobs, tiny_model_dir, tmp_path):  # noqa: F811
    """The pre-timeout / preemption USR2: both ranks checkpoint and stop, the job requeues itself and
    sbatch/sft.sh resumes from the newest checkpoint; the run still ends at its last step."""
    from hpcrl.trainer.sft_data import make_demo

    data, _ = make_demo(tmp_path / "train.jsonl", "reverse-text", n=100, seed=0)
    cfg = tmp_path / "sft.toml"
    text = CONFIG.format(model=tiny_model_dir, data=data)
    # ~12 tiny steps/s: the USR2 lands a few steps after the first checkpoint, with ~100 steps to spare
    cfg.write_text(text.replace("max_steps = 4", "max_steps = 120").replace("interval = 2", "interval = 20"))
    out = tmp_path / "run"
    r = _submit(cfg, out)
    assert r.returncode == 0, r.stdout + r.stderr
    paths = RunPaths(out)
    job_id = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job_id)
    wait_for(lambda: checkpoint.latest_complete(paths) is not None, 300, "a first checkpoint", every=0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    wait_for(lambda: restarts(job_id) >= 1, 330, "the job to requeue itself", every=1)
    # A one-component job is PENDING at once; released before the old allocation has ended, SLURM
    # kills it ("job credential revoked"): give the nodes a few seconds first.
    time.sleep(10)
    assert release_now(job_id, wait_s=60)  # skip SLURM's ~120 s requeue hold
    state = wait_for(lambda: ended(job_id), 400, "the requeued job to finish", every=2)
    log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob("hetjob_*.log"))
    assert state == "COMPLETED", log[-3000:]
    assert "requeueing job" in log
    assert checkpoint.latest_complete(paths) == 120
    assert "resumed trainer state" in paths.log_file("trainer").read_text()
    steps = sorted({m["step"] for m in read_metrics(paths.metrics_file) if m.get("role") == "trainer"})
    assert steps == list(range(1, 121))
