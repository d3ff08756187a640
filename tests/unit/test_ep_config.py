"""Dry-run check of trainer.model.ep against the placement (hpcrl.config.validate.expert_parallel),
which `hpcrl run` / `resume` apply as `submit` does: ep divides the trainer ranks and the model's
experts, and needs an MoE model."""

from __future__ import annotations

import pytest

from hpcrl.config import ConfigError, load
from hpcrl.config.validate import expert_parallel

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
