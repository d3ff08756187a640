"""Every vLLM name hpcrl relies on exists in the installed vLLM (0.33), in the layout hpcrl expects."""

from __future__ import annotations

import importlib
import inspect
import sys
import typing

import pytest

from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from hpcrl.errors import ConfigError  # noqa: E402
from hpcrl.inference import vllm_backend as vb  # noqa: E402
from hpcrl.inference import vllm_routes as vr  # noqa: E402
from hpcrl.inference import vllm_symbols as vs  # noqa: E402


def test_vllm_is_the_supported_release():
    assert vb.vllm_version().startswith(vb.SUPPORTED_VLLM + "."), vb.vllm_version()


@pytest.mark.parametrize("name", sorted(vb.VLLM_SYMBOLS))
def test_symbol_resolves_from_the_newest_layout(name):
    # The first module listed is vLLM 0.33's home: a fallback must not be what makes this pass.
    newest = importlib.import_module(vb.VLLM_SYMBOLS[name][0])
    assert getattr(newest, name) is vb.vllm_symbol(name)


def test_a_missing_symbol_names_itself_and_the_installed_version(monkeypatch):
    monkeypatch.setitem(
        vb.VLLM_SYMBOLS, "no_such_symbol", ("vllm.entrypoints.common.cli_args", "vllm.no_such")
    )
    vb.vllm_symbol.cache_clear()
    with pytest.raises(ConfigError) as e:
        vb.vllm_symbol("no_such_symbol")
    vb.vllm_symbol.cache_clear()
    msg = str(e.value)
    assert f"vllm {vb.vllm_version()} is installed but has no no_such_symbol" in msg
    assert "not installed" not in msg


@pytest.mark.parametrize("method", sorted(vs.ENGINE_CLIENT_METHODS))
def test_engine_client_methods_accept_what_the_routes_pass(method):
    from vllm.engine.protocol import EngineClient
    from vllm.v1.engine.async_llm import AsyncLLM

    for cls in (EngineClient, AsyncLLM):  # the protocol and the engine the API server really uses
        fn = getattr(cls, method)
        assert inspect.iscoroutinefunction(fn), f"{cls.__name__}.{method} is not async"
        params = inspect.signature(fn).parameters
        for kw in vs.ENGINE_CLIENT_METHODS[method]:
            assert kw in params, f"{cls.__name__}.{method} has no keyword {kw}"


def test_pause_mode_keep_exists():
    from vllm.v1.engine.async_llm import AsyncLLM

    mode = inspect.signature(AsyncLLM.pause_generation).parameters["mode"].annotation
    hints = typing.get_type_hints(AsyncLLM.pause_generation)
    assert "keep" in typing.get_args(hints["mode"]), mode


def test_app_state_has_what_the_routes_read():
    entry = sys.modules[vb.vllm_symbol("run_server_worker").__module__]
    source = inspect.getsource(entry.init_app_state)
    for name in vs.APP_STATE:
        assert f"state.{name} =" in source, f"init_app_state no longer sets app.state.{name}"


def test_build_app_is_read_where_hpcrl_patches_it():
    run_server_worker = vb.vllm_symbol("run_server_worker")
    entry = sys.modules[run_server_worker.__module__]
    assert callable(entry.build_app)
    # run_server_worker -> build_and_serve -> the module-global build_app (the name hpcrl replaces)
    assert "build_and_serve" in run_server_worker.__code__.co_names
    assert "build_app" in entry.build_and_serve.__code__.co_names
    params = list(inspect.signature(run_server_worker).parameters)
    assert params[:3] == ["listen_address", "sock", "args"], params


def test_worker_has_the_attributes_the_extension_reads():
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    worker = WorkerBase(VllmConfig(), local_rank=0, rank=1, distributed_init_method="tcp://127.0.0.1:1")
    for name in vs.WORKER_ATTRS:
        assert hasattr(worker, name), f"vLLM's WorkerBase no longer has .{name}"
    assert worker.rank == 1
    # The GPU worker sets the device and the model runner the extension loads weights into.
    source = inspect.getsource(Worker)
    assert "self.device = torch.device(" in source and "self.model_runner: GPUModelRunner =" in source
    assert callable(GPUModelRunner.get_model)


def test_lora_ranks_are_vllms():
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == vb.VLLM_LORA_RANKS


def test_lora_request_accepts_the_body_hpcrl_sends():
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    request = vb.vllm_symbol("LoadLoRAAdapterRequest")(
        **vr.lora_request_body(
            {"lora_name": "policy-lora", "lora_path": "/runs/x/broadcasts/step_3", "step": 3}
        )
    )
    assert (request.lora_name, request.lora_path, request.load_inplace) == (
        "policy-lora",
        "/runs/x/broadcasts/step_3",
        True,
    )
    assert "error" in ErrorResponse.model_fields
