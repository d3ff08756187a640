"""The cp attention's state (hpcrl/models/parallelize.py ``apply_cp``, ring_attention.CPBatch): the
group is bound to the attention modules when cp is applied, the micro-batch's layout is a forward
argument. On one rank (group None) a ring-attention model must give the SDPA model's logits and
gradients, for transformers' model and hpcrl's, with activation checkpointing too (its recompute in
the backward gets the layout again as an argument). Multi-rank cp: tests/integration/test_cp_equivalence.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.models.parallelize import apply_cp
from hpcrl.models.ring_attention import CPBatch, register_hf
from hpcrl.models.spec import load_model


def _row(vocab: int) -> tuple[torch.Tensor, torch.Tensor, CPBatch]:
    """Two packed samples (7 and 5 tokens): ids, position ids, layout."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 12), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    seg = torch.cat([torch.zeros(7, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    return ids, pos, CPBatch(seg, torch.arange(12))


def _sdpa_mask(seg: torch.Tensor) -> torch.Tensor:
    t = seg.numel()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return ((seg[:, None] == seg[None, :]) & causal)[None, None]


@pytest.mark.parametrize("impl", ["hf", "custom"])
@pytest.mark.parametrize("ac", [False, True])
def test_ring_model_with_bound_group_equals_sdpa(tiny_model_dir: Path, impl: str, ac: bool) -> None:
    ref = load_model(tiny_model_dir, attn_impl="sdpa", impl=impl, activation_checkpointing=ac)
    ring = load_model(tiny_model_dir, attn_impl=register_hf(), impl=impl, activation_checkpointing=ac)
    ids, pos, cp = _row(ref.config.vocab_size)
    with pytest.raises(RuntimeError, match="cp_batch"):
        ring(input_ids=ids, position_ids=pos)  # no layout: refused, not attended over the slice alone
    with pytest.raises(RuntimeError, match="apply cp to the model first"):
        ring(input_ids=ids, position_ids=pos, cp_batch=cp)  # no group bound yet
    assert apply_cp(ring, None) == ref.config.num_hidden_layers

    want = ref(input_ids=ids, position_ids=pos, attention_mask=_sdpa_mask(cp.segments)).logits
    got = ring(input_ids=ids, position_ids=pos, cp_batch=cp).logits
    assert (want - got).abs().max().item() < 1e-5
    want.square().mean().backward()
    got.square().mean().backward()
    for (name, a), b in zip(ref.named_parameters(), ring.parameters()):
        assert (a.grad - b.grad).abs().max().item() < 1e-5, name
