"""`hpcrl status` of a SLURM run that left the queue: its `ended:` line (hpcrl.launch.slurm_end).

The parsers get text as sacct and scontrol print it on the local cluster (a hetjob: `424+0`, `424+1`
as one line each); `slurm_end` and `status` run against fake squeue/sacct/scontrol on PATH, one that
hangs included: status still answers, and says SLURM is unreachable."""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

import pytest

from hpcrl.launch import manage, slurm_end
from hpcrl.launch.slurm_end import (
    LogError,
    SlurmEnd,
    cause,
    ended_line,
    ending_step,
    most_telling,
    not_requeued,
    parse_sacct,
    parse_scontrol,
    pick_error,
)
from hpcrl.paths import RunPaths

# `scontrol -o show job 1055` of a two-component hetjob whose batch script exited 3 (trimmed).
SCONTROL_HET = (
    "JobId=1055 HetJobId=1055 HetJobOffset=0 JobName=het.sh JobState=FAILED Reason=NonZeroExitCode "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 NodeList=n1\n"
    "JobId=1056 HetJobId=1055 HetJobOffset=1 JobName=het.sh JobState=FAILED Reason=NonZeroExitCode "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 NodeList=n2\n"
)


def test_parse_sacct_one_line_per_component() -> None:
    assert parse_sacct("FAILED|1:0\nFAILED|1:0\n") == [("FAILED", "1:0"), ("FAILED", "1:0")]
    assert parse_sacct("CANCELLED by 0|0:15\n\nCOMPLETED|0:0") == [
        ("CANCELLED by 0", "0:15"),
        ("COMPLETED", "0:0"),
    ]
    assert parse_sacct("Slurm accounting storage is disabled\n") == []  # no `|`: not a row


def test_parse_scontrol_one_record_per_component() -> None:
    assert parse_scontrol(SCONTROL_HET) == [("FAILED", "3:0"), ("FAILED", "3:0")]
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified\n") == []


def test_the_most_telling_component_state_and_its_exit_code() -> None:
    assert most_telling([("COMPLETED", "0:0"), ("FAILED", "1:0")]) == SlurmEnd("FAILED", "1:0")
    assert most_telling([("COMPLETED", "0:0"), ("CANCELLED by 0", "0:15")]) == SlurmEnd(
        "CANCELLED by 0", "0:15"
    )
    assert most_telling([("COMPLETED", "0:0"), ("COMPLETED", "0:0")]) == SlurmEnd("COMPLETED", "0:0")
    assert most_telling([("WEIRD", "9:0")]) == SlurmEnd("WEIRD", "9:0")  # a state not in the order


def test_the_step_that_ended_the_job_is_the_newest_in_the_batch_log() -> None:
    log = (
        "[hpcrl-hetjob 2026-11-29T09:00:00] step 'orchestrator' finished (exit 0); the job goes on\n"
        "[hpcrl-hetjob 2026-11-29T09:00:01] step 'trainer' finished (exit 0): ending the job\n"
        "[hpcrl-hetjob 2026-11-29T09:10:00] job 7 start (restart 1) on n[1-3]\n"
        "[hpcrl-hetjob 2026-11-29T09:10:09] step 'inference' FAILED (exit 1): ending the job\n"
    )
    assert ending_step(log) == ("inference", "FAILED (exit 1)")
    assert ending_step(log.splitlines(keepends=True)[1]) == ("trainer", "finished (exit 0)")
    assert ending_step("step 'orchestrator' finished (exit 0); the job goes on\n") is None
    assert ending_step("") is None


ERRORS = [
    LogError(9 * 3600 + 5, "orchestrator failed: trainer unresponsive", "logs/orchestrator.log"),
    LogError(9 * 3600 + 1, "trainer failed: cannot write checkpoint step 65", "logs/trainer/rank_1.log"),
    LogError(8 * 3600, "inference server 0: old trouble", "logs/inference.log"),
]


def test_the_error_of_the_step_that_ended_the_job_else_the_newest() -> None:
    assert pick_error(ERRORS) == ERRORS[0]  # newest
    assert pick_error(ERRORS, "trainer") == ERRORS[1]  # the step that ended the job, its rank log
    assert pick_error(ERRORS, "envs") == ERRORS[0]  # no log of its own: the newest
    assert pick_error([], "trainer") is None


