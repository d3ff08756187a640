"""An inference server whose log the disk refuses keeps serving, and says so where it can be seen
(issue 52's inference × disk full cell): a real `hpcrl inference` with its output on /dev/full (every
write(2) fails with ENOSPC, as a full disk does) answers requests, counts its dropped lines in its
/metrics, and the orchestrator's real /metrics poller names them at WARNING (the console shows the
orchestrator's lines) and beside the server's state in `hpcrl status` (its progress file)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import httpx
import msgspec
import pytest

from hpcrl.bus.messages import ServerInfo
from hpcrl.orchestrator.concurrency.controller import Controller
from hpcrl.orchestrator.concurrency.poller import Poller
from hpcrl.orchestrator.concurrency.prometheus import parse, server_load
from hpcrl.orchestrator.servers import ServerSet
from hpcrl.orchestrator.stalls import StallWatch
from hpcrl.paths import RunPaths
from tests.integration.server_proc import start_inference

pytestmark = pytest.mark.slow
KEY = "lost-lines-test-key"


class _Pool:
    """What the poller reads of a ServerPool: its addresses, its ServerSet and its in-flight gate."""

    def __init__(self, servers: ServerSet):
        from hpcrl.orchestrator.concurrency.limiter import Limiter

        self.servers, self.base_urls = servers, [i.base_url for i in servers.infos]
        self.clients = [None] * len(servers)
        self.limiter, self.on_answer, self.per_sequence, self.caps = Limiter(4), None, False, {}


def test_a_server_whose_log_is_refused_keeps_serving_and_is_named(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc, _, url = start_inference(tiny_model_dir, tmp_path, KEY, 64, log=Path("/dev/full"))
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": str(tiny_model_dir), "prompt": "abc", "max_tokens": 4}
        for _ in range(3):  # it serves, with every line it logs refused
            r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
            assert r.status_code == 200, r.text
        load = server_load(parse(httpx.get(f"{url}/metrics", headers=auth, timeout=10).text))
        assert load.log_lines_lost > 0
        assert "disk full at /dev/full" in (load.log_lost_why or ""), load.log_lost_why

        info = msgspec.json.decode(RunPaths(tmp_path).server_file(0).read_bytes(), type=ServerInfo)
        servers = ServerSet(RunPaths(tmp_path), [info], down_timeout_s=60)
        poller = Poller(_Pool(servers), Controller(1, 4, None, False, 5.0), 64, KEY)
        with caplog.at_level(logging.WARNING, logger="hpcrl.orchestrator.concurrency"):
            asyncio.run(_poll_twice(poller))
        said = [r.getMessage() for r in caplog.records if "log line(s) lost" in r.getMessage()]
        assert len(said) == 1, said  # once: the count did not grow again, or within LOST_REPEAT_S
        assert said[0].startswith(f"inference server 0 ({url}): "), said
        assert "disk full at /dev/full (No space left on device)" in said[0]
        extra = StallWatch(RunPaths(tmp_path), servers, [], 10.0).extra()  # the progress file's fields
        assert extra["servers"] == {servers.name(0): "answering"}
        assert extra["servers_log_lost"] == {servers.name(0): servers.log_lost[0]} and servers.log_lost[0] > 0
        assert proc.poll() is None  # never raised out of the server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _poll_twice(poller: Poller) -> None:
    try:
        await poller.poll_once()
        await poller.poll_once()
    finally:
        if poller._http is not None:
            await poller._http.aclose()
