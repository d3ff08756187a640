"""Ring attention over 3 gloo ranks (hpcrl/models/ring_attention.py): every rank holds one time
slice of a packed row (samples cut by the split, GQA), the K/V blocks travel the ring by send/recv,
and each rank's output and q/k/v gradients equal its slice of SDPA over the whole row with the
block-causal mask (fp32, atol 1e-5). Three ranks, not two, so that a rank skips a block that is in
its future and the gradients of a block make more than one hop before coming home."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

LENS = [5, 13, 4, 8]  # 30 tokens, 10 per rank: samples 2 and 3 straddle the splits
ATOL = 1e-5


def worker(out: str) -> None:
    import torch

    from hpcrl.models.ring_attention import ring_attention
    from hpcrl.trainer import parallel

    parallel.init_distributed(torch.device("cpu"))
    n, r = parallel.get_world_size(), parallel.get_rank()
    g = torch.Generator().manual_seed(0)
    t, h, hkv, d = sum(LENS), 4, 2, 8
    seg = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    pos = torch.arange(t)
    q0, k0, v0 = (torch.randn(1, m, t, d, generator=g) for m in (h, hkv, hkv))
    dout = torch.randn(1, h, t, d, generator=g)

    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    (ref * dout).sum().backward()

    w = t // n
    sl = slice(r * w, (r + 1) * w)
    q2, k2, v2 = (x[:, :, sl].clone().requires_grad_() for x in (q0, k0, v0))
    got = ring_attention(
        q2, k2, v2, segments=seg[sl], positions=pos[sl], group=torch.distributed.group.WORLD, tile=4
    )
    (got * dout[:, :, sl]).sum().backward()
    diffs = {
        "out": float((got - ref[:, :, sl]).abs().max()),
        "dq": float((q2.grad - q.grad[:, :, sl]).abs().max()),
        "dk": float((k2.grad - k.grad[:, :, sl]).abs().max()),
        "dv": float((v2.grad - v.grad[:, :, sl]).abs().max()),
        "dk_scale": float(k.grad[:, :, sl].abs().max()),
    }
    Path(f"{out}.{r}").write_text(json.dumps(diffs))


@pytest.mark.slow
def test_ring_attention_on_three_ranks_equals_sdpa(tmp_path: Path) -> None:
    out = tmp_path / "ring.json"
    run_ranks(__file__, 3, str(out), timeout=120)
    for r in range(3):
        d = json.loads(Path(f"{out}.{r}").read_text())
        print(f"rank {r}: max |diff| out {d['out']:.1e} dq {d['dq']:.1e} dk {d['dk']:.1e} dv {d['dv']:.1e}")
        assert max(d["out"], d["dq"], d["dk"], d["dv"]) <= ATOL
        assert d["dk_scale"] > 1e-3  # every slice's keys get a real gradient


if __name__ == "__main__":
    worker(sys.argv[1])
