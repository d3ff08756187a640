"""Heterogeneous SLURM jobs: one sbatch script, one `srun` per step, the job ends when any step ends.

submitit (1.5.4) writes one homogeneous `#SBATCH` block and one `srun` line; a hetjob needs one
`#SBATCH` block per component separated by `#SBATCH hetjob`, and per-component `srun --het-group=i`
lines. `HetJobExecutor` subclasses submitit's `SlurmExecutor` only for what it does well (writing
the submission file into its folder, calling `sbatch`, parsing the job id, the `SlurmJob` handle);
the script itself comes from `render_sbatch`, a pure function (used by `--dry-run` and the golden
file test).

Choice: plain shell commands, no pickled callable. submitit's usual model pickles a Python
callable plus its arguments into the folder and unpickles it on the node; we submit a *command*
through `_submit_command` instead, so nothing is pickled at all. Every step runs an ordinary
command line (normally `sbatch/trainer.sh` / `sbatch/inference.sh`, which call `hpcrl trainer ...`
/ `hpcrl inference ...`) and finds its inputs through environment variables (`HPCRL_RUN_DIR`,
`HPCRL_CONFIG` = the resolved config file) - the same contract as the local launcher, and the
rule (docs/architecture.md §3) that no pickle crosses the filesystem holds. It also means a requeued job re-runs the
same script and re-reads the config from disk, which is what resume wants. The price: submitit's
`job.result()` does not apply (there is no result pickle); callers track the job by id
(`job_state`).

What the rendered script does (see `_RUNTIME`):
- job-wide options (name, log, `--signal=B:USR2@N`, `--requeue`, `--open-mode=append`) go in the
  first `#SBATCH` block; per-component resources in each block;
- each step runs as `srun --het-group=i ... --output <folder>/${SLURM_JOB_ID}/<step>.%t.log &`
  (submitit's own `%j` output path does not expand inside a het step, so the job id comes from
  the shell);
- a step's `user_env` (the run's env_vars tables, hpcrl.launch.slurm) is rendered as assignments
  before its srun (`NAME=value srun ...`): srun hands its environment to that step's tasks alone, any
  value included (its `--export` list cannot hold a comma); a `${env:NAME}` in a value expands in
  the batch shell, so a secret that sbatch's environment carries is never written into the script;
- `wait -n` returns when the first step ends; the script names it in the job log
  ("step 'inference' FAILED (exit 1)"), sends SIGTERM to the other steps, waits `stop_grace_s`,
  and exits with that step's code - leaving the batch script ends the job and kills leftovers;
- USR2 (sent `signal_before_s` before the time limit, or by `scancel -b -s USR2` on preemption)
  is forwarded to the steps with `forward_signal=True` (the trainer writes a checkpoint and
  exits); once they exit (or `checkpoint_grace_s` passes) the script runs `scontrol requeue`,
  while `SLURM_RESTART_COUNT < max_requeues`. The requeued job starts the same script again and
  resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from submitit.slurm.slurm import SlurmExecutor, SlurmJob

from hpcrl.config.secrets import ENV_REF_RE
from hpcrl.config.validate import time_seconds

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A hetjob has one state per component; report the most telling one.
_STATE_ORDER = (
    "FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "CANCELLED", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "RUNNING", "REQUEUED", "PENDING", "COMPLETING", "CONFIGURING", "SUSPENDED",
)  # fmt: skip


@dataclass(frozen=True)
class HetComponent:
    """One component of the heterogeneous job: a set of nodes with identical resources.

    `command`, when given, is the component's main step: run by every task of the component
    (nodes x ntasks_per_node). Extra steps on the same nodes go in `HetJobSpec.steps`.
    """

    name: str
    command: Sequence[str] | None = None
    nodes: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None  # every task of a node sees the node's GPUs
    mem: str | None = None  # per node, SLURM syntax: "0" (all), "64G", "512000M"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str | int | None = None  # overrides HetJobSpec.time for this component
    exclusive: bool = False
    extra_sbatch: Sequence[str] = ()  # e.g. ("--reservation=r1",), written in this block
    forward_signal: bool = True  # main step receives the pre-timeout USR2
    end_job_on_success: bool = True  # False: its main step exiting 0 leaves the job running
    srun_args: Sequence[str] = ()  # extra srun options for the main step
    env: Mapping[str, str] = field(default_factory=dict)  # exported to the main step's tasks only
    user_env: Mapping[str, str] = field(default_factory=dict)  # the same, any value (see _assignments)


@dataclass(frozen=True)
class HetStep:
    """An extra `srun` launched inside one component's allocation.

    E.g. the orchestrator beside trainer rank 0: `HetStep("orchestrator", component=0, nodes=1,
    ntasks=1, overlap=True, command=[...])`. `nodes=1` uses the component's first node.
    """

    name: str
    component: int
    command: Sequence[str]
    nodes: int | None = None
    ntasks: int | None = None
    overlap: bool = True  # share the CPUs/GPUs the component's main step already holds
    forward_signal: bool = True
    end_job_on_success: bool = True  # False: exiting 0 leaves the job running
    srun_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # exported to this step's tasks only
    user_env: Mapping[str, str] = field(default_factory=dict)  # the same, any value (see _assignments)


@dataclass(frozen=True)
class HetJobSpec:
    """Everything `render_sbatch` needs. Pure data, no SLURM calls."""

    job_name: str
    components: Sequence[HetComponent]
    steps: Sequence[HetStep] = ()
    time: str | int = "01:00:00"  # SLURM time string or minutes
    env: Mapping[str, str] = field(default_factory=dict)  # exported in the batch script
    setup: Sequence[str] = ()  # shell lines run before the steps (module load, venv)
    extra_sbatch: Sequence[str] = ()  # job-wide options, first block
    requeue: bool = True
    signal_before_s: int | None = 300  # USR2 to the batch shell this long before the limit
    max_requeues: int = 100
    checkpoint_grace_s: int | None = None  # default: signal_before_s - 15
    stop_grace_s: int = 15  # other steps get SIGTERM, then this long before the job exits
    # If this file exists when USR2 arrives, the job checkpoints and ends without requeueing
    # (`hpcrl cancel --checkpoint`); None: every USR2 requeues.
    stop_file: str | None = None

    def all_steps(self) -> list[tuple[str, int, HetStep | HetComponent]]:
        """(name, component index, step-or-component) in launch order: main steps first."""
        out: list[tuple[str, int, HetStep | HetComponent]] = []
        for i, c in enumerate(self.components):
            if c.command is not None:
                out.append((c.name, i, c))
        out += [(s.name, s.component, s) for s in self.steps]
        return out


def validate(spec: HetJobSpec) -> None:
    """Raise ValueError for a spec SLURM would reject late or that would render a broken script."""
    if not spec.components:
        raise ValueError("a hetjob needs at least one component")
    names = [n for n, _, _ in spec.all_steps()]
    if not names:
        raise ValueError("nothing to run: give a component a command or add steps")
    if len(set(names)) != len(names):
        raise ValueError(f"step names must be unique, got {names}")
    for n in [c.name for c in spec.components] + names:
        if not _NAME_RE.match(n):
            raise ValueError(f"name {n!r}: use letters, digits, '_' or '-', starting with a letter")
    for c in spec.components:
        if c.nodes < 1 or c.ntasks_per_node < 1:
            raise ValueError(f"component {c.name!r}: nodes and ntasks_per_node must be >= 1")
    for s in spec.steps:
        if not 0 <= s.component < len(spec.components):
            raise ValueError(f"step {s.name!r}: component {s.component} does not exist")
        if s.nodes is not None and s.nodes > spec.components[s.component].nodes:
            raise ValueError(
                f"step {s.name!r}: {s.nodes} nodes > its component's {spec.components[s.component].nodes}"
            )
    for k in spec.env:
        if not _ENV_RE.match(k):
            raise ValueError(f"env name {k!r} is not a shell variable name")
    for name, _, unit in spec.all_steps():
        for k, v in unit.env.items():
            if not _ENV_RE.match(k) or "," in str(v):
                raise ValueError(f"step {name!r}: env {k}={v!r} must be a shell name with a comma-free value")
        for k in unit.user_env:
            if not _ENV_RE.match(k):
                raise ValueError(f"step {name!r}: env name {k!r} is not a shell variable name")

    for opt in [*spec.extra_sbatch, *(o for c in spec.components for o in c.extra_sbatch)]:
        if not opt.startswith("--"):
            raise ValueError(f"extra sbatch option {opt!r} must be a long option like --exclusive")
    if spec.signal_before_s is not None:
        if spec.signal_before_s < 1:
            raise ValueError("signal_before_s must be >= 1 (or None for no pre-timeout signal)")
        limit = time_seconds(spec.time)
        if limit is not None and spec.signal_before_s >= limit:
            # SLURM would send the pre-timeout signal at once: the job would requeue forever
            raise ValueError(
                f"signal_before_s ({spec.signal_before_s}) must be below the time limit ({limit} s)"
            )


# -- rendering -----------------------------------------------------------------------------------
def _time(t: str | int) -> str:
    return str(t) if isinstance(t, str) else str(int(t))


def _flag(key: str, value: object) -> str:
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def _component_block(spec: HetJobSpec, c: HetComponent) -> list[str]:
    lines = [_flag("nodes", c.nodes), _flag("ntasks-per-node", c.ntasks_per_node)]
    optional = {
        "cpus-per-task": c.cpus_per_task,
        "gpus-per-node": c.gpus_per_node or None,
        "mem": c.mem,
        "partition": c.partition,
        "account": c.account,
        "qos": c.qos,
        "constraint": c.constraint,
    }
    lines += [_flag(k, v) for k, v in optional.items() if v is not None]
    # every component carries its own limit: time is not reliably propagated between components
    lines.append(_flag("time", _time(c.time if c.time is not None else spec.time)))
    if c.exclusive:
        lines.append(_flag("exclusive", True))
    lines += [f"#SBATCH {opt}" for opt in c.extra_sbatch]
    return lines


def _shell_word(value: str, where: str) -> str:
    """`value` as one shell word; a `${env:NAME}` in it expands in the batch shell, where an unset
    NAME stops the script naming `where` (a secret's value is never written into the script)."""
    if ENV_REF_RE.search(value) is None:
        return shlex.quote(value)
    out, last = [], 0
    for m in ENV_REF_RE.finditer(value):
        out.append(re.sub(r'([\\"$`])', r"\\\1", value[last : m.start()]))
        out.append(f"${{{m.group(1)}?is not set ({where} references it)}}")
        last = m.end()
    out.append(re.sub(r'([\\"$`])', r"\\\1", value[last:]))
    return '"' + "".join(out) + '"'


def _assignments(name: str, unit: HetStep | HetComponent) -> str:
    """`NAME=word ... ` before a step's srun: srun passes its environment on to the step's tasks, so
    these reach that step alone, with any value (srun's --export list cannot hold a comma)."""
    words = [f"{k}={_shell_word(str(v), f'step {name}, variable {k}')}" for k, v in unit.user_env.items()]
    return "".join(w + " " for w in words)


def _srun_line(name: str, index: int, unit: HetStep | HetComponent, het: bool = True) -> str:
    # One component (SFT): a plain job, where srun refuses --het-group.
    group = [f"--het-group={index}"] if het else []
    args = ["srun", *group, "--unbuffered", "--kill-on-bad-exit=1", "--open-mode=append"]
    if isinstance(unit, HetStep):
        if unit.nodes is not None:
            # --relative=0: the step's first node is the component's first node (rank 0's node)
            args += [f"--nodes={unit.nodes}", "--relative=0"]
        if unit.ntasks is not None:
            args.append(f"--ntasks={unit.ntasks}")
        if unit.overlap:
            args.append("--overlap")
    elif unit.cpus_per_task is not None:
        args.append(f"--cpus-per-task={unit.cpus_per_task}")  # srun 22.05 does not inherit it
    exports = {"HPCRL_STEP": name, "HPCRL_COMPONENT_INDEX": index, **unit.env}
    args += ["--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items())]
    args += list(unit.srun_args)
    out = f'--output="$STEP_LOGS/{name}.%t.log"'  # double quotes: $STEP_LOGS holds the job id
    cmd = shlex.join(list(unit.command or ()))
    return f"{_assignments(name, unit)}{shlex.join(args)} {out} {cmd}"


def render_sbatch(spec: HetJobSpec, folder: str | Path) -> str:
    """The whole sbatch script for `spec`; job logs go under `folder` (must exist on submit)."""
    validate(spec)
    folder = Path(folder).absolute()
    head = [
        _flag("job-name", spec.job_name),
        _flag("output", str(folder / "hetjob_%j.log")),  # an existing dir: SLURM does not mkdir
        _flag("open-mode", "append"),  # a requeued job appends to the same log
    ]
    if spec.signal_before_s is not None:
        head.append(_flag("signal", f"B:USR2@{spec.signal_before_s}"))  # B: batch shell only
    head.append(_flag("requeue", True) if spec.requeue else _flag("no-requeue", True))
    head += [f"#SBATCH {opt}" for opt in spec.extra_sbatch]

    lines = ["#!/bin/bash", "# Rendered by hpcrl.launch.hetjob: do not edit, re-render instead."]
    for i, c in enumerate(spec.components):
        if i == 0:
            lines += head
        else:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {i}: {c.name}")
        lines += _component_block(spec, c)

    ckpt_grace = spec.checkpoint_grace_s
    if ckpt_grace is None:
        ckpt_grace = max(5, (spec.signal_before_s or 60) - 15)
    lines += [
        "",
        "set -uo pipefail  # no -e: step exit codes are handled below",
        f"MAX_REQUEUES={spec.max_requeues}",
        f"CHECKPOINT_GRACE_S={ckpt_grace}",
        f"STOP_GRACE_S={spec.stop_grace_s}",
        f"REQUEUE={1 if spec.requeue else 0}",
        f"STOP_FILE={shlex.quote(spec.stop_file or '')}",
        f"STEP_LOGS={shlex.quote(str(folder))}/${{SLURM_JOB_ID}}",
    ]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in spec.env.items()]
    plain = "" if len(spec.components) > 1 else "$SLURM_JOB_NODELIST"  # a one-component job is no hetjob
    for i, c in enumerate(spec.components):
        # HPCRL_NODES_<COMPONENT>: that component's hostnames, comma separated (rendezvous etc.)
        var = f"HPCRL_NODES_{c.name.upper().replace('-', '_')}"
        lines.append(
            f'export {var}="$(scontrol show hostnames "${{SLURM_JOB_NODELIST_HET_GROUP_{i}:-{plain}}}" | paste -sd, -)"'
        )
    # The traps come before the setup lines: `hpcrl prepare-resume` may hash a big checkpoint for
    # minutes, and a USR2 then (preemption, cancel --checkpoint) must not kill the batch shell.
    lines += ["", _RUNTIME.strip()]
    if spec.setup:
        lines += ["", "# setup", *spec.setup]
    lines += ["", "# steps: one srun each, all in the background"]
    for name, index, unit in spec.all_steps():
        fwd = 1 if unit.forward_signal else 0
        ends = 1 if unit.end_job_on_success else 0
        lines.append(f"{_srun_line(name, index, unit, het=len(spec.components) > 1)} &")
        lines.append(f"track_step $! {name} {fwd} {ends}")
    lines += ["", "supervise", ""]
    return "\n".join(lines)


# The supervising part of every rendered script. Kept as one literal so the golden file shows it.
_RUNTIME = r"""
mkdir -p "$STEP_LOGS"
declare -A STEP_NAME=() STEP_FWD=() STEP_ENDS=()
log() { echo "[hpcrl-hetjob $(date +%FT%T)] $*"; }
log "job ${SLURM_JOB_ID} start (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}; step logs in $STEP_LOGS"

track_step() {  # track_step PID NAME FORWARD_SIGNAL END_JOB_ON_SUCCESS
  STEP_NAME[$1]=$2; STEP_FWD[$1]=$3; STEP_ENDS[$1]=$4
  log "step '$2' started (srun pid $1)"
}

stop_steps() {  # SIGTERM every running step (srun forwards it to the tasks), wait a while
  local pid deadline=$((SECONDS + STOP_GRACE_S))
  for pid in "${!STEP_NAME[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${!STEP_NAME[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  done
}

on_usr2() {  # pre-timeout, preemption or hpcrl cancel --checkpoint: let the trainer checkpoint, then requeue
  trap '' USR2
  local pid deadline=$((SECONDS + CHECKPOINT_GRACE_S))
  log "USR2 (time limit near or preemption): forwarding to the steps that checkpoint"
  for pid in "${!STEP_NAME[@]}"; do
    [[ ${STEP_FWD[$pid]} == 1 ]] && kill -USR2 "$pid" 2>/dev/null
  done
  for pid in "${!STEP_NAME[@]}"; do
    [[ ${STEP_FWD[$pid]} == 1 ]] || continue
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  done
  if [[ -n $STOP_FILE && -e $STOP_FILE ]]; then
    log "not requeueing: a stop was requested ($STOP_FILE, hpcrl cancel --checkpoint)"
  elif ((REQUEUE)) && ((${SLURM_RESTART_COUNT:-0} < MAX_REQUEUES)); then
    log "requeueing job ${SLURM_JOB_ID} (restart $((${SLURM_RESTART_COUNT:-0} + 1)) of at most $MAX_REQUEUES)"
    scontrol requeue "${SLURM_JOB_ID}" || log "scontrol requeue failed"
  else
    log "not requeueing (requeue=$REQUEUE, restarts ${SLURM_RESTART_COUNT:-0} of $MAX_REQUEUES)"
  fi
  stop_steps
  exit 0
}
trap on_usr2 USR2
trap 'log "SIGTERM: stopping the steps"; stop_steps; exit 143' TERM

supervise() {  # the first step to end decides the job's fate
  local pid rc name
  while ((${#STEP_NAME[@]})); do
    pid=""
    wait -n -p pid "${!STEP_NAME[@]}"
    rc=$?
    [[ -n $pid ]] || continue  # woken by a signal whose trap returned
    name=${STEP_NAME[$pid]}
    unset "STEP_NAME[$pid]"
    if ((rc == 0)) && [[ ${STEP_ENDS[$pid]} == 0 ]]; then
      log "step '$name' finished (exit 0); the job goes on"
      continue
    fi
    if ((rc == 0)); then
      log "step '$name' finished (exit 0): ending the job"
    else
      log "step '$name' FAILED (exit $rc): ending the job"
    fi
    stop_steps
    log "job ${SLURM_JOB_ID} exits $rc"
    exit "$rc"
  done
}
"""


# -- submission ----------------------------------------------------------------------------------
class HetJobExecutor(SlurmExecutor):
    """submitit's SlurmExecutor, with the submission file replaced by `render_sbatch(spec)`.

    Only `_submit_command` is used (no pickled callable). The folder holds `hetjob_<id>.log`,
    `<id>/<step>.<task>.log` and submitit's `<id>_submission.sh` link to the script.
    """

    def __init__(self, folder: str | Path, spec: HetJobSpec) -> None:
        super().__init__(folder, max_num_timeout=0)
        self.spec = spec

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self.spec, self.folder)

    def _num_tasks(self) -> int:
        return sum(c.nodes * c.ntasks_per_node for c in self.spec.components)

    def submit_spec(self) -> SlurmJob:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self._submit_command("")  # command unused: the script renders its own sruns


