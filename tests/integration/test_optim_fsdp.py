"""Muon and sign SGD under FSDP2 on 2 gloo ranks equal one rank, and resume bit for bit.

Each run trains the tiny model 3 steps on the same 4 sequences a step (one rank: all 4; two ranks:
3 | 1, every loss divided by the global token count, FSDP summing the gradients). One rank has plain
tensors: its Muon is torch.optim.Muon's update exactly (tests/unit/test_optim_types.py). Two ranks
hold every parameter as row shards: Muon all-gathers each matrix's update, orthogonalizes it whole
and keeps its rows.

torch's Newton-Schulz runs in bf16 and is very sensitive to its input (the quintic multiplies small
singular values by ~3.4 per iteration): the gradients' float reordering across ranks changes a few
bf16 roundings and the parameters end ~2 % of their movement apart. So the sharding itself is
checked with the same iteration in float64 (``ns = fp64``, patched into hpcrl.trainer.muon): 2 ranks
then equal 1 rank within 1e-5, as AdamW does (test_fsdp_equivalence.py). The bf16 run is held to
5 %. Sign SGD flips only where a gradient is ~0: at most a few elements, each by 2 lr per step.

Every run also saves a checkpoint after step 2 (hpcrl's own format: rank_R.optim.safetensors with
the momentum's row shards) and, in the same process, rebuilds model and optimizer, loads it, and
takes step 3 again: the same parameters bit for bit. The MoE case (ep = 2) covers Muon's stacks of
expert matrices, each rank orthogonalizing its own experts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

LR = 1e-2
STEPS = 3
SPLIT = {1: [(0, 4)], 2: [(0, 3), (3, 4)]}  # sequences [start, end) per rank


def _run(tmp: Path, model_dir: Path, kind: str, world: int, impl: str, ep: int, ns: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    out = tmp / f"{kind}-{world}"
    run_ranks(__file__, world, str(model_dir), str(out), kind, impl, str(ep), ns, timeout=300)
    return load_file(str(out / "uninterrupted.safetensors")), load_file(str(out / "resumed.safetensors"))


@pytest.mark.parametrize(
    ("kind", "preset", "impl", "ep", "ns"),
    [
        ("muon", "tiny", "hf", 1, "fp64"),
        pytest.param("muon", "tiny", "hf", 1, "bf16", marks=pytest.mark.slow),  # bf16: the 5 % bound
        ("sign_sgd", "tiny", "hf", 1, "bf16"),
        ("muon", "tiny-moe", "custom", 2, "fp64"),
    ],
    ids=["muon-fp64", "muon", "sign_sgd", "muon-moe-ep2-fp64"],
)
def test_two_ranks_equal_one_and_resume_bitwise(
    kind: str, preset: str, impl: str, ep: int, ns: str, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    from hpcrl.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", preset=preset, seed=0)
    one, one_resumed = _run(tmp_path, model_dir, kind, 1, impl, 1, ns)
    two, two_resumed = _run(tmp_path, model_dir, kind, 2, impl, ep, ns)
    init = load_file(str(model_dir / "model.safetensors"))
    assert one.keys() == two.keys() == one_resumed.keys() == two_resumed.keys()
    apart = moved = flipped = 0.0
    for k in one:
        assert torch.equal(one[k], one_resumed[k]) and torch.equal(two[k], two_resumed[k]), k
        diff = (one[k] - two[k]).abs()
        if ns == "fp64":
            assert diff.max() <= 1e-5, (k, float(diff.max()))
        elif kind == "sign_sgd":  # an element whose gradient's sign differed moved 2 lr apart
            flipped += int((diff > 1e-6).sum())
            assert diff.max() <= 2 * LR * STEPS + 1e-6, k
        apart += float(diff.sum())
        moved += float((one[k] - init[k]).abs().sum()) if k in init else 0.0
    assert moved > 0
    assert apart <= 0.05 * moved, apart / moved  # bf16 Newton-Schulz: ~2 % measured
    assert flipped <= 1e-4 * sum(v.numel() for v in one.values()), flipped


def test_uneven_row_shards_equal_one_rank() -> None:
    """Matrices of 7 and 3 rows on 2 ranks (4 | 3 and 2 | 1 rows): the gathered update is put
    together and cut back in FSDP's own layout (float64 Newton-Schulz, 2 steps, against unsharded)."""
    outs = run_ranks(__file__, 2, "uneven", timeout=120)
    for out in outs:
        diffs = [float(x) for x in out.split("max diff:")[1].split()[:2]]
        assert max(diffs) <= 1e-6, out[-2000:]


# ---------------------------------------------------------------------------------- worker process


def _batch(step: int, vocab: int, a: int, b: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (4, 12), generator=g)
    return ids[a:b]


