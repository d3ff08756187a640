"""trainer.model.activation_offload (the shorthand of [trainer.model.ac_offloading]) turns activation
checkpointing on (as prime-rl's ac_offloading does), gets a one-line dry-run note where the trainer
computes on CPU, and the models' own offload flag still reaches both implementations (load_model):
the input each checkpointed decoder layer saves is packed by torch's save_on_cpu instead of the
default saved-tensor path (seen by an outer saved_tensors_hooks that counts what reaches it),
gradients unchanged. The trainer's offloading is hpcrl.trainer.memory_savers (test_memory_savers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.launch.checks import activation_offload_note, load
from hpcrl.models.spec import load_model

BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']


def test_offload_turns_checkpointing_on() -> None:
    model = load([*BASE, "--model.activation-offload"]).config.trainer.model
    assert model.activation_offload and model.activation_checkpointing
    assert model.ac_offloading is not None and model.ac is not None and model.ac.mode == "full"
    plain = load(BASE).config.trainer.model
    assert plain.ac is None and plain.ac_offloading is None and not plain.activation_checkpointing


def test_dry_run_note_on_cpu_only() -> None:
    cfg = load([*BASE, "--model.activation-offload", "--model.activation-checkpointing"]).config
    (note,) = activation_offload_note(cfg, on_gpu=False)
    assert "model.ac_offloading: the trainer computes on CPU, so offloaded activations are copies" in note
    assert activation_offload_note(cfg, on_gpu=True) == []
    assert activation_offload_note(load(BASE).config, on_gpu=False) == []


def _packs_and_grads(model_dir: Path, impl: str, offload: bool) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = load_model(model_dir, impl=impl, activation_checkpointing=True, activation_offload=offload)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    seen = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        seen += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().logsumexp(-1).sum().backward()
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["hf", "custom"])
def test_offload_packs_each_checkpointed_input(tiny_model_dir: Path, impl: str) -> None:
    plain, g_plain = _packs_and_grads(tiny_model_dir, impl, offload=False)
    off, g_off = _packs_and_grads(tiny_model_dir, impl, offload=True)
    layers = load_model(tiny_model_dir, impl=impl).config.num_hidden_layers
    # each layer's checkpointed inputs (its hidden states, and position ids or embeddings: the same
    # number per layer) went to save_on_cpu instead of the outer hook
    assert plain - off >= layers and (plain - off) % layers == 0, (plain, off)
    for n, g in g_plain.items():
        assert torch.allclose(g, g_off[n], atol=1e-6), n
