"""What every env server says about itself (logs/envs/<kind>/<env>/components.json), and reading it back
for `hpcrl components` / `hpcrl status`: role, env, pid, node, state, restarts."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def server_status(spec: Any, pid: int, workers: list[Any]) -> dict[str, Any]:
    """The server's own status document (written atomically by the server on every change)."""
    node = _node()
    return {
        "env": spec.name,
        "kind": spec.kind,
        "server": {"pid": pid, "node": node, "restarts": spec.restarts},
        "workers": [
            {
                "index": w.index,
                "pid": None if w.proc is None else w.proc.pid,
                "node": node,
                "restarts": w.restarts,
            }
            for w in workers
        ],
    }


def alive(pid: int | None, node: str | None) -> str:
    """running / exited for a pid on this node; unknown for another node's."""
    if pid is None:
        return "starting"
    if node not in (None, _node()):
        return "unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        return "running"
    try:  # a zombie (exited, not yet reaped) is not running
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return "exited" if state in ("Z", "X") else "running"
    except (OSError, IndexError):
        return "running"


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP, a tracer): it runs no code until SIGCONT."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):  # gone, or no /proc: not known to be stopped
        return False


def env_rows(envs_dir: Path) -> list[dict[str, Any]]:
    """One row per env server and worker found under logs/envs/{train,eval}/<env>/components.json."""
    rows: list[dict[str, Any]] = []
    for f in sorted(envs_dir.glob("*/*/components.json")) if envs_dir.exists() else []:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        env = f"{doc.get('kind')}/{doc.get('env')}"
        s = doc.get("server") or {}
        rows.append(
            {
                "role": "env-server",
                "env": env,
                "pid": s.get("pid"),
                "node": s.get("node"),
                "state": alive(s.get("pid"), s.get("node"))
                + (f" ({s['log_lines_lost']} log line(s) lost)" if s.get("log_lines_lost") else ""),
                "restarts": s.get("restarts", 0),
            }
        )
        for w in doc.get("workers") or []:
            state = alive(w.get("pid"), w.get("node"))
            rows.append(
                {
                    "role": f"env-worker {w.get('index')}",
                    "env": env,
                    "pid": w.get("pid"),
                    "node": w.get("node"),
                    "state": state,
                    "restarts": w.get("restarts", 0),
                }
            )
    return rows
