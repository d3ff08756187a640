"""Ulysses attention (hpcrl/models/ulysses.py): on one rank, output and gradients equal SDPA with a
block-causal mask over packed samples (GQA); the head/time exchange itself is checked on 2 gloo
ranks against the whole-row attention, and the full model in tests/integration/test_cp_equivalence.py."""

from __future__ import annotations

import torch

from hpcrl.models.ulysses import _sample_bounds, ulysses_attention


def _packed(lens: list[int], h: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    q, k, v = (torch.randn(1, n, t, d, generator=g) for n in (h, hkv, hkv))
    return seg, q, k, v, torch.randn(1, h, t, d, generator=g)


def reference(seg, q, k, v):
    pos = torch.arange(seg.numel())
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    r = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), attn_mask=mask
    )


def test_sample_bounds_are_the_runs_of_equal_ids() -> None:
    assert _sample_bounds(torch.tensor([0, 0, 1, 2, 2, 2])) == [(0, 2), (2, 3), (3, 6)]


def test_one_rank_equals_masked_sdpa_with_gqa() -> None:
    seg, q0, k0, v0, dout = _packed([5, 9, 1, 7], h=4, hkv=2, d=8)
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    ref = reference(seg, q, k, v)
    (ref * dout).sum().backward()
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q0, k0, v0))
    out = ulysses_attention(q2, k2, v2, segments=seg, group=None)
    (out * dout).sum().backward()
    assert (out - ref).abs().max().item() < 1e-6
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert (a - b).abs().max().item() < 1e-5
    assert k.grad.abs().max() > 1e-3
