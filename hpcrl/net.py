"""Small network facts every role needs: a free TCP port, and this host's reachable address."""

from __future__ import annotations

import socket

# The run's bearer token of inference servers' admin routes, passed to every process through its
# environment (never a file): the servers check it, the orchestrator and env servers send it.
API_KEY_ENV = "HPCRL_API_KEY"
# `hpcrl dashboard` binds the first free port from here; the hints of `hpcrl run`/status/tmux.sh say it.
DASHBOARD_PORT = 8765


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick). Another process may take it before
    the caller binds, so callers that can bind port 0 themselves should do that instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_address() -> str:
    """An address other nodes can reach: the hostname's IP (127.0.0.1 on a single box)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
