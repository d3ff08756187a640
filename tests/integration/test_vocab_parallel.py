"""The vocabulary-parallel embedding and LM head (hpcrl.models.vocab_parallel) on real gloo ranks
against one rank's plain computation of the same numbers.

Every rank builds the same tied ``[37, 8]`` embedding / head (37 rows: no world divides it, so
shards are short and padded) and FSDP-shards a small model around it, then makes the weight
vocabulary-parallel over cp groups of 2. Each cp group gets its own data (so dp peers' gradients
really add), each rank of a group its own number of kept rows and tokens (ragged gathers). Checked
on every rank in fp32: logprobs and entropies (sampling temperatures per row), the embedding's rows
(with a ``padding_idx``, whose row gets no gradient), the hidden states' gradients, and the whole
weight gradient (the DTensor's ``full_tensor``) against ``chunked_token_logprobs`` / ``F.embedding``
of the whole weight over all groups' data: atol 1e-5 (logprobs reach -20 here, so fp32 rounding
alone is ~2e-6; measured max 3.6e-6).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

V, H, PAD = 37, 8, 3
ATOL = 1e-5  # fp32: logprobs here reach -20, so rounding alone is ~2e-6


class _Toy:
    """A decoder-shaped module: FSDP shards ``layers``; the embedding and head are tied."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        class Toy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed_tokens = nn.Embedding(V, H, padding_idx=PAD)
                self.layers = nn.ModuleList([nn.Linear(H, H)])
                self.lm_head = nn.Linear(H, V, bias=False)
                self.lm_head.weight = self.embed_tokens.weight

            def get_input_embeddings(self):
                return self.embed_tokens

            def get_output_embeddings(self):
                return self.lm_head

        torch.manual_seed(0)
        return Toy()


def _data(group: int, cp_rank: int):
    """(hidden [K, H], labels [K], temperatures [K], loss weights [K], ids [T], output weights [T, H])."""
    import torch

    g = torch.Generator().manual_seed(100 * group + cp_rank)
    k = 5 + 4 * cp_rank + group  # ragged over the group's ranks
    t = 6 + 3 * cp_rank
    ids = torch.randint(0, V, (t,), generator=g)
    ids[0] = PAD
    return (
        torch.randn(k, H, generator=g),
        torch.randint(0, V, (k,), generator=g),
        0.7 + torch.rand(k, generator=g),
        torch.randn(k, generator=g),
        ids,
        torch.randn(t, H, generator=g),
    )


def worker(out: str, dtype: str = "") -> None:
    import torch
    import torch.nn.functional as F

    from hpcrl.models.chunked import chunked_token_logprobs
    from hpcrl.models.parallelize import make_cp_group
    from hpcrl.models.parallelize import parallelize as shard_model
    from hpcrl.trainer import parallel

    parallel.init_distributed(torch.device("cpu"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    world, rank = parallel.get_world_size(), parallel.get_rank()
    cp = make_cp_group(2)
    model = _Toy.build()
    whole = model.embed_tokens.weight.detach().clone()
    compute = getattr(torch, dtype) if dtype else None  # bf16: cast before the gathers, fp32 reduce
    model = shard_model(model, param_dtype=compute, force=True, cp=cp, vocab_parallel=True)
    w = model.embed_tokens.weight
    assert w is model.lm_head.weight and w.to_local().shape[0] == min(
        -(-V // world), V - rank * -(-V // world)
    )

    h, labels, temp, coef, ids, r = _data(rank // 2, cp.rank)
    h = (h if compute is None else h.to(compute)).requires_grad_()
    vs = model.lm_head.hpcrl_vocab_shard
    lp, ent = vs.logprobs(model.lm_head, h, labels, temp, 3, True)
    emb = model.embed_tokens(ids[None])[0]
    ((lp * coef).sum() + (emb * r).sum()).backward()
    assert w.grad.dtype == torch.float32  # the master dtype: reduced in fp32, as FSDP's reduce_dtype
    grad_w = w.grad.full_tensor()

    # The same on one rank: the whole weight, every group's data.
    ref_w = whole.clone().requires_grad_()
    diffs = {}
    total = 0
    for g in range(world // 2):
        for c in range(2):
            h2, lab2, t2, coef2, ids2, r2 = _data(g, c)
            h2 = h2.requires_grad_()
            lp2, ent2 = chunked_token_logprobs(h2, ref_w, lab2, t2, chunk=4, entropy=True)
            e2 = F.embedding(ids2, ref_w, PAD)
            total = total + (lp2 * coef2).sum() + (e2 * r2).sum()
            if (g, c) == (rank // 2, cp.rank):
                mine = (h2, lp2, ent2, e2)
    total.backward()
    h2, lp2, ent2, e2 = mine
    diffs["logprobs"] = float((lp - lp2).abs().max())
    diffs["entropy"] = float((ent - ent2).abs().max())
    diffs["embedding"] = float((emb.float() - e2).abs().max())
    diffs["grad_hidden"] = float((h.grad.float() - h2.grad).abs().max())
    diffs["grad_weight"] = float((grad_w - ref_w.grad).abs().max())
    diffs["pad_row_grad"] = float(grad_w[PAD].abs().max() - ref_w.grad[PAD].abs().max())
    diffs["grad_scale"] = float(ref_w.grad.abs().max())
    gathered = [None] * world
    import torch.distributed as dist

    dist.all_gather_object(gathered, diffs)
    parallel.destroy_distributed()
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    parallel.hard_exit(0)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "dtype"), [(2, ""), (4, ""), (4, "bfloat16")])
def test_vocab_parallel_equals_whole_weight(tmp_path: Path, world: int, dtype: str) -> None:
    """``bfloat16``: bf16 compute over the fp32 weight (each rank casts its rows before the dp gather,
    the gradient is reduce-scattered and kept in fp32), against the fp32 reference: bf16's rounding
    of logits near 5 (2^-8 relative) bounds the agreement: measured max 0.034 on logprobs of ~20, weight
    gradients 3.3e-2 of a largest entry of 6.1 (0.5 %)."""
    out = tmp_path / "vp.json"
    run_ranks(__file__, world, str(out), dtype, timeout=240)
    ranks = json.loads(out.read_text())
    tol = {"": ATOL, "bfloat16": 0.1}[dtype]
    for rank, d in enumerate(ranks):
        print(
            f"world {world} {dtype or 'fp32'} rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in d.items())
        )
        assert d["grad_scale"] > 1e-2
        for k, v in d.items():
            if k != "grad_scale":
                assert abs(v) <= tol * (d["grad_scale"] if k.startswith("grad") and dtype else 1), (
                    rank,
                    k,
                    v,
                )


if __name__ == "__main__":
    worker(*sys.argv[1:])
