"""deployment.env_nodes on the real one-machine SLURM (scripts/slurm/up.sh, fake nodes n1..n4).

The env servers run on a node of their own (the hetjob's `envs` component, one env host there):
the run reaches max_steps and logs/placement.jsonl shows the env server on that node, not beside
the orchestrator. A kill -9 of the env server mid-run: the env host starts it again on its node when
the orchestrator orders it, and the job completes; with orchestrator.env_server_max_restarts = 0
the same kill ends the job, and the orchestrator's log names the env.
Everything dials 127.0.0.1 (HPCRL_BUS_HOST): the fake nodes are all this machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.launch.hetjob import release_now
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.test_slurm_cluster import cluster, ended, jobs, restarts, wait_for  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]
ENV_LOGS = ("train", "reverse-text")


def _submit(tmp: Path, steps: int, limit: int, ckpt: str = "") -> tuple[RunPaths, str]:
    cfg = tmp / "cfg.toml"
    cfg.write_text(
        rl_toml(
            steps,
            seq_len=64,
            max_tokens=8,
            orchestrator=f"env_server_max_restarts = {limit}\n",
            tables='[deployment]\nenv_nodes = 1\n[slurm]\ngpus_per_node = 0\ntime = "00:20:00"\n' + ckpt,
        )
    )
    out = tmp / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--nodes", "3", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HPCRL_BUS_HOST": "127.0.0.1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(1 trainer + 1 inference + 1 env node(s))" in r.stdout
    paths = RunPaths(out)
    return paths, str(json.loads(paths.job_file.read_text())["job_id"])


def _records(paths: RunPaths) -> list[dict]:
    return (
        [json.loads(x) for x in paths.placement_log.read_text().splitlines()]
        if paths.placement_log.exists()
        else []
    )


def _server(paths: RunPaths) -> dict | None:
    try:
        return json.loads((paths.env_server_dir(*ENV_LOGS) / "components.json").read_text())["server"]
    except (OSError, ValueError):
        return None


def _kill_server_after_two_batches(paths: RunPaths) -> dict:
    def two_batches() -> bool:
        return paths.prompts_log.exists() and len(paths.prompts_log.read_text().splitlines()) >= 2

    wait_for(two_batches, 300, "two batches", every=0.5)
    victim = _server(paths)
    assert victim is not None
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


def test_env_servers_on_their_own_node_survive_a_kill_and_the_run_completes(cluster, jobs, tmp_path):  # noqa: F811
    steps = 30
    paths, job_id = _submit(tmp_path, steps, limit=3)
    jobs.append(job_id)
    victim = _kill_server_after_two_batches(paths)
    state = wait_for(lambda: ended(job_id), 600, "the job to finish", every=2)
    job_log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob("hetjob_*.log"))
    assert state == "COMPLETED", job_log[-3000:]
    assert checkpoint.latest_complete(paths) == steps
    records = _records(paths)
    node = {r["role"]: r["node"] for r in records}
    servers = [r for r in records if r["role"] == "env-server-train"]
    assert len(servers) == 2 and {r["env"] for r in servers} == {
        "reverse-text"
    }  # the first and its successor
    assert {r["node"] for r in servers} == {node["env-host"]}  # on the env node, both times
    assert node["env-host"] not in (node["orchestrator"], node["trainer"], node["inference"])
    assert victim["node"] == node["env-host"]
    assert _server(paths)["restarts"] == 1 and _server(paths)["pid"] != victim["pid"]
    orch = paths.log_file("orchestrator").read_text()
    assert "env server for train env 'reverse-text' died (exit code -9)" in orch
    assert "env server train/reverse-text restarted (restart 1)" in orch
    comps = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "components", str(paths.root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {(r["role"], r["env"]): r for r in map(json.loads, comps.stdout.splitlines())}
    assert rows[("env-host 0", "-")]["node"] == node["env-host"]
    assert rows[("env-server", "train/reverse-text")]["node"] == node["env-host"]
    assert rows[("env-server", "train/reverse-text")]["restarts"] == 1
    assert rows[("env-worker 0", "train/reverse-text")]["node"] == node["env-host"]
    status = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "status", str(paths.root)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "env-host" in status and "env-server-train" in status and "train/reverse-text" in status
    host = (paths.logs_dir / "envs" / "host_0.log").read_text()
    assert host.count("env server train/reverse-text started") == 2
    assert "restart 0) exited: killed by signal 9 (SIGKILL)" in host


def test_past_env_server_max_restarts_the_job_ends_naming_the_env(cluster, jobs, tmp_path):  # noqa: F811
    paths, job_id = _submit(tmp_path, 200, limit=0)
    jobs.append(job_id)
    _kill_server_after_two_batches(paths)
    state = wait_for(lambda: ended(job_id), 300, "the job to end", every=2)
    assert state not in ("COMPLETED", None)
    orch = paths.log_file("orchestrator").read_text()
    assert "env server for train env 'reverse-text' died (exit code -9)" in orch
    assert "restarted 0 time(s), the limit (orchestrator.env_server_max_restarts) is reached" in orch
    job_log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob("hetjob_*.log"))
    assert "step 'orchestrator' FAILED" in job_log


def test_a_requeued_job_starts_fresh_env_servers_and_never_a_stale_order(cluster, jobs, tmp_path):  # noqa: F811
    """The orders of the first run of the job stay in bus/envs/ (their orchestrator is gone): the env
    host of the requeued job takes only its own job's orders (job tag <id>.<requeue count>)."""
    paths, job_id = _submit(tmp_path, 10, limit=3, ckpt="[ckpt]\ninterval = 2\n")
    jobs.append(job_id)
    wait_for(lambda: checkpoint.latest_complete(paths) is not None, 400, "a first checkpoint", every=0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    wait_for(lambda: restarts(job_id) >= 1, 330, "the job to requeue itself", every=1)
    assert release_now(job_id, wait_s=60)
    state = wait_for(lambda: ended(job_id), 600, "the requeued job to finish", every=2)
    assert state == "COMPLETED"
    assert checkpoint.latest_complete(paths) == 10
    servers = [r for r in _records(paths) if r["role"] == "env-server-train"]
    hosts = [r for r in _records(paths) if r["role"] == "env-host"]
    assert [r["restart"] for r in servers] == [0, 1] and [r["restart"] for r in hosts] == [0, 1]
    assert all(s["node"] == h["node"] for s, h in zip(servers, hosts))
    host = (paths.logs_dir / "envs" / "host_0.log").read_text()
    assert host.count("env server train/reverse-text started") == 2, host  # one per run, no stale one
    # the orchestrator withdraws its order when it closes its envs, unless the job ends first (the
    # trainer's step finishing): then what is left is the requeued run's own, which no later run takes
    left = paths.env_spec_file(*ENV_LOGS)
    if left.exists():
        assert json.loads(left.read_text())["job"] == f"{job_id}.1"
