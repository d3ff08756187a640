"""Rendezvous of the weight-broadcast group (collective transport) through the run directory.

Trainer rank 0 hosts the group's TCPStore: it writes bus/endpoints/weights.json (host, port, world
size = 1 + number of inference servers) and joins as rank 0. The orchestrator reads that file and
asks each server to POST /init_broadcaster with rank 1 + its index. Everything is discovered through
the shared filesystem, so it works across nodes.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.paths import RunPaths

ENDPOINT = "weights"


def _host_address() -> str:
    """An address other nodes can reach: the hostname's IP (127.0.0.1 on a single box)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def num_servers(cfg: Config) -> int:
    return cfg.deployment.num_inference_servers or 1


def trainer_join_weight_group(paths: RunPaths, cfg: Config, timeout_s: float | None = None) -> Any:
    from hpcrl.bus.files import write_atomic
    from hpcrl.weights.collective import init_group

    host = _host_address()
    port = _free_port(host)
    world = 1 + num_servers(cfg)
    path = paths.endpoint_file(ENDPOINT)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, [json.dumps({"host": host, "port": port, "world_size": world, "time": time.time()}).encode()])
    return init_group(host, port, world, 0, timeout_s=timeout_s or cfg.trainer.broadcast.timeout_s)


def read_weight_group_address(paths: RunPaths, timeout_s: float, poll: float = 0.2) -> dict[str, Any]:
    """Wait (bounded) for trainer rank 0 to announce the group; returns {host, port, world_size}."""
    path = paths.endpoint_file(ENDPOINT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(poll)
    raise TimeoutError(f"no weight-broadcast group announced at {path} after {timeout_s:.0f}s "
                       "(is trainer rank 0 running with trainer.broadcast.transport = collective?)")
