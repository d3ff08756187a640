"""The weight group counts every receiving worker: world = 1 trainer rank + sum of each server's receivers.

Real processes on CPU with gloo: trainer rank 0 (tp_roles trainer: the real group hosting and
PolicyPublisher send path), a "vLLM server with tp = 2" = the real vLLM admin router over HTTP whose
`collective_rpc` runs the real HpcrlWorkerExtension methods in two worker processes (tp_roles
worker), and the real embedded hf server (tp = 1). The orchestrator side is the real PolicySync.
Layout: world 1 + 2 + 1 = 4, rank offsets [1, 3].
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from hpcrl.bus import Bus, WeightGroupAddress  # noqa: E402
from hpcrl.bus.files import decode_json_file  # noqa: E402
from hpcrl.inference.options import ServeOptions, write_server_info  # noqa: E402
from hpcrl.orchestrator.policy import PolicyMismatch, PolicySync  # noqa: E402
from hpcrl.paths import RunPaths  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


class WorkerProcess:
    """One stand-in vLLM worker process; `call` runs one extension method there (JSON lines)."""

    def __init__(self, rank: int, corrupt: bool = False):
        cmd = [sys.executable, "-m", "tests.integration.tp_roles", "worker", "--rank", str(rank)]
        self.proc = subprocess.Popen(
            cmd + (["--corrupt"] if corrupt else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=REPO,
        )
        self.lock = threading.Lock()

    def call(self, method: str, args: tuple = ()) -> Any:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"method": method, "args": list(args)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker process exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StandInEngine:
    """The part of vLLM's engine client the admin router uses: collective_rpc runs the method on
    every worker at once (they block in the same collectives) and returns one result per worker,
    in worker-rank order."""

    def __init__(self, workers: list[WorkerProcess]):
        self.workers = workers

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return list(await asyncio.gather(*(asyncio.to_thread(w.call, method, args) for w in self.workers)))

    async def reset_prefix_cache(self) -> None:  # no KV cache in a stand-in worker
        return None


class TPServer:
    """hpcrl's real vLLM admin router (vllm_routes.router) over real HTTP, on `tp` worker processes,
    announced with the real write_server_info of a vllm backend started with --tensor-parallel-size."""

    def __init__(self, run_dir: Path, index: int, tp: int, corrupt_rank: int | None = None):
        import uvicorn
        from fastapi import FastAPI

        from hpcrl.inference.vllm_routes import router as _router

        self.workers = [WorkerProcess(r, corrupt=r == corrupt_rank) for r in range(tp)]
        app = FastAPI()
        app.state.engine_client = StandInEngine(self.workers)
        app.include_router(_router({"step": 0, "checksum": None}))
        app.add_api_route("/health", lambda: {"status": "ok"})  # vLLM's own route
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in vLLM router did not start"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{port}"
        opts = ServeOptions(
            model_name="tiny", backend="vllm", run_dir=str(run_dir), server_index=index, tp=tp
        )
        write_server_info(opts, port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        for w in self.workers:
            w.stop()


def start_trainer(run_dir: Path, model_dir: Path, servers: int, steps: int) -> subprocess.Popen:
    log = open(run_dir / "trainer.log", "w")  # noqa: SIM115 - closed with the process
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.tp_roles",
        "trainer",
        "--run-dir",
        str(run_dir),
        "--model",
        str(model_dir),
        "--servers",
        str(servers),
        "--steps",
        str(steps),
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture
def cluster(tiny_model_dir: Path, tmp_path: Path):
    """Server 0: the tp = 2 stand-in; server 1: a real hf server. Stopped after the test."""
    from tests.conftest import InferenceServer

    run_dir = tmp_path / "run"
    RunPaths(run_dir).make_dirs()
    made: list[Any] = []
    try:

        def start(tp_kwargs: dict[str, Any] | None = None) -> tuple[Path, TPServer, InferenceServer]:
            made.append(TPServer(run_dir, 0, 2, **(tp_kwargs or {})))
            made.append(InferenceServer(tiny_model_dir, run_dir, index=1))
            return run_dir, made[0], made[1]

        yield start
    finally:
        for m in made:
            m.stop()


async def sync_of(paths: RunPaths) -> tuple[PolicySync, list]:
    bus = Bus(paths, role="orchestrator", listen=False)
    servers = bus.wait_servers(2, timeout=30)
    sync = PolicySync(
        paths, bus, [s.base_url for s in servers], "collective", timeout=120, policy_timeout=120
    )
    await sync.wait_healthy()
    return sync, servers


def test_tp2_server_and_hf_server_share_one_group(cluster, tiny_model_dir: Path) -> None:
    run_dir, tp_server, hf_server = cluster()
    paths = RunPaths(run_dir)
    trainer = start_trainer(run_dir, tiny_model_dir, servers=2, steps=2)
    try:

        async def main() -> list[str]:
            sync, servers = await sync_of(paths)
            assert [s.weight_receivers for s in servers] == [2, 1]
            # A server must refuse a slot that does not match the workers it runs, before joining.
            async with httpx.AsyncClient() as http:
                r = await http.post(
                    f"{tp_server.base_url}/init_broadcaster",
                    json={"host": "127.0.0.1", "port": 1, "world_size": 4, "rank": 1, "receivers": 3},
                )
                assert (
                    r.status_code == 409
                    and "runs 2 weight-receiving worker(s)" in r.json()["error"]["message"]
                )
                r = await http.post(
                    f"{hf_server.base_url}/init_broadcaster",
                    json={"host": "127.0.0.1", "port": 1, "world_size": 4, "rank": 3, "receivers": 2},
                )
                assert (
                    r.status_code == 409 and "receives weights in 1 process" in r.json()["error"]["message"]
                )
            await sync.join_group(servers)
            checksums = []
            for step in (1, 2):
                msg = await sync.exact(step)
                await sync.ensure(msg)  # every worker's checksum checked by the router, then by PolicySync
                await sync.verify(msg)  # GET /weights of both servers
                # Each tp worker independently: what it holds hashes to the trainer's checksum.
                assert [w.call("stored_checksum") for w in tp_server.workers] == [msg.checksum] * 2
                checksums.append(msg.checksum)
            await sync.aclose()
            return checksums

        checksums = asyncio.run(asyncio.wait_for(main(), 240))
        assert trainer.wait(60) == 0, (run_dir / "trainer.log").read_text()[-3000:]
    finally:
        stop(trainer)
    assert checksums[0] != checksums[1]
    address = decode_json_file(paths.endpoint_file("weights"), WeightGroupAddress)
    assert (address.world_size, address.server_indices, address.receivers) == (4, [0, 1], [2, 1])
    # Server 0's workers are ranks 1 and 2 (offset 1 + worker rank); the hf server took rank 3.
    assert [w.call("group_rank") for w in tp_server.workers] == [[1, 4], [2, 4]]


@pytest.mark.slow  # the same check is unit-tested (test_weight_group.py::test_collective_result_...)
@pytest.mark.waits
def test_one_bad_worker_fails_the_update(cluster, tiny_model_dir: Path) -> None:
    """Worker 1 of the tp = 2 server mangles its shard: the router names it, the run stops."""
    run_dir, tp_server, _ = cluster({"corrupt_rank": 1})
    trainer = start_trainer(run_dir, tiny_model_dir, servers=2, steps=1)
    try:

        async def main() -> str:
            sync, servers = await sync_of(RunPaths(run_dir))
            await sync.join_group(servers)
            msg = await sync.exact(1)
            with pytest.raises(PolicyMismatch) as e:
                await sync.ensure(msg)
            await sync.aclose()
            return str(e.value)

        message = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        stop(trainer)
    assert "worker 1 loaded checksum" in message and "sender's" in message, message
    assert tp_server.workers[0].call("stored_checksum") != tp_server.workers[1].call("stored_checksum")