def submit_hetjob(spec: HetJobSpec, folder: str | Path) -> str:
    """Submit `spec`; returns the SLURM job id (the het leader's, e.g. '42')."""
    return str(HetJobExecutor(folder, spec).submit_spec().job_id)


def sbatch_test_only(script: str) -> tuple[bool, str]:
    """`sbatch --test-only` on a rendered script: (accepted, sbatch's message)."""
    if shutil.which("sbatch") is None:
        return False, "sbatch not found"
    p = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=60)
    return p.returncode == 0, (p.stderr or p.stdout).strip()


def _components(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job` fields of each component (one dict per component, [] if unknown)."""
    p = subprocess.run(
        ["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True, timeout=30
    )
    if p.returncode != 0:
        return []
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in p.stdout.splitlines() if "JobState=" in line]


def job_state(job_id: str) -> str:
    """State of a (het) job without accounting: 'PENDING', 'RUNNING', 'COMPLETED', 'FAILED', ...

    Reads `scontrol show job` (which knows finished jobs for MinJobAge seconds), then `sacct`.
    A hetjob's state is its most telling component state. 'UNKNOWN' when SLURM forgot the job.
    """
    states = [c["JobState"] for c in _components(job_id)]
    if not states and shutil.which("sacct"):
        p = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", str(job_id)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        states = [s.split()[0] for s in p.stdout.split("\n") if s.strip()] if p.returncode == 0 else []
    if not states:
        return "UNKNOWN"
    for worst in _STATE_ORDER:
        if worst in states:
            return worst
    return states[0]


def requeue_now(job_id: str) -> None:
    """`scontrol requeue` + start at once: SLURM otherwise holds a requeued job ~120 s."""
    subprocess.run(["scontrol", "requeue", str(job_id)], check=True, capture_output=True, timeout=30)
    release_now(job_id)


def release_now(job_id: str, wait_s: float = 20.0, settle_s: float = 2.0) -> bool:
    """Clear the requeue delay (EligibleTime) of a requeued job so the scheduler starts it now.

    The components of a hetjob are requeued one after the other, and each requeue pushes the
    begin time ~120 s out again; so wait until every component is PENDING, then set StartTime=now
    until no component waits for its begin time. False when that did not happen within `wait_s`.

    SLURM's hold is there for a reason: the nodes revoke the credential of the killed instance,
    and a new start whose credential dates from the same second is refused ("Job credential
    revoked") and ends the job for good. So the begin time is cleared only `settle_s` after every
    component was first seen PENDING.
    """
    deadline = time.monotonic() + wait_s
    pending_since: float | None = None
    while time.monotonic() < deadline:
        comps = _components(job_id)
        if comps and all(c.get("JobState") == "PENDING" for c in comps):
            if not any(c.get("Reason") == "BeginTime" for c in comps):
                return True
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since >= settle_s:
                subprocess.run(
                    ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                    check=False,
                    capture_output=True,
                    timeout=30,
                )
        elif comps and any(c.get("JobState") == "RUNNING" for c in comps):
            return True
        else:
            pending_since = None
        time.sleep(0.5)
    return False
