"""FP8 rollout end to end on CPU pieces: the embedded engine serves emulated FP8 weights (at load and after
each update, the checksum still of the bf16 weights that landed), `inference.quantization` as config
(its [inference.vllm] alias, the refusal with delta sync, the notes), prime-rl's `<trained>-FP8` served
copies, and the bench script's summary arithmetic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hpcrl.config.loader import load
from hpcrl.config.prime_model import fp8_served_copy
from hpcrl.errors import ConfigError
from hpcrl.inference.fp8 import fake_quant, quantized_names
from hpcrl.weights.checksum import state_dict_checksum
from tests.conftest import rl_toml


def _engine(model_dir: Path, quantization: str | None):
    from hpcrl.inference.engine import HFEngine

    return HFEngine(str(model_dir), dtype="float32", device="cpu", seed=0, quantization=quantization)


def test_engine_serves_emulated_fp8_and_verifies_updates_before_quantizing(tiny_model_dir):
    plain, fp8 = _engine(tiny_model_dir, None), _engine(tiny_model_dir, "fp8_per_block")
    names = quantized_names(plain._params)
    assert names and plain.checksum == fp8.checksum  # the checksum is of the weights as loaded
    for n in names:
        assert torch.equal(fp8._params[n], fake_quant(plain._params[n]))
    assert torch.equal(fp8._params["model.embed_tokens.weight"], plain._params["model.embed_tokens.weight"])
    new = {n: plain._params[n] * 1.5 + 0.01 for n in plain._weight_names}
    assert fp8.update_weights(new, step=1) == state_dict_checksum(new)  # verified as sent, then quantized
    for n in names:
        assert torch.equal(fp8._params[n], fake_quant(new[n]))
    assert fp8.policy_step == 1


def test_engine_refuses_a_delta_on_quantized_weights(tiny_model_dir):
    from hpcrl.inference.errors import WeightSyncRefused

    fp8 = _engine(tiny_model_dir, "fp8_per_block")
    with pytest.raises(WeightSyncRefused, match="quantized"):
        fp8.apply_delta(object(), step=1)  # type: ignore[arg-type]


def config(tmp_path: Path, tables: str = "", *flags: str):
    f = tmp_path / "cfg.toml"
    f.write_text(rl_toml(tables=tables))
    return load([str(f), "--output-dir", str(tmp_path / "out"), *flags]).config


def test_quantization_is_a_field_with_a_vllm_alias(tmp_path):
    assert config(tmp_path, "", "--inference.quantization", "mxfp8").inference.quantization == "mxfp8"
    cfg = config(tmp_path, '[inference.vllm]\nquantization = "fp8_per_block"\n')
    assert cfg.inference.quantization == "fp8_per_block" and "quantization" not in cfg.inference.vllm


def test_quantization_reaches_the_servers(tmp_path):
    from hpcrl.inference.server import serve_options
    from hpcrl.inference.vllm_args import notes
    from hpcrl.inference.vllm_backend import hpcrl_args

    cfg = config(tmp_path, "", "--inference.quantization", "fp8_per_block")
    opts = serve_options(cfg)
    assert opts.quantization == "fp8_per_block"
    assert hpcrl_args(opts, "m")["quantization"] == "fp8_per_block"
    (line,) = [n for n in notes(cfg) if n.startswith("inference.quantization")]
    assert "emulates" in line
    cfg.inference.quantization = "awq"
    assert "unquantized" in next(n for n in notes(cfg) if n.startswith("inference.quantization"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed: it checks the name")
def test_dry_run_says_vllm_checks_the_name_where_it_is_absent(tmp_path):
    from hpcrl.launch.vllm_check import dry_run_lines

    cfg = config(tmp_path, "", "--inference.quantization", "fp8_per_block", "--inference.backend", "vllm")
    (line,) = dry_run_lines(cfg)
    assert "(quantization) will be checked by vLLM's parser" in line


def test_delta_sync_with_quantization_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, "", "--inference.quantization", "fp8_per_block", "--trainer.broadcast.delta", "true",
               "--trainer.broadcast.transport", "filesystem")  # fmt: skip
    assert str(e.value).startswith("trainer.broadcast.delta") and "\n" not in str(e.value)


def test_prime_rl_fp8_copy_becomes_online_quantization():
    d = {
        "trainer": {"model": {"name": "zai-org/GLM-5"}},
        "orchestrator": {"model": {"name": "zai-org/GLM-5-FP8"}},
        "inference": {"vllm": {"model": "zai-org/GLM-5-FP8", "tool_call_parser": "glm47"}},
    }
    notes: list[str] = []
    fp8_served_copy(d, "swe.toml", notes)
    assert d["orchestrator"]["model"]["name"] == d["inference"]["vllm"]["model"] == "zai-org/GLM-5"
    assert d["inference"]["quantization"] == "fp8_per_block"
    (note,) = notes
    assert "FP8 copy of the trained model" in note and "#3031" in note


def test_prime_rl_fp8_copy_keeps_a_given_quantization_and_other_models_alone():
    d = {"model": {"name": "Qwen/Qwen3-8B"}, "orchestrator": {"model": {"name": "Qwen/Qwen3-8B-FP8"}},
         "inference": {"vllm": {"quantization": "fp8"}}}  # fmt: skip
    fp8_served_copy(d, "a.toml", [])
    assert "quantization" not in d["inference"] and d["inference"]["vllm"]["quantization"] == "fp8"
    other = {"model": {"name": "Qwen/Qwen3-8B"}, "orchestrator": {"model": {"name": "Qwen/Qwen3-4B"}}}
    notes: list[str] = []
    fp8_served_copy(other, "b.toml", notes)
    assert other["orchestrator"]["model"]["name"] == "Qwen/Qwen3-4B" and not notes  # refused by the caller


def test_another_served_model_is_still_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, '[orchestrator.model]\nname = "Qwen/Qwen3-4B"\n')
    assert str(e.value).startswith("orchestrator.model.name")


def test_bench_summary():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
    from fp8_rollout import summarize

    recs = [{"step": s, "reward/all/mean": 0.1 * s} for s in range(1, 5)]
    recs += [
        {"step": s, "mismatch_kl/all/mean": 0.01 * s, "mismatch/tis_truncated": 0.5} for s in range(1, 5)
    ]
    s = summarize(recs, window=2)
    assert s["steps"] == 4 and s["kl_step1"] == pytest.approx(0.01) and s["kl_mean"] == pytest.approx(0.025)
    assert s["reward_first"] == pytest.approx(0.15) and s["reward_last"] == pytest.approx(0.35)
    assert s["tis_truncated"] == pytest.approx(0.5)
