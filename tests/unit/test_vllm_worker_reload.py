"""The vLLM worker extension's weight updates on a quantized model go through vLLM's layer-wise reload
(initialize -> load_weights -> finalize, under the worker's vllm config); an unquantized model loads
directly. A stand-in worker records the call order; tests/vllm_conformance/test_layerwise_reload.py
checks the same functions and signatures in the real vLLM."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from hpcrl.inference import vllm_worker as vw


class RecordingModel:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def load_weights(self, weights):
        names = [n for n, _ in weights]
        self.calls.append(f"load_weights({','.join(names)})")
        return set(names)


def stand_in(quantization: str | None, calls: list[str]):
    class Worker(vw.HpcrlWorkerExtension):
        def __init__(self) -> None:
            self.rank = 0
            self.device = torch.device("cpu")
            self.model_runner = SimpleNamespace(model=RecordingModel(calls))
            self.model_config = SimpleNamespace(quantization=quantization)
            self.vllm_config = SimpleNamespace(model_config=self.model_config)

    return Worker()


@pytest.fixture
def recorded(monkeypatch):
    calls: list[str] = []

    @contextmanager
    def set_current_vllm_config(cfg):
        calls.append("enter vllm config")
        try:
            yield
        finally:
            calls.append("exit vllm config")

    def initialize_layerwise_reload(model):
        assert isinstance(model, RecordingModel)
        calls.append("initialize_layerwise_reload")

    def finalize_layerwise_reload(model, model_config):
        assert model_config.quantization == "fp8_per_block"
        calls.append("finalize_layerwise_reload")

    fns = {
        f.__name__: f
        for f in (set_current_vllm_config, initialize_layerwise_reload, finalize_layerwise_reload)
    }
    monkeypatch.setattr(vw, "_vllm", lambda name: fns[name])
    return calls


@pytest.fixture
def weights_dir(tmp_path):
    save_file({"a.weight": torch.ones(2, 2), "b.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_quantized_update_goes_through_the_layerwise_reload(recorded, weights_dir):
    w = stand_in("fp8_per_block", recorded)
    checksum = w.hpcrl_update_from_path(weights_dir)
    assert recorded == [
        "enter vllm config",
        "initialize_layerwise_reload",
        "load_weights(a.weight,b.weight)",
        "finalize_layerwise_reload",
        "exit vllm config",
    ]
    assert checksum == w._hpcrl_checksum


def test_unquantized_update_loads_directly(recorded, weights_dir):
    w = stand_in(None, recorded)
    w.hpcrl_update_from_path(weights_dir)
    assert recorded == ["load_weights(a.weight,b.weight)"]


def test_a_failed_load_skips_the_finalize(recorded, weights_dir):
    w = stand_in("fp8_per_block", recorded)

    def boom(weights):
        recorded.append("load_weights")
        raise RuntimeError("bad shard")

    w.model_runner.model.load_weights = boom
    with pytest.raises(RuntimeError, match="bad shard"):
        w.hpcrl_update_from_path(weights_dir)
    assert "finalize_layerwise_reload" not in recorded and recorded[-1] == "exit vllm config"


def test_collective_update_wraps_every_round_in_one_reload(recorded, monkeypatch):
    import hpcrl.weights.collective as collective
    import hpcrl.weights.rounds as rounds

    header = SimpleNamespace(adapter=None, delta=None, step=3, checksum="sent")

    class Sink:  # what rounds.Assembler does: hands load_weights whole tensors as they complete
        def __init__(self, header, device, load):
            self.load = load

    def receive_into(group, header, sink):
        sink.load([("a.weight", torch.ones(2))])  # round 1
        sink.load([("b.weight", torch.ones(3))])  # round 2
        return "landed"

    monkeypatch.setattr(collective, "receive_header", lambda group: header)
    monkeypatch.setattr(collective, "receive_into", receive_into)
    monkeypatch.setattr(rounds, "Assembler", Sink)
    w = stand_in("fp8_per_block", recorded)
    w._hpcrl_group = object()
    assert w.hpcrl_update_collective() == (3, "landed", "sent")
    assert recorded == [
        "enter vllm config",
        "initialize_layerwise_reload",
        "load_weights(a.weight)",
        "load_weights(b.weight)",
        "finalize_layerwise_reload",
        "exit vllm config",
    ]
