"""hpcrl's worker extension and routes against vLLM's real worker machinery, on CPU.

vLLM's WorkerWrapperBase.init_worker mixes HpcrlWorkerExtension into (a CPU-startable subclass of) the
real GPU Worker; vLLM's app (build_app, patched as `serve` patches it) is served over real HTTP on the
socket `prepare` bound for port 0; hpcrl's InferenceClient calls the routes; the routes' collective_rpc
reaches the worker through vLLM's `run_method` with args and results encoded by vLLM's msgpack RPC
codec; a real vLLM Qwen3 model loads the weights (from a path, and over a gloo broadcast).
The engine core process and its ZMQ transport are what this stands in for (InProcessEngine).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hpcrl.net import free_port
from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hpcrl.inference import vllm_backend as vb  # noqa: E402
from hpcrl.inference import vllm_routes as vr  # noqa: E402
from hpcrl.inference import vllm_worker as vw  # noqa: E402
from hpcrl.inference.client import InferenceClient, WeightSyncError  # noqa: E402
from hpcrl.inference.options import ServeOptions  # noqa: E402
from hpcrl.weights.checksum import state_dict_checksum  # noqa: E402

WORKER_CLS = "tests.vllm_conformance.cpu_worker.CpuQwenWorker"


class InProcessEngine:
    """Stands in for AsyncLLM -> EngineCore -> executor: same calls, same msgpack codec, one process."""

    def __init__(self, workers: list, model_config):
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.workers, self.model_config = workers, model_config
        self.renderer = self.input_processor = None  # read by OpenAIServingModels, unused by LoRA loads
        self._enc, self._dec = MsgpackEncoder(), MsgpackDecoder()
        self._real = AsyncLLM
        self.calls: list[tuple[str, dict]] = []
        self.loras: list = []

    def _check(self, name: str, *args, **kwargs) -> None:
        inspect.signature(getattr(self._real, name)).bind(self, *args, **kwargs)  # valid for vLLM's engine
        self.calls.append((name, kwargs))

    def _wire(self, obj):
        return self._dec.decode(self._enc.encode(obj))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from vllm.v1.serial_utils import run_method

        self._check("collective_rpc", method, timeout=timeout, args=args, kwargs=kwargs)
        args = tuple(self._wire(list(args)))
        results = await asyncio.to_thread(
            lambda: [run_method(w, method, args, kwargs or {}) for w in self.workers]
        )
        return self._wire(results)

    async def reset_prefix_cache(self, *args, **kwargs):
        self._check("reset_prefix_cache", *args, **kwargs)
        return True

    async def pause_generation(self, *args, **kwargs):
        self._check("pause_generation", *args, **kwargs)

    async def resume_generation(self, *args, **kwargs):
        self._check("resume_generation", *args, **kwargs)

    async def add_lora(self, lora_request):
        self.loras.append(lora_request)
        return True

    async def check_health(self):
        return None

    async def is_paused(self):
        return False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        worker_extension_cls=vb.EXTENSION_CLS,
    ).create_engine_config()
    cfg.parallel_config.worker_cls = WORKER_CLS
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
    return cfg


@pytest.fixture(scope="module")
def wrapper(vllm_config):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    w = WorkerWrapperBase(rpc_rank=0)
    w.init_worker(
        [
            {
                "vllm_config": vllm_config,
                "local_rank": 0,
                "rank": 0,
                "is_driver_worker": True,
                "distributed_init_method": "tcp://127.0.0.1:1",
            }
        ]
    )  # vLLM's own mixing + conflict check
    return w


@pytest.fixture(scope="module")
def server(wrapper, vllm_config, model_dir, tmp_path_factory):
    """vLLM's real app with hpcrl's routes, served on the socket prepare() bound for port 0."""
    import uvicorn
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    run_dir = tmp_path_factory.mktemp("run")
    opts = ServeOptions(
        model_name=str(model_dir),
        served_model_name="policy",
        backend="vllm",
        port=0,
        run_dir=str(run_dir),
        server_index=3,
        lora_rank=8,
    )
    sock, opts, args = vb.prepare(opts, str(model_dir))
    entry = sys.modules[vb.vllm_symbol("run_server_worker").__module__]
    original = entry.build_app
    status = vr.initial_status()
    vb._install_routes(vb.vllm_symbol("run_server_worker"), status)
    try:
        app = entry.build_app(args, ("generate",), vllm_config.model_config)
    finally:
        entry.build_app = original
    engine = InProcessEngine([wrapper], vllm_config.model_config)
    app.state.engine_client = engine
    app.state.openai_serving_models = OpenAIServingModels(
        engine, [BaseModelPath(name="policy", model_path=str(model_dir))]
    )
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    vb._announce_when_ready(opts)  # returns once /health answered and the address file is written
    yield opts, engine, status
    srv.should_exit = True
    thread.join(10)
    sock.close()


def _run(coro):
    return asyncio.run(coro)


def _perturbed(model_dir: Path, out: Path, scale: float) -> dict[str, torch.Tensor]:
    tensors = {k: v * scale + 0.01 for k, v in load_file(model_dir / "model.safetensors").items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    return tensors


def _assert_loaded(wrapper, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(wrapper.worker.model_runner.get_model().named_parameters())
    p = "model.layers.0."
    qkv = torch.cat([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
    assert torch.equal(params[p + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(params[p + "mlp.gate_up_proj.weight"], gate_up)
    embed = tensors["model.embed_tokens.weight"]  # vLLM pads the vocabulary rows
    assert torch.equal(params["model.embed_tokens.weight"][: embed.shape[0]], embed)


def test_vllm_mixes_the_extension_into_its_gpu_worker(wrapper):
    from vllm.v1.worker.gpu_worker import Worker

    assert isinstance(wrapper.worker, Worker) and isinstance(wrapper.worker, vw.HpcrlWorkerExtension)
    assert wrapper._worker_extension_cls is vw.HpcrlWorkerExtension


def test_vllm_rejects_an_extension_that_shadows_the_worker(vllm_config):
    # The check that passed above is live: a method named like one of Worker's is refused.
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    vllm_config.parallel_config.worker_extension_cls = (
        "tests.vllm_conformance.test_worker_extension.Shadowing"
    )
    try:
        with pytest.raises(AssertionError, match="conflicts with the worker"):
            WorkerWrapperBase(rpc_rank=0).init_worker([{"vllm_config": vllm_config}])
    finally:
        vllm_config.parallel_config.worker_extension_cls = vb.EXTENSION_CLS


class Shadowing:
    def init_device(self) -> None: ...


def test_port_zero_is_advertised_with_the_real_port(server):
    from hpcrl.bus.messages import ServerInfo, decode_json
    from hpcrl.paths import RunPaths

    opts, _, _ = server
    info = decode_json(RunPaths(opts.run_dir).server_file(3).read_bytes(), ServerInfo)
    assert info.port == opts.port != 0 and info.base_url == f"http://127.0.0.1:{opts.port}"


def test_update_from_path_through_the_route(server, wrapper, model_dir, tmp_path):
    opts, engine, status = server
    tensors = _perturbed(model_dir, tmp_path / "step_1", 1.5)
    expected = state_dict_checksum(tensors)

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{opts.port}") as c:
            r = await c.update_weights(1, path=str(tmp_path / "step_1"), expected_checksum=expected)
            with pytest.raises(WeightSyncError):
                await c.update_weights(
                    2, path=str(tmp_path / "step_1"), expected_checksum="xxh3_128:" + "0" * 32
                )
            return r, await c._request("GET", "/weights")

    r, weights = _run(go())
    assert r == {"step": 1, "checksum": expected}
    assert weights["checksum"] == expected
    _assert_loaded(wrapper, tensors)
    assert ("reset_prefix_cache", {}) in engine.calls


def test_update_from_a_sharded_publish_through_the_route(server, wrapper, model_dir, tmp_path):
    """broadcasts/step_N written by two trainer ranks (pieces + manifest.json): vLLM's load_weights
    takes the assembled tensors one at a time; the checksum is the full export's."""
    from hpcrl.weights.manifest import finish, write_pieces
    from hpcrl.weights.shards import Piece

    opts, _, _ = server
    tensors = _perturbed(model_dir, tmp_path / "full", 1.25)
    d = tmp_path / "sharded"
    for rank in range(2):
        pieces = []
        for name, t in tensors.items():
            a = -(-t.shape[0] // 2) if t.dim() else 0
            rows = (t[:a] if rank == 0 else t[a:]) if t.dim() else t
            if t.dim() or rank == 0:
                pieces.append(Piece(name, tuple(t.shape), 0 if rank == 0 else a, rows))
        write_pieces(d, rank, pieces, bucket_bytes=1 << 16)
    expected = state_dict_checksum(tensors)
    assert finish(d, 3, world=2).checksum == expected

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{opts.port}") as c:
            return await c.update_weights(3, path=str(d), expected_checksum=expected)

    assert _run(go()) == {"step": 3, "checksum": expected}
    _assert_loaded(wrapper, tensors)


def test_workers_keep_no_copy_of_the_policy_and_refuse_deltas(wrapper, model_dir, tmp_path):
    """vLLM's parameters are fused and TP-sharded: a delta in HF names has no base there short of a
    whole copy of the policy per worker, which hpcrl no longer keeps (issue 49): a worker loads full
    weights and refuses a delta sync in one line."""
    w = wrapper.worker
    tensors = _perturbed(model_dir, tmp_path / "a", 1.1)
    checksum = state_dict_checksum(tensors)
    assert w.hpcrl_update_from_path(str(tmp_path / "a"), False) == checksum
    assert not hasattr(w, "_hpcrl_full")
    _assert_loaded(wrapper, tensors)
    with pytest.raises(RuntimeError, match="a weight delta cannot be applied by vLLM"):
        w.hpcrl_update_from_path(str(tmp_path / "a"), True)


@pytest.mark.parametrize("bucket_mb", [128, 0.02])
def test_update_over_a_gloo_broadcast_through_the_routes(server, wrapper, model_dir, tmp_path, bucket_mb):
    """Protocol 4 into vLLM's real worker: one round (128 MiB), or ~20 KiB rounds where the embedding
    and the MLP weights span rounds and are assembled whole for vLLM's own load_weights, the others go
    straight from the round buffer; the fused qkv / gate_up slices equal a full load's."""
    from hpcrl.weights.collective import broadcast_weights, destroy_group, init_group

    opts, _, _ = server
    tensors = _perturbed(model_dir, tmp_path / "w", 0.5)
    checksum = state_dict_checksum(tensors)
    port, sent = free_port(), {}

    def trainer():  # rank 0 of the weight group, as the trainer's broadcaster
        group = init_group("127.0.0.1", port, 2, 0, backend="gloo", timeout_s=60)
        time.sleep(0.5)
        broadcast_weights(group, tensors, 5, checksum=checksum, bucket_mb=bucket_mb)
        sent["ok"] = True
        destroy_group(group)

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{opts.port}") as c:
            t = threading.Thread(target=trainer)
            t.start()
            await c.init_broadcaster("127.0.0.1", port, world_size=2, rank=1, timeout=60)
            r = await c.update_weights(5, collective=True)
            await asyncio.to_thread(t.join, 60)
            return r

    r = _run(go())
    assert sent == {"ok": True} and r == {"step": 5, "checksum": checksum}
    _assert_loaded(wrapper, tensors)


def test_pause_resume_keep_in_flight_requests(server):
    opts, engine, _ = server

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{opts.port}") as c:
            return await c.pause(), await c.resume()

    paused, resumed = _run(go())
    assert paused["status"] == "paused" and resumed["status"] == "running"
    assert ("pause_generation", {"mode": "keep", "clear_cache": False}) in engine.calls
    assert ("resume_generation", {}) in engine.calls


def _adapter(out: Path, seed: int) -> tuple[str, str]:
    """A peft-format adapter dir (what the trainer publishes): (path, checksum of its tensors)."""
    import json

    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_A.weight": torch.randn(4, 128, generator=g),
        f"{prefix}.lora_B.weight": torch.randn(128, 4, generator=g),
    }
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"})
    )
    save_file(tensors, out / "adapter_model.safetensors")
    return str(out), state_dict_checksum(tensors)


