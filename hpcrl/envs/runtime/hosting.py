"""Who starts an env server for the orchestrator: a child process (beside it) or an env node's host.

    LocalServer   deployment.env_nodes = 0: `python -m hpcrl.envs.runtime.server` as the orchestrator's child
    HostedServer  deployment.env_nodes > 0: an order in the run directory (bus/envs/<kind>--<env>.json,
                  {node, spec}) that the host of env node `node` (hpcrl.envs.runtime.host, the SLURM `envs`
                  component) carries out; the host writes `<kind>--<env>.exit` when that server exits

Both answer the same three questions for hpcrl.orchestrator.remote_env.RemoteEnvironment: start (restart =
a spec with a higher `restarts`), has it exited (with what code), and wait for it to stop. The
orchestrator keeps the one restart counter (orchestrator.env_server_max_restarts) either way; the
host never restarts a server on its own, it only carries out orders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from hpcrl.envs.runtime.server import server_log
from hpcrl.envs.wire import messages as wire


def server_command(spec: wire.ServerSpec) -> list[str]:
    return [sys.executable, "-m", "hpcrl.envs.runtime.server", msgspec.json.encode(spec).decode()]


def popen_server(spec: wire.ServerSpec, python: str | None = None) -> subprocess.Popen:
    """Start one env server, its output appended to logs/envs/<kind>/<env>/server.log."""
    from hpcrl.storage import open_log

    cmd = server_command(spec)
    if python:
        cmd[0] = python
    with open_log(server_log(spec.log_dir), f"env server for {spec.kind} env {spec.name!r}") as out:
        # Its own session: a signal for the orchestrator (the launcher signals the role's process
        # group on a stop, SIGUSR2 before a requeue) is not one for its env server, which the
        # orchestrator stops itself (Stop, then SIGKILL) and which stops when its parent is gone.
        # In the orchestrator's group it exited with the orchestrator's SIGTERM and was restarted
        # under a WARNING ("died (exit code 0)") while the run stopped.
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


class LocalServer:
    """The env server as this process's child."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, spec: wire.ServerSpec) -> None:
        self.proc = popen_server(spec)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """At once (a frozen server answers nothing, a stopped one not even SIGTERM)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def where(self) -> str:
        return "" if self.proc is None else f"pid {self.proc.pid}"


def job_tag() -> str:
    """This SLURM job and requeue ("<job id>.<restart count>"): a host takes only its own job's orders,
    never a requeued job's leftovers (their orchestrator address is dead)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0')}" if job else ""


def read_exit(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, doc: dict) -> None:
    from hpcrl.fileio import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, [json.dumps(doc).encode()], durable=False)


class HostedServer:
    """The env server on env node `node`, started by that node's host from an order file."""

    def __init__(self, order: Path, exit_file: Path, node: int, job: str | None = None) -> None:
        self.order = order
        self.job = job_tag() if job is None else job
        self.exit_file = exit_file
        self.node = node
        self.spec: wire.ServerSpec | None = None
        self.checked = 0.0
        self.code: int | None = None

    def start(self, spec: wire.ServerSpec) -> None:
        self.spec = spec
        self.code = None
        doc = {"node": self.node, "job": self.job, "spec": msgspec.to_builtins(spec)}
        write_json(self.order, doc)

    def exit_code(self) -> int | None:
        """The code the host reported for *this* server (same connect address and restart number)."""
        if self.code is not None or self.spec is None:
            return self.code
        doc = read_exit(self.exit_file)
        if doc and doc.get("connect") == self.spec.connect and doc.get("restarts") == self.spec.restarts:
            self.code = int(doc.get("code", 1))
        return self.code

    def stop(self, timeout: float) -> None:
        """Wait for the exit report (the server got Stop), then withdraw the order; the host stops a
        server whose order is gone."""
        deadline = time.monotonic() + timeout
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.order.unlink(missing_ok=True)

    def kill(self) -> None:
        """Withdraw the order without waiting: the host stops a server whose order is gone."""
        self.order.unlink(missing_ok=True)

    @property
    def pid(self) -> int | None:
        return None

    def where(self) -> str:
        return f"env node {self.node}"
