"""Meta-device initialisation over 2 gloo ranks equals every rank loading the whole model.

Each rank builds the trainer's model twice with ``setup.build_model``: with meta init (rank 0 reads
the weights, rank 1 builds on the meta device, shards are filled from rank 0) and the old way (every
rank reads everything). The gathered state dicts and every rank's buffers (rotary ``inv_freq`` is a
non-persistent buffer a meta rank would otherwise leave uninitialised) must be bitwise equal, tied
embeddings must stay one tensor, and two RL train steps must give the same losses. Rank 0 must not
keep its whole copy. Variants: plain, LoRA (peft; the adapter's init comes from rank 0), and a warm
start from other weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("warm"), seed=7)


@pytest.mark.parametrize("variant", ["plain", "lora", "warm"])
def test_meta_init_equals_full_load(
    variant: str, tiny_model_dir: Path, warm_dir: Path, tmp_path: Path
) -> None:
    run_ranks(__file__, 2, variant, str(tiny_model_dir), str(warm_dir), str(tmp_path))
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for res in r:
        assert res["state_equal"], res["state_diff"]
        assert res["buffers_equal"] and res["buffer_names"], res
        assert res["tied"]
        assert res["losses_meta"] == res["losses_full"], res  # bitwise: same weights, same computation
        assert all(x == x for x in res["losses_meta"])  # finite, not NaN from uninitialised memory
    assert "model.rotary_emb.inv_freq" in "".join(r[1]["buffer_names"])
    assert r[0]["whole_copies_alive"] == [], r[0]["whole_copies_alive"]
    assert len(r[0]["control"]) == 1
    if variant == "warm":
        assert r[0]["warm_applied"]


# ---------------------------------------------------------------------------------- worker process


def _batch(rank: int, vocab: int):
    """Rank ``rank``'s batch; the loss is normalised by both ranks' loss tokens."""
    from tests.integration.ranks import two_rank_batch

    return two_rank_batch(rank, vocab, seed=100, lens=(8, 20), logprob=-4.0)


def _whole_copies(shape: tuple[int, ...], nbytes: int) -> list[str]:
    """Live CPU tensors (not DTensors) whose memory could hold a whole tensor of ``shape``."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    out = []
    for obj in gc.get_objects():
        plain = isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu"
        if plain and tuple(obj.shape) == shape and obj.untyped_storage().nbytes() >= nbytes:
            out.append(f"{tuple(obj.shape)} {obj.dtype}")
    return out


def _worker(variant: str, model_dir: str, warm_dir: str, out: str) -> None:
    import torch

    from hpcrl.config.schema import LoraConfig, TrainerModelConfig
    from hpcrl.models.load import is_peft_model
    from hpcrl.trainer import optim, parallel, precision
    from hpcrl.trainer.loss import LossParams
    from hpcrl.trainer.rl import train_step
    from hpcrl.trainer.setup import Training, build_model

    device = torch.device("cpu")
    env = parallel.init_distributed(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    mc = TrainerModelConfig(name=model_dir, lora=LoraConfig(rank=4, alpha=8.0) if variant == "lora" else None)
    prec = precision.of_model(mc, on_gpu=False)
    warm = warm_dir if variant == "warm" else None

    meta = build_model(model_dir, mc, prec, device, warm, meta_init=True)
    vocab, hidden = meta.config.vocab_size, meta.config.hidden_size
    whole = _whole_copies((vocab, hidden), vocab * hidden * 4)  # the embedding, unsharded
    probe = torch.zeros(vocab, hidden)  # the check must see a whole copy when there is one
    control = _whole_copies((vocab, hidden), vocab * hidden * 4)
    del probe
    full = build_model(model_dir, mc, prec, device, warm, meta_init=False)

    sd_meta, sd_full = parallel.full_state_dict(meta), parallel.full_state_dict(full)
    diff = sorted(k for k in sd_full if k not in sd_meta or not torch.equal(sd_meta[k], sd_full[k]))
    bm, bf = dict(meta.named_buffers()), dict(full.named_buffers())
    buffers_equal = bm.keys() == bf.keys() and all(torch.equal(bm[k], bf[k]) for k in bm)
    base = meta.get_base_model() if is_peft_model(meta) else meta
    tied = base.lm_head.weight is base.model.embed_tokens.weight
    warm_applied = False
    if env.rank == 0 and variant == "warm":
        from safetensors.torch import load_file

        w = load_file(str(Path(warm_dir) / "model.safetensors"))
        warm_applied = torch.equal(sd_meta["model.embed_tokens.weight"], w["model.embed_tokens.weight"])

    losses = {}
    for name, model in (("meta", meta), ("full", full)):
        opt = optim.build_optimizer(model, "adamw", lr=1e-2)
        sched = optim.build_scheduler(opt, "constant", warmup_steps=0, total_steps=10)
        tr = Training(model, None, opt, sched, device, model_dir, env, prec)
        losses[name] = [
            train_step(tr, _batch(env.rank, vocab), LossParams(), 64, 1.0).stats["loss"] for _ in range(2)
        ]
    res = {
        "state_equal": not diff and sd_meta.keys() == sd_full.keys(),
        "state_diff": diff[:5],
        "buffers_equal": buffers_equal,
        "buffer_names": sorted(bm),
        "tied": tied,
        "losses_meta": losses["meta"],
        "losses_full": losses["full"],
        "whole_copies_alive": whole,
        "control": control,
        "warm_applied": warm_applied,
    }
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(res))
    parallel.barrier()
    parallel.destroy_distributed()


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)  # as the trainer does: no gloo teardown abort after the work is done