def test_load_lora_adapter_twice_under_one_name_as_the_orchestrator_does(server, tmp_path):
    """The orchestrator's PolicySync loads two policies' adapters (hpcrl's body: `step` included) through
    vLLM's real OpenAIServingModels: one adapter slot replaced in place, the checksum of each adapter's
    tensors reported and compared, /weights tagged with the step, requests then name the adapter."""
    from hpcrl.bus import Bus, PolicyReady
    from hpcrl.bus.messages import ADAPTER_NAME
    from hpcrl.orchestrator.policy import PolicySync
    from hpcrl.paths import RunPaths

    opts, engine, status = server
    paths = RunPaths(tmp_path / "run")
    trainer_bus = Bus(paths, "trainer", listen=False)
    adapters = {step: _adapter(tmp_path / f"step_{step}", seed=step) for step in (11, 12)}

    async def go():
        sync = PolicySync(
            paths,
            Bus(paths, "orchestrator", listen=False),
            [f"http://127.0.0.1:{opts.port}"],
            "filesystem",
            30,
            30,
        )
        seen = []
        for step, (path, checksum) in adapters.items():
            trainer_bus.publish_policy(
                PolicyReady(
                    step=step,
                    transport="filesystem",
                    path=path,
                    checksum=checksum,
                    adapter=True,
                    num_params=1024,
                    num_bytes=4096,
                )
            )
            msg = await sync.exact(step)
            await sync.ensure(msg)  # /load_lora_adapter; raises PolicyMismatch unless the checksum matches
            await sync.verify(msg)  # /weights: step, adapter and its checksum
            seen.append((sync.adapter, dict(status)))
        await sync.aclose()
        return seen

    seen = _run(go())
    for (adapter, st), (step, (path, checksum)) in zip(seen, adapters.items()):
        assert adapter == ADAPTER_NAME
        assert (
            st["step"] == step
            and st["lora_adapters"] == {ADAPTER_NAME: path}
            and st["lora_checksum"] == checksum
        )
    first, second = engine.loras[-2:]
    assert first.lora_name == second.lora_name == ADAPTER_NAME
    assert second.lora_path == adapters[12][0]
    assert first.lora_int_id == second.lora_int_id  # same adapter slot, new weights
    # Requests naming the adapter are tagged with its policy, the others with the base weights' step.
    assert vr.policy_step_for(status, ADAPTER_NAME) == 12
    assert vr.policy_step_for(status, "policy-base") == status["base_step"] != 12