def _train_step(model, opt, sched, step: int, a: int, b: int) -> None:
    import torch.nn.functional as F

    from hpcrl.trainer import optim

    ids = _batch(step, model.config.vocab_size, a, b)
    logits = model(input_ids=ids).logits[:, :-1]
    total = 4 * 11  # the global number of predicted tokens: FSDP sums the ranks' gradients
    loss = (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum") / total
    )
    loss.backward()
    optim.clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _build(model_dir: str, kind: str, impl: str, ep: int):
    import torch

    from hpcrl.config.sections.trainer import OptimConfig
    from hpcrl.models import parallelize as mp
    from hpcrl.models.qwen3.parallelize import apply_ep
    from hpcrl.models.spec import load_model
    from hpcrl.trainer import optim

    model = load_model(model_dir, "float32", "cpu", impl=impl)
    experts = apply_ep(model, ep, torch.device("cpu")) if ep > 1 else set()
    model = mp.apply_fsdp(model, ignored_params=experts or None)
    cfg = OptimConfig(type=kind, lr=LR, weight_decay=0.01)  # type: ignore[arg-type]
    opt = optim.optimizer_from_config(model, cfg)
    return model, opt, optim.build_scheduler(opt, "cosine", warmup_steps=1, total_steps=5)


def _ns_fp64(grad, coefficients, steps: int, eps: float):
    """torch.optim.Muon's Newton-Schulz iteration in float64 (its own runs in bf16)."""
    x = grad.double()
    wide = x.T if grad.size(0) > grad.size(1) else x
    wide = wide / wide.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return (wide.T if grad.size(0) > grad.size(1) else wide).float()


def _worker(model_dir: str, out: str, kind: str, impl: str, ep: int, ns: str) -> None:
    import torch
    from safetensors.torch import save_file

    if ns == "fp64":
        import hpcrl.trainer.muon

        hpcrl.trainer.muon._zeropower_via_newtonschulz = _ns_fp64

    from hpcrl.paths import RunPaths
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.state import load_trainer_state, save_trainer_state

    env = par.init_distributed(torch.device("cpu"))
    a, b = SPLIT[env.world_size][env.rank]
    paths = RunPaths(Path(out))
    if par.is_rank0():
        paths.make_dirs()
    par.barrier()

    def finish(model, name: str) -> None:
        full = par.full_state_dict(model)
        if par.is_rank0():
            save_file({k: v.contiguous() for k, v in full.items()}, str(Path(out) / f"{name}.safetensors"))

    model, opt, sched = _build(model_dir, kind, impl, ep)
    if kind == "muon" and env.world_size > 1:  # the matrices really are row shards here
        assert all(hasattr(p, "device_mesh") for g in opt.param_groups for p in g["params"])
    for step in range(1, STEPS):
        _train_step(model, opt, sched, step, a, b)
    save_trainer_state(paths, STEPS - 1, env.rank, env.world_size, model, opt, sched, {"step": STEPS - 1})
    par.barrier()
    _train_step(model, opt, sched, STEPS, a, b)
    finish(model, "uninterrupted")

    model, opt, sched = _build(model_dir, kind, impl, ep)
    load_trainer_state(paths, STEPS - 1, env.rank, env.world_size, model, opt, sched)
    _train_step(model, opt, sched, STEPS, a, b)
    finish(model, "resumed")
    par.barrier()
    par.destroy_distributed()


def _uneven_worker() -> None:
    import copy

    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import hpcrl.trainer.muon
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.muon import Muon

    hpcrl.trainer.muon._zeropower_via_newtonschulz = _ns_fp64
    par.init_distributed(torch.device("cpu"))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))

    def train(net: nn.Module, rows: slice) -> None:
        opt = Muon([{"params": list(net.parameters()), "algorithm": "muon"}], lr=0.1, mu=0.9)
        for _ in range(2):
            net(x[rows]).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 3, bias=False))
    sharded = fully_shard(copy.deepcopy(whole))
    sharded.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (their rows of x)
    sharded.set_force_sum_reduction_for_comms(True)
    rank = par.get_rank()
    assert [p.to_local().shape[0] for p in sharded.parameters()] == ([4, 2] if rank == 0 else [3, 1])
    train(sharded, slice(2 * rank, 2 * rank + 2))
    train(whole, slice(0, 4))
    diffs = [
        float((a.full_tensor() - b).abs().max()) for a, b in zip(sharded.parameters(), whole.parameters())
    ]
    print("max diff:", *diffs, flush=True)
    par.destroy_distributed()


if __name__ == "__main__" and sys.argv[1] == "uneven":
    _uneven_worker()
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)
elif __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)
