"""A server frozen past orchestrator.server_down_timeout_s: the orchestrator kills it where it runs on
this host, and on another host writes the kill order its keepalive carries out
(tests/unit/test_keepalive.py runs that side with real processes)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.bus.messages import ServerInfo
from hpcrl.orchestrator.servers import ServerSet
from hpcrl.orchestrator.stalls import StallWatch
from hpcrl.paths import RunPaths


def _watch(tmp: Path, host: str, pid: int) -> tuple[StallWatch, ServerSet]:
    info = ServerInfo(index=3, base_url=f"http://{host}:8000", host=host, port=8000, pid=pid, model="m")
    servers = ServerSet(RunPaths(tmp), [info], down_timeout_s=30)
    servers.unresponsive[0] = 0.0
    return StallWatch(RunPaths(tmp), servers, [], probe_after_s=5), servers


def test_on_another_host_the_kill_is_an_order_for_its_keepalive(tmp_path: Path, caplog) -> None:
    watch, servers = _watch(tmp_path, "node-b", 4321)
    with caplog.at_level(logging.WARNING):
        asyncio.run(watch.kill(0, 41.0))
    order = RunPaths(tmp_path).kill_order_file(3)
    assert order.read_text() == "4321\n"
    assert 0 in servers.down and 0 not in servers.unresponsive
    (line,) = [r.getMessage() for r in caplog.records if "frozen for 41 s (>" in r.getMessage()]
    assert "frozen for 41 s (> orchestrator.server_down_timeout_s = 30)" in line
    assert f"it runs on node-b: ordered its keepalive there to kill pid 4321 ({order})" in line


@pytest.mark.timeout(30)
def test_on_this_host_the_frozen_process_is_killed(tmp_path: Path, caplog) -> None:
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch, servers = _watch(tmp_path, "127.0.0.1", frozen.pid)
        with caplog.at_level(logging.WARNING):
            asyncio.run(watch.kill(0, 31.0))
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        assert not RunPaths(tmp_path).kill_order_file(3).exists()
        said = " | ".join(r.getMessage() for r in caplog.records)
        assert f"killed pid {frozen.pid} so that its supervisor restarts it" in said
        assert 0 in servers.down
    finally:
        frozen.kill()