def test_load_lora_adapter_refusals_change_nothing(server, tmp_path):
    opts, _, status = server
    url = f"http://127.0.0.1:{opts.port}/load_lora_adapter"
    path, _ = _adapter(tmp_path / "a", seed=3)
    before = dict(status)
    bad_step = httpx.post(url, json={"lora_name": "x", "lora_path": path, "step": "7"}, timeout=30)
    assert bad_step.status_code == 400 and "step" in bad_step.json()["error"]["message"]
    missing = httpx.post(url, json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=30)
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert status == before
    # hpcrl's `step` is not a field of vLLM's request; load_inplace is hpcrl's default
    fields = vr.lora_request_body({"lora_name": "x", "lora_path": path, "step": 3})
    assert fields == {"lora_name": "x", "lora_path": path, "load_inplace": True}
    vb.vllm_symbol("LoadLoRAAdapterRequest")(**fields)
    # Without hpcrl's load_inplace default vLLM refuses the second policy's adapter:
    httpx.post(url, json={"lora_name": "twice", "lora_path": path}, timeout=30).raise_for_status()
    r = httpx.post(url, json={"lora_name": "twice", "lora_path": path, "load_inplace": False}, timeout=30)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]


def test_layerwise_reload_updates_a_real_vllm_model(wrapper, model_dir, tmp_path, monkeypatch):
    """The update path a quantized model takes (hpcrl.inference.vllm_worker.layerwise_reload), with vLLM's
    own initialize/finalize_layerwise_reload on its real Qwen3 model (bf16 here: vLLM's FP8 kernels need
    a GPU): the fused qkv / gate_up parameters end up holding the new weights."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(wrapper.worker.model_runner.get_model())  # vLLM's loader does this at load
    monkeypatch.setattr(vw.HpcrlWorkerExtension, "_hpcrl_quantized", lambda self: True)
    tensors = _perturbed(model_dir, tmp_path / "reload", 0.5)
    checksum = wrapper.worker.hpcrl_update_from_path(str(tmp_path / "reload"))
    assert checksum == state_dict_checksum(tensors)
    _assert_loaded(wrapper, tensors)


def test_vllms_metrics_carry_the_servers_lost_log_lines(server):
    """vLLM's own /metrics (prometheus_client's registry, as its app mounts it) reports the lines
    this process's log refused, read by the orchestrator's one reader (hpcrl.inference.prom)."""
    import httpx

    from hpcrl import storage
    from hpcrl.orchestrator.concurrency.prometheus import parse, server_load

    opts, _, _ = server
    before = list(storage._DROPPED)
    storage._DROPPED[:] = [before[0] + 5, "disk full at /r/logs/inference.log (No space left on device)"]
    try:
        text = httpx.get(f"http://127.0.0.1:{opts.port}/metrics", timeout=30).text
    finally:
        storage._DROPPED[:] = before
    load = server_load(parse(text))
    assert load.log_lines_lost == before[0] + 5, [x for x in text.splitlines() if "hpcrl" in x]
    assert load.log_lost_why == "disk full at /r/logs/inference.log (No space left on device)"
