"""An env host (hpcrl.envs.runtime.host, what each env node runs) carries out the orchestrator's orders: the
server it starts answers rollouts, a killed server is reported, errors what it held and is started
again on the host's node, and past orchestrator.env_server_max_restarts the run ends naming the env.
Real processes on one machine, loopback only (the SLURM version: test_env_nodes_slurm.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.envs.errors import EnvServerFailed
from hpcrl.envs.runtime.hosting import HostedServer
from hpcrl.orchestrator.remote_env import RemoteEnvironment, server_spec, status_file
from hpcrl.paths import RunPaths
from tests.integration.test_env_servers import DOS, ENV, _one

pytestmark = pytest.mark.slow


def _server_pid(log_dir: Path, restarts: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            doc = json.loads(status_file(log_dir).read_text())
            if doc["server"]["restarts"] == restarts:
                return doc["server"]["pid"]
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no env server with restart {restarts}")


def test_a_host_starts_restarts_and_stops_the_servers_it_is_ordered(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    env_vars = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    host = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.envs.runtime.host", "--run-dir", str(paths.root), "--node-index", "0"],
        stdout=(tmp_path / "host.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env_vars,
    )
    logs = tmp_path / "faulty"
    try:
        spec = server_spec(ENV, {"dos": DOS}, "faulty", "train", 2, 2.0, logs, str(paths.root))
        order = HostedServer(
            paths.env_spec_file("train", "faulty"), paths.env_exit_file("train", "faulty"), 0, ""
        )
        env = RemoteEnvironment(spec, max_restarts=1, server=order)

        async def main() -> tuple[str, str, str]:
            first = await _one(env, 0)
            hang = asyncio.ensure_future(_one(env, 4))  # held by the server when it dies
            await asyncio.sleep(0.5)
            os.kill(_server_pid(logs, 0), signal.SIGKILL)
            held = await hang
            again = await _one(env, 0)  # the server the host started again answers
            os.kill(_server_pid(logs, 1), signal.SIGKILL)  # past the limit: the run ends, naming the env
            await asyncio.sleep(1.5)
            with pytest.raises(EnvServerFailed, match="'faulty'.*exit code -9.*env_server_max_restarts"):
                await env.rollout(env.tasks("train")[0], object(), {})
            await env.aclose()
            return first, held, again

        first, held, again = asyncio.run(main())
        assert first == again == "reward 1.0"
        assert "env server for train env 'faulty' died (exit code -9)" in held
        assert not paths.env_spec_file("train", "faulty").exists()  # withdrawn at close
        records = [json.loads(x) for x in paths.placement_log.read_text().splitlines()]
        assert [r["role"] for r in records].count("env-server-train") == 2
        assert records[0]["role"] == "env-host" and records[0]["pid"] == host.pid
    finally:
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=30) == 0
    text = (tmp_path / "host.log").read_text()
    assert text.count("env server train/faulty started") == 2, text
    assert "(pid" in text and "restart 0) exited: killed by signal 9 (SIGKILL)" in text
