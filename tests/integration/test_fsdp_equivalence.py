"""A 2-rank FSDP2 run (gloo, CPU) equals a 1-rank run on the same data.

Both runs train the tiny model for 2 optimizer steps on the same 6 packed samples with the default
RL loss. The 2-rank run splits the samples unevenly (4 | 2), so rank 1 has fewer micro-batches and
must run a dummy one to keep FSDP's collectives in step. Because every rank divides its loss by
the GLOBAL loss-token count and FSDP sums (not averages) gradients, the two runs compute the same
loss, the same gradient and so the same parameters, up to float reordering: we require atol 1e-5
(fp32) on losses, metrics, grad norms and every parameter, and compare the HF exports too.

The workers are this file run as a script with torchrun-style environment variables, so they go
through the same ``init_distributed`` / ``apply_fsdp`` code as a real trainer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import Ranks, wait_ranks

LENS = [9, 5, 12, 3, 7, 8]
RANK_SAMPLES = {
    1: [(0, 6)],
    2: [(0, 4), (4, 6)],
    4: [(0, 2), (2, 3), (3, 5), (5, 6)],
}  # [start, end) sample range per rank
MICRO_BATCH_TOKENS = 16  # rank 0 of 2: [9+5], [12+3]; rank 1: [7+8]; 1 rank: three micro-batches
STEPS = 2
ATOL = 1e-5


def _launch(world: int, model_dir: Path, out: Path, impl: str = "hf", ep: int = 1) -> Ranks:
    logs = [out.parent / f"{out.name}.rank{rank}.log" for rank in range(world)]
    return Ranks(__file__, [str(model_dir), str(out), impl, str(ep)], logs, name=f"{out.name} ")


def test_two_rank_fsdp_equals_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    _check_equivalence(tiny_model_dir, tmp_path, "hf", 1)
    # tied: the head needs the embedding's weight, so it is gathered with the root (the head's group)
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2[0]["embedding_at_head"] == "Parameter"


def test_custom_impl_two_rank_fsdp_equals_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same with hpcrl's own Qwen3 (impl = custom) on the tiny dense model."""
    _check_equivalence(tiny_model_dir, tmp_path, "custom", 1)


