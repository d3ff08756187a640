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

    def __init__(self, rank: int, corrupt: bool = False, die_at_round: int | None = None):
        cmd = [sys.executable, "-m", "tests.integration.tp_roles", "worker", "--rank", str(rank)]
        cmd += ["--die-at-round", str(die_at_round)] if die_at_round is not None else []
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
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # the worker died (test_a_worker_dying_mid_sync...)
                pass
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

    def __init__(
        self,
        run_dir: Path,
        index: int,
        tp: int,
        corrupt_rank: int | None = None,
        dying_rank: int | None = None,
        die_at_round: int | None = None,
    ):
        import uvicorn
        from fastapi import FastAPI

        from hpcrl.inference.vllm_routes import router as _router

        self.workers = [
            WorkerProcess(
                r, corrupt=r == corrupt_rank, die_at_round=die_at_round if r == dying_rank else None
            )
            for r in range(tp)
        ]
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


def start_trainer(
    run_dir: Path, model_dir: Path, servers: int, steps: int, bucket_mb: float = 0.05, timeout: float = 120
) -> subprocess.Popen:
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
        "--bucket-mb",
        str(bucket_mb),
        "--timeout",
        str(timeout),
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


async def sync_of(paths: RunPaths, timeout: float = 120) -> tuple[PolicySync, list]:
    """The orchestrator's side; `timeout` is also each collective's in the servers' group."""
    bus = Bus(paths, role="orchestrator", listen=False)
    servers = bus.wait_servers(2, timeout=30)
    sync = PolicySync(
        paths, bus, [s.base_url for s in servers], "collective", timeout=timeout, policy_timeout=120
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
    """Worker 1 of the tp = 2 server mangles its shard: its verification names the parts, the run stops."""
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
    # worker 1 digests what its load_weights read (after the mangling): it names the parts that differ
    assert "CorruptBucket" in message and "received bytes differ from what the trainer hashed" in message
    assert "from sender rank 0: model.layers.0." in message, message
    assert tp_server.workers[0].call("stored_checksum") != tp_server.workers[1].call("stored_checksum")


def expected_policy(model_dir: Path, step: int) -> dict[str, Any]:
    """What tp_roles' trainer publishes as policy `step` (its weights + 0.01 x (1 + ... + step))."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.model import hf_named_tensors

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for s in range(1, step + 1):
            for p in model.parameters():
                p.add_(0.01 * s)
    return {n: t.contiguous() for n, t in hf_named_tensors(model)}


@pytest.mark.waits
def test_tp2_server_takes_each_byte_once_in_two_round_buffers(
    cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 49, the stand-in tp = 2 vLLM server: per sync the server receives the policy's P bytes
    from the trainer once, each worker its own senders' buckets (sender r goes to worker r mod 2) and
    the rest from the other worker inside the server; the Python side of a worker
    allocates nothing larger than two rounds (a round buffer, or the embedding assembled across
    rounds for load_weights; a tensor larger than two rounds is assembled alone, docs/weights.md); what each worker loaded is bit-identical to a full
    load of the policy."""
    from safetensors.torch import load_file

    bucket_mb = 0.1  # rounds of 104,857 bytes: the 1.4 MB policy takes ~14 of them
    run_dir, tp_server, _ = cluster()
    trainer = start_trainer(run_dir, tiny_model_dir, servers=2, steps=2, bucket_mb=bucket_mb)
    try:

        async def main() -> list[Any]:
            sync, servers = await sync_of(RunPaths(run_dir))
            await sync.join_group(servers)
            seen = []
            for step in (1, 2):
                before = [w.call("last_update").get("stats", {}) for w in tp_server.workers]
                msg = await sync.exact(step)
                await sync.ensure(msg)
                after = [w.call("last_update") for w in tp_server.workers]
                seen.append((msg, before, after))
            await sync.aclose()
            return seen

        seen = asyncio.run(asyncio.wait_for(main(), 240))
        assert trainer.wait(60) == 0, (run_dir / "trainer.log").read_text()[-3000:]
    finally:
        stop(trainer)
    round_bytes = int(bucket_mb * 2**20)
    for msg, before, after in seen:
        got = [
            {k: a["stats"].get(k, 0) - b.get(k, 0) for k in ("received_bytes", "forwarded_in_bytes")}
            for b, a in zip(before, after)
        ]
        # the server takes the policy once from the trainer; with one trainer rank its buckets all go to
        # worker 0 (0 mod 2), and worker 1 gets every round from worker 0 inside the server
        assert got[0]["received_bytes"] + got[1]["received_bytes"] == msg.num_bytes, got
        assert got[1]["received_bytes"] == 0 and got[1]["forwarded_in_bytes"] >= msg.num_bytes, got
        for a in after:
            # a round buffer (<= one round) or a tensor assembled across rounds (the embedding, 200 KB)
            assert 0 < a["largest_empty"] <= 2 * round_bytes, a
    # step 2 (the buffers of step 1 reused): the peak resident memory grows by far less than P
    assert max(a["peak_growth"] for a in seen[1][2]) < seen[1][0].num_bytes / 2, seen[1][2]
    want = expected_policy(tiny_model_dir, 2)
    for w in tp_server.workers:
        w.call("dump", (str(tmp_path / "held.safetensors"),))
        held = load_file(str(tmp_path / "held.safetensors"))
        assert held.keys() == want.keys()
        assert all(torch_equal(held[n], want[n]) for n in want)


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.slow  # ~80 s, mostly the orchestrator's bounded wait for a re-published policy
@pytest.mark.waits
def test_a_worker_dying_mid_sync_ends_in_one_line_naming_the_server(cluster, tiny_model_dir: Path) -> None:
    """Worker 1 of the tp = 2 server exits (as if killed) when round 3 of policy 1 lands: the update
    fails in one line naming the server, within the group's timeout; worker 0, whose ring step
    fails, goes on taking the trainer's buckets (the one trainer rank sends to worker 0 only), so the
    trainer's publish completes (exit 0: nothing hangs). A trainer rank whose sends fail publishes
    files instead (test_rank_killed_mid_broadcast_leaves_no_partial_policy, docs/weights.md)."""
    run_dir, tp_server, _ = cluster({"dying_rank": 1, "die_at_round": 3})
    trainer = start_trainer(run_dir, tiny_model_dir, servers=2, steps=1, timeout=20)
    try:

        async def main() -> tuple[str, float]:
            sync, servers = await sync_of(RunPaths(run_dir), timeout=20)
            await sync.join_group(servers)
            msg = await sync.exact(1)
            t0 = time.monotonic()
            with pytest.raises(Exception) as e:
                await sync.ensure(msg)
            took = time.monotonic() - t0
            await sync.aclose()
            return str(e.value), took

        message, took = asyncio.run(asyncio.wait_for(main(), 240))
        assert trainer.wait(60) == 0, (run_dir / "trainer.log").read_text()[-3000:]
    finally:
        stop(trainer)
    # vLLM's executor reports the dead worker (the stand-in's: "worker process exited" / a broken pipe
    # to it)
    assert f"server {tp_server.base_url} failed to load policy 1" in message, message
    # bounded: the orchestrator waits up to REPUBLISH_S (60 s) for the policy as files, then names the server
    assert "\n" not in message.strip() and took < 90, (took, message)
    assert tp_server.workers[0].call("group_rank") == [1, 4]  # worker 0 is alive and answers
