"""What ended a SLURM run, for `hpcrl status` once its job has left the queue (its `ended:` line).

A local run keeps its launcher's last line in `job.json` (hpcrl.launch.local.ended); a SLURM job has
no launcher that outlives it, so status asks SLURM and reads the run's own files:

- SLURM's word: `sacct -j ID -X -n -P -o State,ExitCode` where accounting is kept, else `scontrol -o
  show job ID` (it knows a finished job for MinJobAge seconds, 300 by default). A hetjob has one line
  per component (`424+0`, `424+1`): the most telling state is reported (hpcrl.launch.hetjob's order),
  with that component's exit code (`code:signal`). Every call is bounded (TIMEOUT_S): an unreachable
  SLURM is named, never waited on.
- the cause: the newest ERROR line of the role logs (hpcrl.launch.alerts.role_logs,
  hpcrl.launch.logrecords.last_error), naming its log; the role whose step ended the job, as the batch
  script's log says (`step 'trainer' FAILED (exit 1): ending the job`, hpcrl.launch.hetjob), first.
  A job that COMPLETED (or that SLURM forgot, whose trainer reached max_steps) finished: its ERROR
  lines, if any, did not end it. One that SLURM ended (CANCELLED, TIMEOUT, NODE_FAIL, ...) says how
  far it got. Without SLURM's word (past MinJobAge, no accounting) the batch log decides.

The parsing and the choice are pure functions; `slurm_end` and `slurm_ended_line` do the I/O.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.paths import RunPaths

TIMEOUT_S = 5.0
_FIELD = re.compile(r"(\w+)=(\S*)")
_ENDING = re.compile(r"step '([^']+)' (FAILED \(exit -?\d+\)|finished \(exit 0\)): ending the job")


@dataclass(frozen=True)
class SlurmEnd:
    state: str = ""  # COMPLETED, FAILED, "CANCELLED by 0", ...: "" when SLURM cannot say
    exit_code: str = ""  # "1:0": exit code and signal, as SLURM writes them
    unknown: str = ""  # why the state is unknown, as a phrase


@dataclass(frozen=True)
class LogError:
    seconds: float  # clock time of the ERROR line, seconds since midnight (-1: not found)
    message: str  # without its time and level (hpcrl.launch.logrecords.last_error)
    log: str  # the log's path relative to the run directory


# -- pure -------------------------------------------------------------------------------------------
def parse_sacct(text: str) -> list[tuple[str, str]]:
    """(State, ExitCode) of each line of `sacct -n -P -o State,ExitCode` (a hetjob: one per component)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[0]:
            rows.append((parts[0], parts[1]))
    return rows


def parse_scontrol(text: str) -> list[tuple[str, str]]:
    """(JobState, ExitCode) of each job record of `scontrol -o show job` (a hetjob: one per component)."""
    rows = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "JobState" in fields:
            rows.append((fields["JobState"], fields.get("ExitCode", "")))
    return rows


def most_telling(rows: list[tuple[str, str]]) -> SlurmEnd:
    """The job's state: its most telling component's ("FAILED" before "COMPLETED"), with its exit code."""
    from hpcrl.launch.hetjob import _STATE_ORDER  # one order for every reader of a hetjob's state

    def rank(row: tuple[str, str]) -> int:
        word = row[0].split()[0]
        return _STATE_ORDER.index(word) if word in _STATE_ORDER else len(_STATE_ORDER)

    state, code = min(rows, key=rank)  # min is stable: the first component among equals
    return SlurmEnd(state, code)


def ending_step(batch_log: str) -> tuple[str, str] | None:
    """(step, "FAILED (exit 1)" or "finished (exit 0)") of the newest step that ended the job, as the
    batch script logs it (a requeued job appends: the last one is this session's)."""
    found = _ENDING.findall(batch_log)
    return found[-1] if found else None


def pick_error(errors: list[LogError], role: str | None = None) -> LogError | None:
    """The newest ERROR line; among the logs of `role` (the step that ended the job) when it has one."""
    own = [e for e in errors if role and _log_role(e.log) == role]
    pool = own or errors
    return max(pool, key=lambda e: e.seconds) if pool else None


def _log_role(log: str) -> str:
    """logs/trainer.log and logs/trainer/rank_1.log are the trainer's."""
    parts = Path(log).parts
    return Path(parts[1]).stem if len(parts) > 1 and parts[0] == "logs" else ""


def finished_text(trained: int, max_steps: int | None) -> str | None:
    """ "run finished (...)" when the trainer reached max_steps, else None."""
    if max_steps and trained >= max_steps:
        return f"run finished (trained step {trained} of {max_steps})"
    return None