def test_untied_two_rank_fsdp_equals_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An untied LM head (Qwen3-8B and larger): the input embedding is its own FSDP group, resharded
    after its own forward (in the root group it was gathered through the whole forward and the whole
    backward, the LM head's included), and the run still equals one rank."""
    untied = _untie(tiny_model_dir, tmp_path / "untied")
    _check_equivalence(untied, tmp_path, "hf", 1)
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2[0]["embedding_at_head"] == "DTensor"  # resharded while the layers and the head run


def _untie(model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` with its own LM head weight (the embedding plus noise)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(out / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    w["lm_head.weight"] = emb + 0.02 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(3))
    save_file(w, str(out / "model.safetensors"))
    return out


def test_expert_parallel_two_ranks_equals_one_rank(tmp_path: Path) -> None:
    """Qwen3-MoE, impl custom: ep = 2 over 2 gloo ranks (experts split 4 | 4, tokens dispatched with
    all_to_all_single, attention/router FSDP-sharded) equals ep = 1 on one rank: losses, metrics, grad
    norms and every parameter after 2 AdamW steps within atol 1e-5 (fp32)."""
    from hpcrl.models.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    _check_equivalence(moe, tmp_path, "custom", 2)


def test_expert_parallel_with_dense_layers_equals_one_rank(tmp_path: Path) -> None:
    """A Qwen-MoE whose layers are not all MoE (decoder_sparse_step = 2: layers 0, 2, ... dense MLPs,
    1, 3, ... MoE): ep = 2 on 2 ranks splits only the MoE layers' experts, the dense MLPs stay
    FSDP's, and the run equals one rank."""
    from hpcrl.models.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    sparse = _with_dense_layers(moe, tmp_path / "sparse")
    _check_equivalence(sparse, tmp_path, "custom", 2)


def _with_dense_layers(model_dir: Path, out: Path) -> Path:
    """``model_dir`` rebuilt (random weights, same seed) with every second layer a dense MLP."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(model_dir, out)
    cfg = AutoConfig.from_pretrained(str(out))
    cfg.decoder_sparse_step, cfg.intermediate_size = 2, 48
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert sum(1 for n, _ in model.named_modules() if n.endswith("mlp.gate")) == cfg.num_hidden_layers // 2
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(str(out))
    return out


@pytest.mark.slow
def test_expert_parallel_with_replicas_equals_one_rank(tmp_path: Path) -> None:
    """4 ranks, ep = 2: two ep groups (dp_ep = 2); each ep position's experts are FSDP-sharded over
    its 2 ranks (gathered around their forward and backward, gradients reduce-scattered, summed over
    the groups) and the result equals one rank."""
    from hpcrl.models.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    _check_equivalence(moe, tmp_path, "custom", 2, world=4)


def _check_equivalence(model_dir: Path, tmp_path: Path, impl: str, ep: int, world: int = 2) -> None:
    from safetensors.torch import load_file
    from torch.testing import assert_close

    tiny_model_dir = model_dir
    one, two = tmp_path / "one", tmp_path / "two"
    # one bound for all 1 + world ranks: a rank that fails stops the others at once (they would wait
    # for it in a collective), ranks still running at 300 s dump their stacks into the failure
    wait_ranks(
        _launch(1, tiny_model_dir, one, impl), _launch(world, tiny_model_dir, two, impl, ep), timeout=300
    )

    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert len(m1) == len(m2) == STEPS
    for a, b in zip(m1, m2, strict=True):
        assert a["micro_batches"] == 3 and b["micro_batches"] == (2 if world == 2 else 1)  # max over ranks
        for key in ("loss", "entropy", "mismatch_kl", "ratio_mean", "masked_advantage_positive",
                    "masked_advantage_negative", "loss_tokens", "grad_norm"):  # fmt: skip
            assert abs(a[key] - b[key]) <= ATOL, (key, a[key], b[key])
    # the data really exercises the trust-region masks (both signs) and produces a gradient
    assert m1[0]["masked_advantage_positive"] > 0 and m1[0]["masked_advantage_negative"] > 0
    assert m1[0]["grad_norm"] > 0

    p1, p2 = load_file(str(one / "params.safetensors")), load_file(str(two / "params.safetensors"))
    assert p1.keys() == p2.keys()
    init = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = 0
    for k in p1:
        assert_close(p2[k], p1[k], atol=ATOL, rtol=0, msg=k)
        moved += int(k in init and not init[k].equal(p1[k]))
    assert moved > 0  # the optimizer actually changed the weights
    e1, e2 = (
        load_file(str(one / "export" / "model.safetensors")),
        load_file(str(two / "export" / "model.safetensors")),
    )
    assert e1.keys() == e2.keys() == init.keys()
    for k in e1:
        assert_close(e2[k], e1[k], atol=ATOL, rtol=0, msg=k)


# ---------------------------------------------------------------------------------- worker process


def _worker(model_dir: str, out: str, impl: str, ep: int) -> None:
    import torch

    from hpcrl.models import parallelize as mp
    from hpcrl.models.spec import load_model
    from hpcrl.trainer import optim
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.loss import LossParams, add_stats, compute_loss, stack_stats, summarize, unstack_stats
    from hpcrl.trainer.model import export_hf
    from hpcrl.trainer.packing import PackedBatch, dummy_micro_batch, forward_packed, micro_batches

    env = par.init_distributed(torch.device("cpu"))
    model = load_model(model_dir, "float32", "cpu", impl=impl)

    # The same full batch in every process: inference logprobs = the initial policy's plus noise,
    # so ratios start near 1 and some tokens fall outside the trust region.
    g = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    t = sum(LENS)
    seq_lens = torch.tensor(LENS)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    loss_mask = torch.rand(t, generator=g) < 0.8
    loss_mask[starts] = False
    batch = PackedBatch(
        input_ids=torch.randint(3, vocab, (t,), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in LENS]),
        seq_lens=seq_lens,
        loss_mask=loss_mask,
        advantages=torch.randn(t, generator=g),
        inference_logprobs=torch.zeros(t),
        temperatures=torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.9]),
    )
    with torch.no_grad():
        batch.inference_logprobs = forward_packed(model, batch).logprobs + 0.3 * torch.randn(t, generator=g)
    batch.validate()

    from hpcrl.models.qwen3.parallelize import apply_ep

    experts = apply_ep(model, ep, torch.device("cpu")) if ep > 1 else set()
    model = mp.apply_fsdp(model, ignored_params=experts or None)
    if ep > 1:  # every rank stores E / world experts: FSDP-sharded within an ep position when dp_ep > 1
        moe = model.moe_layers()[0]
        assert moe.experts.gate_proj.to_local().shape[0] == moe.num_experts // env.world_size
    opt = optim.build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.01)
    sched = optim.build_scheduler(opt, "cosine", warmup_steps=1, total_steps=4)
    params = LossParams(kl_coef=0.01, kl_target="inference")

    a, b = RANK_SAMPLES[env.world_size][env.rank]
    local = batch.slice_samples(a, b)
    mbs = micro_batches(local, MICRO_BATCH_TOKENS)
    # Every rank needs the global loss-token count and the same number of forward/backward passes.
    global_tokens = float(par.all_reduce_sum(local.loss_mask.sum()))
    n_mb = int(par.all_reduce(len(mbs), "max"))

    history = []
    # what the input embedding's weight is while the LM head runs: gathered (a plain Parameter) or
    # resharded (a DTensor)
    at_head: list[str] = []
    model.get_output_embeddings().register_forward_pre_hook(
        lambda *_: at_head.append(type(model.get_input_embeddings().weight).__name__)
    )
    for _ in range(STEPS):
        stats = None
        for i in range(n_mb):
            mb = mbs[i] if i < len(mbs) else dummy_micro_batch()
            fwd = forward_packed(model, mb)
            res = compute_loss(
                params,
                trainer_logprobs=fwd.logprobs,
                inference_logprobs=mb.inference_logprobs,
                advantages=mb.advantages,
                loss_mask=mb.loss_mask,
                num_loss_tokens=global_tokens,
                entropy=fwd.entropy,
                seq_lens=mb.seq_lens,
            )
            res.loss.backward()
            stats = add_stats(stats, res.stats)
        metrics = summarize(unstack_stats(par.all_reduce_sum(stack_stats(stats))))
        metrics["grad_norm"] = optim.clip_grad_norm(model.parameters(), 1.0)
        metrics["micro_batches"] = n_mb
        metrics["embedding_at_head"] = at_head[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history.append(metrics)

    tied = mp.untied_input_embeddings(model) is None
    full = par.full_state_dict(model)
    export_hf(model, None, Path(out) / "export", write=par.is_rank0())
    if par.is_rank0():
        from safetensors.torch import save_file

        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight" or not tied},
            str(Path(out) / "params.safetensors"),
        )
        (Path(out) / "metrics.json").write_text(json.dumps(history, indent=1))
    par.barrier()
    par.destroy_distributed()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)  # as the trainer does: no gloo teardown abort after the work is done
