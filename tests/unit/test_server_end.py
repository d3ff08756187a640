"""How a server frozen past orchestrator.server_down_timeout_s is ended (hpcrl.orchestrator.server_end):
its SLURM identity from its environment, the way chosen, the SLURM command built from it, and the
fallback to a kill order when SLURM refuses (a fake `srun` on PATH; the real one runs in
tests/integration/test_submit.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from pathlib import Path

import msgspec
import pytest

from hpcrl.bus.messages import ServerInfo, SlurmTask, decode_json, encode_json
from hpcrl.orchestrator import server_end
from hpcrl.orchestrator.server_end import slurm_command, slurm_env, way
from hpcrl.orchestrator.servers import ServerSet
from hpcrl.orchestrator.stalls import StallWatch
from hpcrl.paths import RunPaths

# What srun gives task 1 of the inference step (component 1) of hetjob 414 (22.05, read on the
# local cluster), plus what hpcrl's srun line and keepalive add.
HET_ENV = {
    "SLURM_JOB_ID": "414",
    "SLURM_STEP_ID": "0",
    "SLURMD_NODENAME": "n3",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_ID_HET_GROUP_0": "414",
    "SLURM_JOB_ID_HET_GROUP_1": "415",
    "SLURM_STEP_NUM_TASKS": "2",
    "HPCRL_COMPONENT_INDEX": "1",
    "HPCRL_SUPERVISED": "1",
}
TASK = SlurmTask(job_id="414", step="415.0", node="n3", het_group=1, step_tasks=2, supervised=True)


def _info(task: SlurmTask | None, host: str = "10.0.0.3") -> ServerInfo:
    return ServerInfo(
        index=1, base_url=f"http://{host}:8000", host=host, port=8000, pid=4321, model="m", slurm=task
    )


def test_a_hetjob_task_reads_its_component_job_step_node_and_supervisor() -> None:
    assert SlurmTask.from_env(HET_ENV) == TASK


def test_a_plain_job_task_has_no_het_group_and_outside_slurm_there_is_none() -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURMD_NODENAME": "gpu12"}
    assert SlurmTask.from_env(env) == SlurmTask(job_id="77", step="77.3", node="gpu12")
    assert SlurmTask.from_env({}) is None
    assert SlurmTask.from_env({"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1"}) is None  # the batch shell


def test_the_server_file_carries_it_and_an_older_file_still_reads() -> None:
    info = _info(TASK)
    assert decode_json(encode_json(info), ServerInfo) == info
    old = json.loads(encode_json(_info(None)))
    del old["slurm"]
    assert msgspec.json.decode(json.dumps(old), type=ServerInfo).slurm is None


def test_a_supervised_server_sharing_its_step_is_killed_by_pid_on_its_node() -> None:
    assert slurm_command(TASK, 4321) == [
        "srun", "--jobid=414", "--het-group=1", "--overlap", "--nodes=1", "--ntasks=1",
        "--nodelist=n3", "--quiet", "kill", "-9", "4321",
    ]  # fmt: skip
    # alone in its step but supervised there: still by pid (ending the step ends the supervisor)
    alone = msgspec.structs.replace(TASK, step_tasks=1)
    assert slurm_command(alone, 4321)[0] == "srun"
    plain = SlurmTask(job_id="77", step="77.3", node="gpu12", step_tasks=4)
    assert "--het-group" not in " ".join(slurm_command(plain, 9))


def test_an_unsupervised_server_alone_in_its_step_has_its_step_ended() -> None:
    alone = SlurmTask(job_id="414", step="415.2", node="n3", het_group=1, step_tasks=1)
    assert slurm_command(alone, 4321) == ["scancel", "--signal=KILL", "415.2"]


def test_the_way_depends_on_job_node_and_srun() -> None:
    me = {"SLURM_JOB_ID": "414", "SLURMD_NODENAME": "n1"}
    hosts = ("n1", "n1.cluster")
    assert way(_info(TASK), me, hosts, srun=True) == "slurm"
    assert way(_info(TASK), {**me, "SLURMD_NODENAME": "n3"}, hosts, srun=True) == "local"  # same node
    assert way(_info(TASK), {**me, "SLURM_JOB_ID": "999"}, hosts, srun=True) == "order"  # another job
    assert way(_info(TASK), me, hosts, srun=False) == "order"
    assert way(_info(None, "127.0.0.1"), {}, hosts, srun=True) == "local"  # hpcrl run
    assert way(_info(None, "n1.cluster"), {}, hosts, srun=True) == "local"
    assert way(_info(None, "node-b"), {}, hosts, srun=True) == "order"


def test_srun_does_not_inherit_this_steps_shape() -> None:
    env = {"SLURM_NTASKS": "1", "SLURM_GPUS_PER_NODE": "4", "SLURM_CONF": "/etc/slurm/x.conf", "PATH": "/bin"}
    assert slurm_env(env) == {"SLURM_CONF": "/etc/slurm/x.conf", "PATH": "/bin"}


def _fake_srun(tmp: Path, rc: int, monkeypatch) -> Path:
    bin_dir, argv = tmp / "bin", tmp / "argv.txt"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\necho "$@" > {argv}\necho "srun: error: fake" >&2\nexit {rc}\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "414")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    return argv


def _watch(tmp: Path) -> tuple[StallWatch, ServerSet]:
    servers = ServerSet(RunPaths(tmp), [_info(TASK)], down_timeout_s=30)
    servers.unresponsive[0] = 0.0
    return StallWatch(RunPaths(tmp), servers, [], probe_after_s=5), servers


@pytest.mark.timeout(30)
def test_on_another_node_of_the_job_it_is_ended_through_slurm(tmp_path: Path, monkeypatch, caplog) -> None:
    argv = _fake_srun(tmp_path, 0, monkeypatch)
    watch, servers = _watch(tmp_path)
    with caplog.at_level(logging.WARNING):
        asyncio.run(watch.kill(0, 41.0))
    assert argv.read_text().split() == slurm_command(TASK, 4321)[1:]
    assert not RunPaths(tmp_path).kill_order_file(1).exists()
    assert 0 in servers.down
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert (
        "frozen for 41 s (> orchestrator.server_down_timeout_s = 30): it runs on n3 (SLURM step 415.0)"
        in said
    )
    assert "ended pid 4321 through SLURM (srun --jobid=414 --het-group=1" in said


@pytest.mark.timeout(30)
def test_when_slurm_refuses_the_kill_order_is_written_and_both_are_said(tmp_path: Path, monkeypatch) -> None:
    _fake_srun(tmp_path, 1, monkeypatch)
    what = asyncio.run(server_end.end(RunPaths(tmp_path), _info(TASK)))
    assert RunPaths(tmp_path).kill_order_file(1).read_text() == "4321\n"
    assert "SLURM refused to end it (srun --jobid=414" in what and "exit 1: srun: error: fake" in what
    assert "ordered its keepalive there to kill pid 4321" in what


@pytest.mark.timeout(30)
def test_a_slurm_command_that_hangs_is_cut_short(tmp_path: Path) -> None:
    rc, out = asyncio.run(server_end.run_slurm(["sleep", "20"], timeout=0.5))
    assert rc == 124 and "no answer within" in out