def cause(
    end: SlurmEnd,
    error: LogError | None,
    step: tuple[str, str] | None,
    trained: int,
    max_steps: int | None,
    stop_requested: bool = False,
    not_requeued: str | None = None,
) -> str:
    """Why the run ended, in one phrase. It finished when SLURM says COMPLETED or, SLURM silent, when its
    batch log names no failed step and the trainer reached max_steps; a FAILED job: the ERROR line that
    ended it; a job SLURM ended (CANCELLED, TIMEOUT, NODE_FAIL, ...): how far it got, and its newest
    ERROR line. `not_requeued`: the batch log's reason for not requeueing after a USR2."""
    done = finished_text(trained, max_steps)
    at = f"after trained step {trained}" + (f" of {max_steps}" if max_steps else "")
    word = end.state.split()[0] if end.state else ""
    if word:
        failed = word != "COMPLETED"
    else:
        quiet = step is None and done is None and not (stop_requested or not_requeued)  # nothing says "well"
        failed = (step is not None and step[1].startswith("FAILED")) or quiet
    if not failed:
        if done:
            return done
        if stop_requested:
            return f"stopped on request (hpcrl cancel --checkpoint) {at}"
        if not_requeued:
            return f"stopped on USR2 (time limit or preemption), not requeued {not_requeued}, {at}"
        return at if trained or max_steps else ""  # nothing known of its steps: SLURM's word alone
    if word and word != "FAILED":  # SLURM ended it: its state says why
        return at + (f"; newest ERROR: {error.message} ({error.log})" if error else "")
    if error is not None:
        return f"{error.message} ({error.log})"
    if step is not None and step[1].startswith("FAILED"):
        return f"step '{step[0]}' {_signalled(step[1])}, no ERROR line in the role logs"
    return "no ERROR line in the role logs"


def not_requeued(batch_log: str) -> str | None:
    """The batch script's reason for ending on USR2 without a requeue ("(requeue=1, restarts 3 of 3)"),
    when its newest session ended so; a stop requested by `hpcrl cancel --checkpoint` is not one."""
    starts = list(re.finditer(r"\] job \d+ start ", batch_log))
    session = batch_log[starts[-1].start() :] if starts else batch_log
    found = re.findall(r"not requeueing (\(requeue=[^)]*\))", session)
    return found[-1] if found else None


def _signalled(failed: str) -> str:
    """ "FAILED (exit 137)" -> "FAILED (exit 137: killed by signal 9)": srun's code for a task a signal killed."""
    code = int(failed.rsplit(" ", 1)[1].rstrip(")"))
    return failed[:-1] + f": killed by signal {code - 128})" if code > 128 else failed


def ended_line(job_id: str, end: SlurmEnd, why: str) -> str:
    """`SLURM job 424 FAILED (exit 1:0): <why>`."""
    head = (
        f"SLURM job {job_id} {end.state} (exit {end.exit_code or '?'})"
        if end.state
        else f"SLURM job {job_id}, state unknown ({end.unknown})"
    )
    return f"{head}: {why}" if why else head


# -- I/O --------------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> subprocess.CompletedProcess | str:
    """The command's result, or why it could not run (not installed, timed out)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]} timed out after {TIMEOUT_S:.0f} s"
    except OSError as e:
        return f"{cmd[0]}: {e.strerror or e}"


def slurm_end(job_id: str) -> SlurmEnd:
    """SLURM's state and exit code of a job that left the queue: sacct, else scontrol, else why not."""
    acct = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
    if not isinstance(acct, str) and acct.returncode == 0 and (rows := parse_sacct(acct.stdout)):
        return most_telling(rows)
    ctl = _run(["scontrol", "-o", "show", "job", job_id])
    if not isinstance(ctl, str) and ctl.returncode == 0 and (rows := parse_scontrol(ctl.stdout)):
        return most_telling(rows)
    if isinstance(ctl, str):
        return SlurmEnd(unknown=f"SLURM unreachable: {ctl}")
    said = " ".join((ctl.stderr or ctl.stdout).split())
    if ctl.returncode != 0 and "invalid job id" not in said.lower():  # the controller is down, ...
        return SlurmEnd(unknown=f"SLURM unreachable: scontrol: {said[:200]}")
    no_acct = isinstance(acct, str) or acct.returncode != 0 or "disabled" in acct.stdout + acct.stderr
    return SlurmEnd(unknown="SLURM no longer knows the job" + (", no accounting" if no_acct else ""))


def role_errors(paths: RunPaths) -> list[LogError]:
    """The last ERROR line of each role log that has one, with its clock time."""
    from hpcrl.launch.alerts import role_logs
    from hpcrl.launch.logrecords import last_error

    out = []
    for log in role_logs(paths):
        message = last_error(log)
        if message:
            out.append(LogError(_last_error_time(log), message, _relative(log, paths.root)))
    return out


def _last_error_time(log: Path, tail: int = 65536) -> float:
    from hpcrl.launch.logrecords import LEVELS, records

    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return -1.0
    times = [r.seconds for r in records(lines) if r.level >= LEVELS["error"]]
    return times[-1] if times else -1.0


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _read(path: Path, tail: int = 1 << 20) -> str:
    """The file's last `tail` bytes as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def max_steps_of(paths: RunPaths) -> int | None:
    """The run's max_steps from its resolved config (None when it cannot be read)."""
    import tomllib

    try:
        value = tomllib.loads(paths.resolved_config.read_text()).get("max_steps")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return value if isinstance(value, int) else None


def slurm_ended_line(paths: RunPaths, job: dict[str, Any], trained: int) -> str:
    """The `ended:` line of a SLURM run whose job left the queue."""
    job_id = str(job.get("job_id", ""))
    end = slurm_end(job_id)
    batch = _read(paths.slurm_logs_dir / f"hetjob_{job_id}.log")
    step = ending_step(batch)
    error = pick_error(role_errors(paths), step[0] if step else None)
    stopped = paths.stop_request_file.exists()
    why = cause(end, error, step, trained, max_steps_of(paths), stopped, not_requeued(batch))
    return ended_line(job_id, end, why)