def test_the_cause_of_each_kind_of_end() -> None:
    err = ERRORS[1]
    failed_step = ("trainer", "FAILED (exit 1)")
    # COMPLETED with max_steps reached: finished, whatever ERROR lines came before.
    assert cause(SlurmEnd("COMPLETED", "0:0"), err, None, 4, 4) == "run finished (trained step 4 of 4)"
    assert cause(SlurmEnd("COMPLETED", "0:0"), None, None, 2, 4, stop_requested=True) == (
        "stopped on request (hpcrl cancel --checkpoint) after trained step 2 of 4"
    )
    assert cause(SlurmEnd("COMPLETED", "0:0"), None, None, 0, None) == ""
    # Failed: the ERROR line and its log; none: the batch log's step, else say so.
    assert cause(SlurmEnd("FAILED", "1:0"), err, failed_step, 64, 100) == (
        "trainer failed: cannot write checkpoint step 65 (logs/trainer/rank_1.log)"
    )
    assert cause(SlurmEnd("FAILED", "1:0"), None, failed_step, 3, 4) == (
        "step 'trainer' FAILED (exit 1), no ERROR line in the role logs"
    )
    assert cause(SlurmEnd("FAILED", "137:0"), None, ("trainer", "FAILED (exit 137)"), 3, 4) == (
        "step 'trainer' FAILED (exit 137: killed by signal 9), no ERROR line in the role logs"
    )
    # SLURM ended it (scancel, time limit, node failure): how far it got, and the newest ERROR if any.
    assert cause(SlurmEnd("CANCELLED", "143:0"), None, None, 3, 4) == "after trained step 3 of 4"
    assert cause(SlurmEnd("TIMEOUT", "0:15"), err, None, 3, None) == (
        "after trained step 3; newest ERROR: trainer failed: cannot write checkpoint step 65 (logs/trainer/rank_1.log)"
    )
    assert cause(SlurmEnd("FAILED", "1:0"), None, None, 3, 4) == "no ERROR line in the role logs"
    # USR2 (time limit near) without a requeue left: the script exits 0, COMPLETED, short of max_steps.
    assert cause(
        SlurmEnd("COMPLETED", "0:0"), err, None, 3, 4, not_requeued="(requeue=1, restarts 2 of 2)"
    ) == (
        "stopped on USR2 (time limit or preemption), not requeued (requeue=1, restarts 2 of 2), "
        "after trained step 3 of 4"
    )
    assert cause(SlurmEnd("COMPLETED", "0:0"), err, None, 3, 4) == "after trained step 3 of 4"
    # A failure after the last step (the final checkpoint) is a failure.
    assert cause(SlurmEnd("FAILED", "1:0"), err, failed_step, 4, 4).startswith("trainer failed")
    # SLURM silent: the batch log decides, else whether max_steps was reached.
    unknown = SlurmEnd(unknown="SLURM no longer knows the job")
    assert cause(unknown, err, ("trainer", "finished (exit 0)"), 4, 4) == "run finished (trained step 4 of 4)"
    assert cause(unknown, err, None, 4, 4) == "run finished (trained step 4 of 4)"
    assert cause(unknown, err, failed_step, 4, 4).startswith("trainer failed")
    assert cause(unknown, err, None, 2, 4).startswith("trainer failed")
    assert cause(unknown, None, None, 2, 4) == "no ERROR line in the role logs"
    assert cause(unknown, err, None, 2, 4, stop_requested=True) == (
        "stopped on request (hpcrl cancel --checkpoint) after trained step 2 of 4"
    )


def test_not_requeued_in_the_newest_session_only() -> None:
    log = (
        "[hpcrl-hetjob 2026-11-29T09:00:00] job 7 start (restart 0) on n[1-3]; step logs in /x\n"
        "[hpcrl-hetjob 2026-11-29T09:09:00] USR2 (time limit near or preemption): forwarding to the steps\n"
        "[hpcrl-hetjob 2026-11-29T09:09:05] requeueing job 7 (restart 1 of at most 1)\n"
        "[hpcrl-hetjob 2026-11-29T09:12:00] job 7 start (restart 1) on n[1-3]; step logs in /x\n"
        "[hpcrl-hetjob 2026-11-29T09:21:00] USR2 (time limit near or preemption): forwarding to the steps\n"
        "[hpcrl-hetjob 2026-11-29T09:21:05] not requeueing (requeue=1, restarts 1 of 1)\n"
    )
    assert not_requeued(log) == "(requeue=1, restarts 1 of 1)"
    head = log.split("[hpcrl-hetjob 2026-11-29T09:12:00]")[0]
    assert not_requeued(head) is None  # requeued
    assert not_requeued(log + "[hpcrl-hetjob 2026-11-29T09:30:00] job 7 start (restart 2) on n1\n") is None
    stop = "[t] not requeueing: a stop was requested (/r/control/stop, hpcrl cancel --checkpoint)\n"
    assert not_requeued(stop) is None  # that is stop_requested's


def test_the_ended_line() -> None:
    assert ended_line("424", SlurmEnd("COMPLETED", "0:0"), "") == "SLURM job 424 COMPLETED (exit 0:0)"
    assert ended_line("424", SlurmEnd("FAILED", "1:0"), "trainer failed: x (logs/trainer.log)") == (
        "SLURM job 424 FAILED (exit 1:0): trainer failed: x (logs/trainer.log)"
    )
    assert ended_line("424", SlurmEnd(unknown="SLURM unreachable: scontrol timed out after 5 s"), "y") == (
        "SLURM job 424, state unknown (SLURM unreachable: scontrol timed out after 5 s): y"
    )


