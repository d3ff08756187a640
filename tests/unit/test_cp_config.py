"""Dry-run checks of trainer.model.cp (hpcrl.launch.checks.context_parallel), the cp rank helpers
of hpcrl/trainer/context_parallel.py, and SFT's cp checked against its ranks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.launch.checks import context_parallel, load
from hpcrl.trainer.context_parallel import local_range, owned_tokens

BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']


def test_cp_must_divide_trainer_ranks() -> None:
    cfg = load([*BASE, "--trainer.model.cp", "2"]).config
    context_parallel(cfg, trainer_ranks=4, on_gpu=False)
    with pytest.raises(ConfigError) as e:
        context_parallel(cfg, trainer_ranks=3, on_gpu=False)
    assert (
        e.value.one_line() == "config error: trainer.model.cp: 2 must divide the number of trainer ranks (3)"
    )
    context_parallel(load(BASE).config, trainer_ranks=3, on_gpu=True)  # cp = 1: nothing to check


@pytest.mark.parametrize(
    ("seq_len", "cp", "ok"), [(512, 2, True), (514, 4, False), (513, 2, False), (384, 3, True)]
)
def test_cp_must_divide_seq_len(seq_len: int, cp: int, ok: bool) -> None:
    cfg = load([*BASE, "--seq-len", str(seq_len), "--trainer.model.cp", str(cp)]).config
    if ok:
        context_parallel(cfg, trainer_ranks=cp, on_gpu=False)
        return
    with pytest.raises(ConfigError) as e:
        context_parallel(cfg, trainer_ranks=cp, on_gpu=False)
    assert e.value.one_line() == (
        f"config error: trainer.model.cp: {cp} must divide seq_len ({seq_len}); use a seq_len that it does"
    )


def test_sft_cp_must_divide_seq_len() -> None:
    from hpcrl.config.schema import SFTConfig

    args = [
        "--model.name",
        "hpcrl/tiny-qwen3",
        "--data.name",
        "x.jsonl",
        "--model.cp",
        "2",
        "--seq-len",
        "65",
    ]
    with pytest.raises(ConfigError, match=r"^model\.cp: 2 must divide seq_len \(65\)"):
        context_parallel(load(args, root=SFTConfig).config, trainer_ranks=2, on_gpu=False)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_cp_on_gpu_needs_flash_attention() -> None:
    cfg = load([*BASE, "--model.cp", "2"]).config
    with pytest.raises(ConfigError, match=r"^model\.cp: 2 on GPU needs a flash-attention kernel"):
        context_parallel(cfg, trainer_ranks=2, on_gpu=True)


def test_sft_cp_is_checked_against_its_ranks() -> None:
    """SFT trains under cp too (the same step as RL); its cp must divide the SFT ranks, in one line
    naming [model] (SFT has no [trainer.model])."""
    from hpcrl.config.schema import SFTConfig

    cfg = load(
        ["--model.name", "hpcrl/tiny-qwen3", "--data.name", "x.jsonl", "--model.cp", "2"], root=SFTConfig
    ).config
    context_parallel(cfg, trainer_ranks=2, on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model\.cp: 2 must divide the number of trainer ranks \(3\)"):
        context_parallel(cfg, trainer_ranks=3, on_gpu=False)


def test_slices_and_owned_tokens_by_hand() -> None:
    # 7 tokens over 2 ranks: padded to 8, rank 0 holds positions 0-3, rank 1 holds 4-7 (7 is padding)
    assert local_range(7, 2, 0) == (8, 0, 4) and local_range(7, 2, 1) == (8, 4, 8)
    # token t is predicted by position t - 1: rank 0 predicts tokens 1-4, rank 1 tokens 5-6
    assert owned_tokens(7, 2, 0).tolist() == [False, True, True, True, True, False, False]
    assert owned_tokens(7, 2, 1).tolist() == [False] * 5 + [True, True]
    assert bool((owned_tokens(7, 2, 0) ^ owned_tokens(7, 2, 1)).sum() == 6)
    assert torch.equal(owned_tokens(4, 1, 0), torch.tensor([False, True, True, True]))


def test_ulysses_needs_cp_to_divide_the_heads() -> None:
    """tiny-qwen3 has 4 attention heads: ulysses over 2 or 4 ranks, not 3; ring over 3 is fine, and
    ulysses on GPU needs no flash-attention package (SDPA per sample)."""
    ulysses = [*BASE, "--seq-len", "516", "--trainer.model.cp_mode", "ulysses"]  # 516: cp 2, 3, 4 divide it
    context_parallel(load([*ulysses, "--trainer.model.cp", "2"]).config, trainer_ranks=4, on_gpu=True)
    context_parallel(load([*ulysses, "--trainer.model.cp", "4"]).config, trainer_ranks=4, on_gpu=False)
    with pytest.raises(ConfigError) as e:
        context_parallel(load([*ulysses, "--trainer.model.cp", "3"]).config, trainer_ranks=3, on_gpu=False)
    assert e.value.one_line() == (
        "config error: trainer.model.cp: 3 with cp_mode 'ulysses' must divide the model's 4 attention heads "
        "(use a cp that does, or cp_mode = 'ring')"
    )
    context_parallel(
        load([*BASE, "--seq-len", "516", "--trainer.model.cp", "3"]).config, trainer_ranks=3, on_gpu=False
    )
