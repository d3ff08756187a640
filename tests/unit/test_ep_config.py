"""Dry-run check of trainer.model.ep against the placement (hpcrl.launch.checks.expert_parallel),
which `hpcrl run` / `resume` apply as `submit` does: ep divides the trainer ranks and the model's
experts, and needs an MoE model."""

from __future__ import annotations

import pytest

from hpcrl.config import ConfigError
from hpcrl.launch.checks import expert_parallel, load

ENV = ["--orchestrator.train.env", '[{id = "reverse-text"}]']


def cfg_with(model: str, ep: int):
    return load(["--model.name", model, *ENV, "--trainer.model.ep", str(ep)]).config


@pytest.mark.parametrize(
    ("model", "ep", "ranks", "message"),
    [
        ("hpcrl/tiny-qwen3-moe", 2, 2, None),
        ("hpcrl/tiny-qwen3-moe", 2, 4, None),
        ("hpcrl/tiny-qwen3-moe", 1, 3, None),
        ("hpcrl/tiny-qwen3-moe", 2, 3, "trainer.model.ep: 2 must divide the number of trainer ranks (3)"),
        ("hpcrl/tiny-qwen3-moe", 3, 3, "trainer.model.ep: 3 does not divide the model's 8 experts"),
        (
            "hpcrl/tiny-qwen3",
            2,
            2,
            "trainer.model.ep: 2 needs an MoE model; 'hpcrl/tiny-qwen3' has no experts",
        ),
    ],
)
def test_ep_against_ranks_and_experts(model: str, ep: int, ranks: int, message: str | None) -> None:
    cfg = cfg_with(model, ep)
    if message is None:
        expert_parallel(cfg, ranks)
        return
    with pytest.raises(ConfigError) as e:
        expert_parallel(cfg, ranks)
    assert e.value.one_line() == f"config error: {message}"


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--trainer.model.impl", "hf"], "impl = 'hf'"),
        (["--trainer.model.lora.rank", "4"], "LoRA"),
        (["--trainer.model.attn", "flash_attention_2"], "attn = 'flash_attention_2'"),
    ],
)
def test_ep_needs_the_custom_implementation(extra: list[str], why: str) -> None:
    cfg = load(["--model.name", "hpcrl/tiny-qwen3-moe", *ENV, "--trainer.model.ep", "2", *extra]).config
    with pytest.raises(ConfigError) as e:
        expert_parallel(cfg, 2)
    assert e.value.one_line() == (
        "config error: trainer.model.ep: 2 needs hpcrl's own MoE implementation (impl = 'custom' or "
        f"'auto'), which does not run {why}; use ep = 1"
    )


def test_ep_refused_for_a_local_config_the_custom_model_does_not_run(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "attention_bias": True,
    }))  # fmt: skip
    cfg = load(["--model.name", str(tmp_path), *ENV, "--trainer.model.ep", "2"]).config
    with pytest.raises(ConfigError, match=r"^trainer\.model\.ep: 2 needs .* does not run attention_bias"):
        expert_parallel(cfg, 2)