# -- against fake SLURM commands ---------------------------------------------------------------------
def _fake(bin_dir: Path, name: str, script: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + script + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm_end, "TIMEOUT_S", 1.0)
    monkeypatch.setattr(manage, "SQUEUE_TIMEOUT_S", 1.0)
    no_acct = 'echo "Slurm accounting storage is disabled" >&2; exit 1'
    _fake(bin_dir, "sacct", no_acct)
    _fake(bin_dir, "squeue", "exit 0")  # not in the queue
    return lambda name, script: _fake(bin_dir, name, script)


def test_slurm_end_without_accounting_reads_scontrol(fake_slurm) -> None:
    fake_slurm("scontrol", f"cat <<'EOF'\n{SCONTROL_HET}EOF")
    assert slurm_end.slurm_end("1055") == SlurmEnd("FAILED", "3:0")


def test_slurm_end_prefers_sacct(fake_slurm) -> None:
    fake_slurm("sacct", 'echo "COMPLETED|0:0"; echo "TIMEOUT|0:1"')
    fake_slurm("scontrol", "exit 1")
    assert slurm_end.slurm_end("7") == SlurmEnd("TIMEOUT", "0:1")


def test_slurm_end_of_a_forgotten_job(fake_slurm) -> None:
    fake_slurm("scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    assert slurm_end.slurm_end("7") == SlurmEnd(unknown="SLURM no longer knows the job, no accounting")


def test_slurm_end_when_slurm_is_down_or_hangs(fake_slurm) -> None:
    fake_slurm("scontrol", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    assert slurm_end.slurm_end("7").unknown == (
        "SLURM unreachable: scontrol: slurm_load_jobs error: Unable to contact slurm controller"
    )
    fake_slurm("sacct", "exec sleep 30")
    fake_slurm("scontrol", "exec sleep 30")
    assert slurm_end.slurm_end("7").unknown == "SLURM unreachable: scontrol timed out after 1 s"


def _slurm_run(tmp_path: Path, max_steps: int = 100) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.configs_dir.mkdir(parents=True)
    paths.resolved_config.write_text(f"max_steps = {max_steps}\n")
    manage.write_job(paths, {"target": "slurm", "job_id": "1055"})
    return paths


def _status(paths: RunPaths) -> dict[str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert manage.status([str(paths.root)]) == 0
    return {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in out.getvalue().splitlines()
        if ":" in line
    }


def test_status_names_slurm_state_and_the_newest_error(fake_slurm, tmp_path) -> None:
    fake_slurm("scontrol", f"cat <<'EOF'\n{SCONTROL_HET}EOF")
    paths = _slurm_run(tmp_path)
    paths.logs_dir.mkdir(parents=True)
    paths.log_file("orchestrator").write_text(
        "09:00:01 INFO [orchestrator] started\n09:00:02 ERROR [orchestrator] an older error\n"
    )
    (paths.logs_dir / "trainer").mkdir()
    (paths.logs_dir / "trainer" / "rank_0.log").write_text(
        "09:00:03 INFO [trainer] step 64\n"
        "09:00:04 ERROR [trainer] trainer failed: cannot write checkpoint step 65\n"
        "Traceback (most recent call last):\n  ...\n"
    )
    got = _status(paths)
    assert got["job"] == "slurm 1055 -> not in queue (finished, failed or cancelled)"
    assert got["ended"] == (
        "SLURM job 1055 FAILED (exit 3:0): trainer failed: cannot write checkpoint step 65 (logs/trainer/rank_0.log)"
    )


def test_status_answers_when_slurm_hangs(fake_slurm, tmp_path) -> None:
    fake_slurm("squeue", "exec sleep 30")
    got = _status(_slurm_run(tmp_path))
    assert got["job"] == "slurm 1055 -> unknown (SLURM unreachable: squeue timed out after 1 s)"
    assert "ended" not in got  # whether it ended is not known


def test_status_of_a_forgotten_job_that_finished(fake_slurm, tmp_path) -> None:
    fake_slurm("scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    paths = _slurm_run(tmp_path, max_steps=2)
    paths.metrics_file.parent.mkdir(parents=True, exist_ok=True)
    paths.metrics_file.write_text(
        '{"role": "trainer", "step": 1, "loss/mean": 0.5}\n{"role": "trainer", "step": 2, "loss/mean": 0.4}\n'
    )
    assert _status(paths)["ended"] == (
        "SLURM job 1055, state unknown (SLURM no longer knows the job, no accounting): "
        "run finished (trained step 2 of 2)"
    )
