"""Keep one inference server alive in place: what the SLURM server step runs (sbatch/inference.sh).

    python -m hpcrl.launch.keepalive --config CFG --run-dir DIR --server-index I -- hpcrl inference ...

A server that dies is started again on the same node with the same arguments (and GPUs: the srun
task's binding is inherited), after 1, 2, 4 ... s (at most 30 s), up to deployment.max_server_restarts
times; its stale address file is removed first so nobody dials the dead port. The orchestrator sees
the new announcement and loads the current policy into it (hpcrl.orchestrator.servers). Without
this a dying server task ended the whole hetjob (srun --kill-on-bad-exit); with it the job ends only
when the restarts are used up (this process then exits with the server's code). SIGTERM / SIGINT /
SIGUSR2 are forwarded to the server and stop the restarting. `hpcrl run` applies the same policy to its
own children (hpcrl.launch.local).

A server frozen past orchestrator.server_down_timeout_s on another host cannot be killed by the
orchestrator: it writes a kill order (RunPaths.kill_order_file: the frozen pid) instead, which this
process, on the server's node, carries out; the kill then counts as a crash (restart, backoff).
An order naming another pid (a process already replaced) is dropped. Under SLURM the orchestrator
kills the frozen pid through SLURM first (`srun --jobid ... -w NODE kill -9 PID`,
hpcrl.orchestrator.server_end); this process sees that as a crash too, and the order is the fallback.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RESTART_BACKOFF_S = 1.0  # first restart delay; doubles with each restart
RESTART_BACKOFF_MAX_S = 30.0
ORDER_POLL_S = 0.5  # how often a running server's kill order is looked for
# Set for the server: it announces itself as supervised (bus SlurmTask.supervised), so a frozen one
# is ended by its pid, not by ending its SLURM step (which would end this process too).
SUPERVISED_ENV = "HPCRL_SUPERVISED"


def restart_delay(restarts: int) -> float:
    """Backoff before restart number `restarts + 1`: 1, 2, 4, ... seconds, at most 30."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**restarts)


def max_restarts_of(config: Path) -> int:
    """deployment.max_server_restarts of a resolved config (the schema default when it is not set)."""
    from hpcrl.config.loader import read_toml
    from hpcrl.config.schema import DeploymentConfig

    value = read_toml(config).get("deployment", {}).get("max_server_restarts")
    return DeploymentConfig().max_server_restarts if value is None else int(value)


def why(rc: int) -> str:
    return f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}"


def ordered_pid(order: Path | None) -> int | None:
    """The pid a kill order names, or None (no order, or unreadable: a half-written order is read
    again at the next poll; orders are written atomically, so that is only a foreign file)."""
    if order is None:
        return None
    try:
        return int(order.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_or_kill(proc: subprocess.Popen, order: Path | None, label: str) -> int:
    """Wait for the server to exit; carry out a kill order naming it (and drop one naming another
    pid: an order for a process already replaced)."""
    while (rc := proc.poll()) is None:
        pid = ordered_pid(order)
        if pid is not None and order is not None:
            order.unlink(missing_ok=True)
            if pid == proc.pid:
                print(f"[keepalive] {label}: the orchestrator found pid {pid} frozen; killing it", flush=True)
                proc.kill()
                return proc.wait()
        time.sleep(ORDER_POLL_S)
    return rc


def keep_alive(
    cmd: list[str], max_restarts: int, server_file: Path | None, label: str, order: Path | None = None
) -> int:
    stopping: dict[str, int | None] = {"sig": None}
    proc: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        stopping["sig"] = signum
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(s, forward)
    restarts = 0
    while True:
        proc = subprocess.Popen(cmd, env={**os.environ, SUPERVISED_ENV: "1"})
        rc = wait_or_kill(proc, order, label)
        if stopping["sig"] is not None:
            return rc
        if restarts >= max_restarts:
            print(f"[keepalive] {label} {why(rc)}; {restarts} restart(s) used, giving up", flush=True)
            return rc or 1
        delay = restart_delay(restarts)
        restarts += 1
        print(
            f"[keepalive] {label} {why(rc)}; restarting it ({restarts}/{max_restarts}) in {delay:.0f}s",
            flush=True,
        )
        if server_file is not None:
            server_file.unlink(missing_ok=True)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and stopping["sig"] is None:
            time.sleep(0.1)
        if stopping["sig"] is not None:
            return 128 + stopping["sig"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrl.launch.keepalive", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="resolved config: deployment.max_server_restarts")
    p.add_argument("--max-restarts", type=int, help="restarts before giving up (overrides --config)")
    p.add_argument("--run-dir", help="the run directory (to remove a dead server's address file)")
    p.add_argument("--server-index", type=int, default=0)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the server's command line")
    args = p.parse_args(argv)
    from hpcrl.storage import tolerate_std_streams

    tolerate_std_streams()  # its log full: the supervisor of a server must not die of it
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the server's command after --")
    if args.max_restarts is not None:
        limit = args.max_restarts
    elif args.config is not None:
        limit = max_restarts_of(args.config)
    else:
        p.error("give --config or --max-restarts")
    if limit < 0:
        p.error(f"--max-restarts must be >= 0, got {limit}")
    server_file = order = None
    if args.run_dir:
        from hpcrl.paths import RunPaths

        server_file = RunPaths(args.run_dir).server_file(args.server_index)
        order = RunPaths(args.run_dir).kill_order_file(args.server_index)
    return keep_alive(cmd, limit, server_file, f"inference server {args.server_index}", order)


if __name__ == "__main__":
    sys.exit(main())
