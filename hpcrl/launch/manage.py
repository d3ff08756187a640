"""`hpcrl status`, `hpcrl cancel` for a run directory (local or SLURM); `hpcrl logs` and
`hpcrl components` live in hpcrl.launch.logview."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from hpcrl.launch.rundir_args import _parse, _parser, _run_dir
from hpcrl.paths import RunPaths

NOT_IN_QUEUE = "not in queue (finished, failed or cancelled)"
SQUEUE_TIMEOUT_S = 10.0


def read_job(paths: RunPaths) -> dict[str, Any]:
    try:
        return json.loads(paths.job_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_job(paths: RunPaths, info: dict[str, Any]) -> None:
    from hpcrl.fileio import write_text

    write_text(paths.job_file, json.dumps(info, indent=2))


def job_state(job: dict[str, Any]) -> str:
    if job.get("target") == "slurm":
        jid = str(job.get("job_id", ""))
        cmd = ["squeue", "-h", "-j", jid, "-o", "%T"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"unknown (SLURM unreachable: squeue timed out after {SQUEUE_TIMEOUT_S:.0f} s)"
        except OSError as e:
            return f"unknown (squeue unavailable: {e.strerror or e})"
        states = sorted(set(out.stdout.split()))
        said = " ".join(out.stderr.split())
        if not states and out.returncode != 0 and "invalid job id" not in said.lower():  # controller down
            return f"unknown (SLURM unreachable: squeue: {said[:200] or f'exit {out.returncode}'})"
        return ",".join(states) if states else NOT_IN_QUEUE
    pid = job.get("pid")
    if pid:
        try:
            os.kill(int(pid), 0)
            return "running"
        except OSError:
            return "not running"
    return "unknown"


def status(argv: list[str]) -> int:
    args = _parse(_parser("status"), argv)
    paths = _run_dir(args)
    from hpcrl import checkpoint
    from hpcrl.monitor.metrics import read_metrics

    job = read_job(paths)
    state = job_state(job)
    recs = read_metrics(paths.metrics_file)
    trainer_steps = [r["step"] for r in recs if r.get("role") == "trainer" and "loss/mean" in r]
    orch = [r for r in recs if r.get("role") == "orchestrator" and "reward/all/mean" in r]
    ckpts = checkpoint.list_steps(paths)
    valid = [s for s in ckpts if checkpoint.verify(paths, s, deep=False) is None]
    lines = [
        f"run:          {paths.root}",
        f"job:          {job.get('target', 'unknown')} {job.get('job_id', job.get('pid', ''))} -> {state}",
        *ended_lines(paths, job, state, max(trainer_steps, default=0)),
        f"trained:      step {max(trainer_steps, default=0)}",
        f"reward:       {orch[-1]['reward/all/mean']:.3f} (step {orch[-1]['step']})"
        if orch
        else "reward:       -",
        f"checkpoints:  {', '.join(f'step_{s}' + ('' if s in valid else ' (incomplete)') for s in ckpts) or 'none'}",
        f"weights:      {', '.join(f'step_{s}' for s in RunPaths.steps_in(paths.weights_root)) or 'none'}",
        f"logs:         {paths.logs_dir}/",
        f"rollouts:     {saved_rollouts_line(paths)}",
        *dashboard_status_lines(paths),
    ]
    from hpcrl.launch.logview import component_rows, table

    envs = [r for r in component_rows(paths) if r["env"] != "-"]
    env_lines = ["env servers:", *("  " + line for line in table(envs))] if envs else []
    from hpcrl.launch.stallview import health_lines

    live = state == "running" or (job.get("target") == "slurm" and state != NOT_IN_QUEUE)
    health = health_lines(paths, live)  # a role silent past the bound: unresponsive if live, else exited
    print("\n".join(lines + health + recent_lines(paths, live) + placement_table(paths) + env_lines))
    return 0


RECENT_S = 600  # a running job's warnings shown by `hpcrl status`: those of the last 10 minutes


def recent_lines(paths: RunPaths, live: bool) -> list[str]:
    """The newest distinct WARNING/ERROR lines of the roles' logs (all of a run that ended)."""
    from hpcrl.launch.alerts import recent_warnings

    recent = recent_warnings(paths, RECENT_S if live else None)
    if not recent:
        return []
    when = f"last {RECENT_S // 60} min" if live else "newest"
    return [
        f"recent warnings ({when}; all: hpcrl logs {paths.root} --warnings):",
        *("  " + x for x in recent),
    ]


def ended_lines(paths: RunPaths, job: dict[str, Any], state: str, trained: int) -> list[str]:
    """What ended the run: the local launcher's last line (job.json), or, for a SLURM job that left the
    queue, SLURM's state and the cause in the run's logs (hpcrl.launch.slurm_end)."""
    if job.get("ended"):
        return [f"ended:        {job['ended']} (exit {job.get('exit_code')})"]
    if job.get("target") == "slurm" and state == NOT_IN_QUEUE:
        from hpcrl.launch.slurm_end import slurm_ended_line

        return [f"ended:        {slurm_ended_line(paths, job, trained)}"]
    return []


