"""The line `hpcrl run`, `hpcrl status` and tmux.sh print about the dashboard (issue 51): the command
that serves the run's page, its URL, and the ssh tunnel that reaches it from a laptop (a SLURM head
node, any remote machine). `hpcrl dashboard` binds 127.0.0.1 and the first free port from
DASHBOARD_PORT (hpcrl.net); it prints the port it got."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

from hpcrl.net import DASHBOARD_PORT


def dashboard_lines(run_dir: str | Path, port: int = DASHBOARD_PORT, host: str | None = None) -> list[str]:
    here = host or socket.getfqdn()
    if not here or here.startswith("localhost"):
        here = socket.gethostname()
    return [
        f"hpcrl dashboard {shlex.quote(str(run_dir))}  ->  http://127.0.0.1:{port}/",
        f"from your laptop: ssh -N -L {port}:127.0.0.1:{port} {here}  then http://127.0.0.1:{port}/",
    ]
