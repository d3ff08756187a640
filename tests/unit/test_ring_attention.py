"""Ring attention on one rank (hpcrl/models/ring_attention.py): output and gradients equal SDPA
with a block-causal mask over packed samples (GQA, tiles smaller than the row, a padded sample).
The multi-rank merge is tested in tests/integration/test_cp_equivalence.py."""

from __future__ import annotations

import torch

from hpcrl.models.ring_attention import ring_attention


def test_ring_attention_equals_masked_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 2, 7]
    t, h, hkv, d = sum(lens), 4, 2, 8
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(t)
    q0, k0, v0 = (torch.randn(1, n, t, d, generator=g) for n in (h, hkv, hkv))
    dout = torch.randn(1, h, t, d, generator=g)

    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    (ref * dout).sum().backward()
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q0, k0, v0))
    out = ring_attention(q2, k2, v2, segments=seg, positions=pos, tile=6)
    (out * dout).sum().backward()

    assert (out - ref).abs().max().item() < 1e-6
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert (a - b).abs().max().item() < 1e-5
    assert k.grad.abs().max() > 1e-3


def test_tile_rows_bounded_in_bytes():
    from hpcrl.models.ring_attention import tile_rows

    # 16 MiB / (4 B x 4 heads x 8192 keys) = 128 rows; 32 heads x 16384 keys: 8, raised to 64
    assert tile_rows(256, 4, 8192) == 128
    assert tile_rows(256, 32, 16384) == 64
    assert tile_rows(256, 4, 1024) == 256  # small blocks keep the whole tile
    assert tile_rows(6, 32, 16384) == 6  # an explicit small tile stays