def saved_rollouts_line(paths: RunPaths) -> str:
    """Which steps have saved rollouts (rollouts/step_N/{train,eval}/, hpcrl.monitor.rollout_files)."""
    from hpcrl.monitor import rollout_files as rf

    steps = rf.steps(paths.root)
    if not steps:
        return "none saved"
    evals = [s for s in steps if "eval" in rf.splits(paths.root, s)]
    newest = steps[-1]
    size = sum(rf.file_size(paths.root, newest, split) for split in rf.SPLITS)
    text = f"{len(steps)} step(s) saved, {steps[0]}..{newest} ({size / 1024:.0f} KiB at step {newest})"
    return text + (f"; eval at {', '.join(map(str, evals[-5:]))}" if evals else "")


def dashboard_status_lines(paths: RunPaths) -> list[str]:
    from hpcrl.launch.dashboard_hint import dashboard_lines

    first, tunnel = dashboard_lines(paths.root)
    return [f"dashboard:    {first}", f"              ({tunnel})"]


def placement_table(paths: RunPaths) -> list[str]:
    """Where every process runs (its newest record in logs/placement/), as a table."""
    from hpcrl.runtime import read_records

    recs = read_records(paths)
    if not recs:
        return []
    rows = [("role", "rank", "node", "gpus", "host", "port", "pid")] + [
        (
            r.get("role", "?"),
            str(r.get("rank", "")),
            str(r.get("node", "")),
            ",".join(map(str, r.get("gpus") or [])) or "-",
            str(r.get("host", "")),
            str(r.get("port") or "-"),
            str(r.get("pid", "")),
        )
        for r in recs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return ["placement:", *table]


def _writes_checkpoints(paths: RunPaths) -> bool:
    """Whether the run's resolved config checkpoints (True when it cannot be read: SLURM or the
    launcher then decides, and says so)."""
    import tomllib

    try:
        ckpt = tomllib.loads(paths.resolved_config.read_text()).get("ckpt")
    except (OSError, tomllib.TOMLDecodeError):
        return True
    return isinstance(ckpt, dict) and not ckpt.get("weights_only", False)


def _checkpoint_then_cancel_slurm(paths: RunPaths, job_id: str) -> int:
    """The job's batch script gets USR2 (what SLURM sends before the time limit): the trainer
    checkpoints, and because the stop file exists the script ends the job instead of requeueing."""
    from hpcrl.fileio import write_text

    write_text(paths.stop_request_file, json.dumps({"requested_at": time.time(), "job_id": job_id}))
    try:
        r = subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], capture_output=True, text=True)
        code, why = r.returncode, " ".join((r.stderr or r.stdout).split())[:300]
    except OSError as e:  # no scancel on this machine
        code, why = 1, str(e)
    if code != 0:
        paths.stop_request_file.unlink(missing_ok=True)
        print(f"hpcrl: error: scancel --batch --signal=USR2 {job_id} failed: {why}", file=sys.stderr)
        return 1
    print(f"hpcrl: asked SLURM job {job_id} to checkpoint and end (USR2 to its batch script; no requeue)")
    return 0


def cancel(argv: list[str]) -> int:
    p = _parser("cancel")
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="the trainer writes a complete checkpoint after its current step, then the run stops "
        "(local: SIGUSR2 to the launcher, no deadline; SLURM: USR2 to the batch script, no requeue, "
        "slurm.signal_before_s - 15 s to finish); without it every process stops within seconds",
    )
    args = _parse(p, argv)
    paths = _run_dir(args)
    job = read_job(paths)
    if args.checkpoint and not _writes_checkpoints(paths):
        print(
            "hpcrl: error: --checkpoint: this run writes no resumable checkpoints ([ckpt] unset or "
            "ckpt.weights_only); `hpcrl cancel` without it stops the run",
            file=sys.stderr,
        )
        return 2
    if job.get("target") == "slurm":
        if args.checkpoint:
            return _checkpoint_then_cancel_slurm(paths, str(job["job_id"]))
        subprocess.run(["scancel", str(job["job_id"])], check=False)
        print(f"hpcrl: cancelled SLURM job {job['job_id']}")
        return 0
    pid = job.get("pid")
    if not pid:
        print(f"hpcrl: error: {paths.job_file} names no job", file=sys.stderr)
        return 2
    sig = signal.SIGUSR2 if args.checkpoint else signal.SIGTERM
    try:
        os.kill(int(pid), sig)
        print(f"hpcrl: sent {sig.name} to launcher {pid}")
    except ProcessLookupError:
        print(f"hpcrl: launcher {pid} is not running")
    return 0
