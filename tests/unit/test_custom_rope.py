"""Scaled RoPE in the custom Qwen3 (linear / yarn / llama3: transformers' own frequency functions) and
the configs it does not run: ``impl = "auto"`` keeps transformers for them, ``impl = "custom"`` is
refused in one line, at the dry run too where the model's config.json is local.

Logits: bit-identical to transformers in bf16 (the dtype the engine samples in), far past the
original context, so the scaling is what is being compared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.launch.checks import load

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
    "rope_theta": 1e6,
}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def _variant(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of a model directory with config.json fields replaced (same weights)."""
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    c.update(fields)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("rope", [YARN, LLAMA3, LINEAR], ids=lambda r: r["rope_type"])
def test_scaled_rope_is_bitwise_transformers_in_bf16(
    rope: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from hpcrl.models.qwen3.model import Qwen3ForTraining
    from hpcrl.models.spec import load_model

    path = _variant(tiny_model_dir, tmp_path / "m", rope_parameters=rope, max_position_embeddings=4096)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    custom = load_model(path, "bfloat16", "cpu", attn_impl="sdpa", impl="auto").eval()
    plain = load_model(tiny_model_dir, "bfloat16", "cpu", attn_impl="sdpa", impl="custom").eval()
    assert isinstance(custom, Qwen3ForTraining)  # auto picks the custom model for a scaled RoPE it runs
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size, (1, 24), generator=g)
    pos = torch.arange(24)[None] + 20_000
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos).logits
        got = custom(input_ids=ids, position_ids=pos).logits
        unscaled = plain(input_ids=ids, position_ids=pos).logits
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert not torch.equal(got, unscaled)  # the scaling changed the logits: it was applied


def test_scaled_frequencies_stay_fp32_through_casts() -> None:
    from hpcrl.models.qwen3.model import Rotary

    fixed = (1.0, 0.1, 1 / 3)
    r = Rotary(6, 1e4, fixed, 1.25).to(torch.bfloat16)
    assert r.inv_freq.dtype == torch.float32
    assert torch.equal(r.inv_freq, torch.tensor(fixed, dtype=torch.float32))
    cos, sin = r(torch.zeros(1, dtype=torch.float32), torch.zeros(1, 1, dtype=torch.long))
    assert torch.equal(cos, torch.full((1, 1, 6), 1.25)) and torch.equal(sin, torch.zeros(1, 1, 6))


UNSUPPORTED = {
    "dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "'dynamic'"),
    "longrope": ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope'"),
    "bias": ({"attention_bias": True}, "attention_bias"),
    "sliding": (
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0, "num_hidden_layers": 2},
        "sliding-window",
    ),
    "layer_types": (
        {
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        "sliding-window",
    ),
    # transformers reads rope_scaling over rope_parameters (a config saved by transformers 5, scaled by hand)
    "scaling_first": (
        {
            "rope_parameters": {"rope_type": "default"},
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        },
        "'dynamic'",
    ),
    "per_layer_type": ({"rope_parameters": {"full_attention": YARN}}, "'per-layer-type'"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout"),
}

# what transformers computes as plain full attention: no window without use_sliding_window, none on
# Qwen3 layers below max_window_layers
FULL_ATTENTION = [
    {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},  # Qwen3's published
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2, "num_hidden_layers": 2},
    {
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention", "sliding_attention"],
    },
]


@pytest.mark.parametrize("fields", FULL_ATTENTION)
def test_full_attention_configs_stay_custom(fields: dict) -> None:
    from hpcrl.models.registry import pick_impl

    assert pick_impl("auto", "qwen3", config=fields) == "custom"
    assert pick_impl("custom", "qwen3", config=fields) == "custom"
    assert pick_impl("auto", "qwen3_moe", config={**fields, "use_sliding_window": True}) == (
        "custom" if not fields.get("sliding_window") else "hf"
    )


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_pick_impl_reads_the_config(case: str) -> None:
    from hpcrl.models.registry import pick_impl

    fields, named = UNSUPPORTED[case]
    assert pick_impl("auto", "qwen3_moe", config=fields) == "hf"
    assert pick_impl("hf", "qwen3", config=fields) == "hf"
    with pytest.raises(ConfigError) as e:
        pick_impl("custom", "qwen3", config=fields)
    line = e.value.one_line()
    assert (
        line.startswith("config error: trainer.model.impl: the custom qwen3 does not run ") and named in line
    )
    assert line.endswith("use impl = 'hf' or 'auto'") and "\n" not in line
    assert pick_impl("auto", "qwen3", config={"rope_parameters": YARN}) == "custom"


def test_auto_loads_transformers_where_custom_cannot(tiny_model_dir: Path, tmp_path: Path) -> None:
    from hpcrl.models.qwen3.model import Qwen3ForTraining
    from hpcrl.models.spec import load_model

    path = _variant(tiny_model_dir, tmp_path / "bias", attention_bias=True)
    assert not isinstance(load_model(path, impl="auto"), Qwen3ForTraining)
    with pytest.raises(
        ConfigError, match=r"^trainer\.model\.impl: the custom qwen3 does not run attention_bias"
    ):
        load_model(path, impl="custom")


BASE = ["--orchestrator.train.env", '[{id = "reverse-text"}]']


def test_dry_run_refuses_custom_for_a_local_config_it_cannot_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from hpcrl.config.schema import SFTConfig

    path = str(_variant(tiny_model_dir, tmp_path / "dyn", **UNSUPPORTED["dynamic"][0]))
    load(["--model.name", path, *BASE])  # auto: transformers runs it
    with pytest.raises(ConfigError) as e:
        load(["--model.name", path, *BASE, "--trainer.model.impl", "custom"])
    assert e.value.one_line().startswith("config error: trainer.model.impl: the custom qwen3 does not run ")
    with pytest.raises(ConfigError, match=r"^model\.impl: the custom qwen3 does not run rope_type 'dynamic'"):
        load(["--model.name", path, "--data.name", "x.jsonl", "--model.impl", "custom"], root=SFTConfig)
    llama = str(_variant(tiny_model_dir, tmp_path / "llama", model_type="llama"))
    with pytest.raises(ConfigError, match="no custom implementation for model_type 'llama'"):
        load(["--model.name", llama, *BASE, "--trainer.model.impl", "custom"])
