"""FP8 rollout against vLLM 0.33's real modules: the layer-wise reload functions the worker extension
calls on a quantized model (hpcrl.inference.vllm_worker.layerwise_reload) exist with the signatures it
uses, and `inference.quantization`'s values (prime-rl #3031's fp8_per_block / mxfp8) are vLLM's own
online shorthands, accepted by its parser through hpcrl's argv. The call order is recorded with a
stand-in worker in tests/unit/test_vllm_worker_reload.py; a real reload runs in test_worker_extension."""

from __future__ import annotations

import inspect

import pytest

from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from hpcrl.inference import vllm_args as va  # noqa: E402
from hpcrl.inference import vllm_backend as vb  # noqa: E402
from hpcrl.inference.fp8 import SCHEMES  # noqa: E402
from hpcrl.inference.options import ServeOptions  # noqa: E402


def test_reload_functions_take_what_the_worker_passes():
    from vllm.model_executor.model_loader.reload import layerwise

    init, fin = vb.vllm_symbol("initialize_layerwise_reload"), vb.vllm_symbol("finalize_layerwise_reload")
    model, model_config = object(), object()
    inspect.signature(init).bind(model)  # initialize_layerwise_reload(model)
    inspect.signature(fin).bind(model, model_config)
    # finalize forwards *args to finalize_layerwise_processing(model, model_config)
    assert "finalize_layerwise_processing" in fin.__code__.co_names
    inspect.signature(layerwise.finalize_layerwise_processing).bind(model, model_config)
    assert list(inspect.signature(layerwise.finalize_layerwise_processing).parameters) == [
        "model",
        "model_config",
    ]
    # set_current_vllm_config(vllm_config) is a context manager
    assert hasattr(vb.vllm_symbol("set_current_vllm_config")(vllm.config.VllmConfig()), "__enter__")


def test_model_config_says_whether_the_model_is_quantized():
    from vllm.config import ModelConfig

    assert "quantization" in {f for f in ModelConfig.__dataclass_fields__}  # what _hpcrl_quantized reads


@pytest.mark.parametrize("name", ["fp8_per_block", "mxfp8"])
def test_quantization_names_are_vllms_online_shorthands(name):
    from vllm.config.quantization import ONLINE_QUANT_SHORTHAND_NAMES, resolve_quantization_config

    assert name in ONLINE_QUANT_SHORTHAND_NAMES and name in SCHEMES
    if name == "fp8_per_block":  # 128 x 128 weight blocks, as the hf engine emulates them
        import torch

        spec = resolve_quantization_config(name, None).linear.weight
        assert spec.dtype == torch.float8_e4m3fn and spec.scale.dtype == torch.float32
        assert (spec.scale.group_shape.row, spec.scale.group_shape.col) == SCHEMES[name].block == (128, 128)


@pytest.mark.parametrize("name", ["fp8_per_block", "mxfp8"])
def test_vllm_parser_accepts_the_quantization_argv(name, tmp_path):
    opts = ServeOptions(model_name="Qwen/Qwen3-0.6B", backend="vllm", quantization=name)
    argv = vb.vllm_serve_argv(opts, "Qwen/Qwen3-0.6B", va.vllm_parser())
    assert argv[argv.index("--quantization") + 1] == name
    args = va.parse(argv, {"quantization"})
    assert args.quantization == name


def test_an_unknown_quantization_is_refused_in_one_line():
    from hpcrl.errors import ConfigError

    # vLLM's parser takes any text for --quantization (its ModelConfig refuses it only at start) ...
    opts = ServeOptions(model_name="Qwen/Qwen3-0.6B", backend="vllm", quantization="fp7_nonsense")
    va.parse(vb.vllm_serve_argv(opts, "Qwen/Qwen3-0.6B", va.vllm_parser()), {"quantization"})
    # ... so the dry run checks the name against vLLM's own list
    va.check_quantization("fp8_per_block")
    va.check_quantization("fp8")  # prime-rl's configs/debug/concurrency.toml: online per-tensor
    with pytest.raises(ConfigError) as e:
        va.check_quantization("fp7_nonsense")
    assert str(e.value).startswith("inference.quantization") and "\n" not in str(e.value)
    assert "fp8_per_block" in str(e.value)
