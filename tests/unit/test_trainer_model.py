"""Packed forward, model loading/export/LoRA, optimizer and schedule, distributed env parsing.

Models here are built inline from a small Qwen3Config (no tokenizer training) to keep the unit
suite fast; the tiny-model kit is exercised by the FSDP integration test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hpcrl.models.load import LoraParams
from hpcrl.models.spec import load_model
from hpcrl.trainer import optim as O
from hpcrl.trainer.model import (
    export_hf,
    hf_named_tensors,
    merged_state_dict,
    save_adapter,
)
from hpcrl.trainer.packing import (
    PackedBatch,
    block_causal_mask,
    dummy_micro_batch,
    forward_packed,
    micro_batches,
    next_token_logprobs,
    split_micro_batches,
)
from hpcrl.trainer.parallel import dist_env, first_host

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("qwen3_mini")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def make_batch(lens: list[int], seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    seq_lens = torch.tensor(lens)
    mask = torch.ones(t, dtype=torch.bool)
    mask[torch.cumsum(seq_lens, 0) - seq_lens] = False  # first token of each sample: no prefix
    return PackedBatch(
        input_ids=torch.randint(0, VOCAB, (t,), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=seq_lens,
        loss_mask=mask,
        advantages=torch.randn(t, generator=g),
        inference_logprobs=-torch.rand(t, generator=g),
        temperatures=torch.tensor([1.0, 0.7, 1.3, 1.0][: len(lens)]),
    )


# ---------------------------------------------------------------------------------------- packing


def test_split_micro_batches_whole_samples_in_order():
    # budget 7: [3+4] = 7 | 2 (2+10 > 7) | 10 alone (over budget) | 1
    assert split_micro_batches([3, 4, 2, 10, 1], 7) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert split_micro_batches([], 7) == []
    with pytest.raises(ValueError):
        split_micro_batches([1], 0)
    mbs = micro_batches(make_batch([3, 4, 2]), 7)
    assert [mb.seq_lens.tolist() for mb in mbs] == [[3, 4], [2]]
    assert sum(mb.num_tokens for mb in mbs) == 9  # no padding anywhere


def test_block_mask():
    lens = torch.tensor([3, 2])
    m = block_causal_mask(lens)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    f = block_causal_mask(lens, torch.float32)[0, 0]
    assert f[0, 0] == 0 and f[3, 2] == torch.finfo(torch.float32).min


def test_token_logprobs_and_entropy_by_hand():
    # logits [0, ln 3] -> p = [1/4, 3/4]; at temperature 2: [0, ln 3 / 2] -> p = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    logits = torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)], [0.0, 0.0]])
    lp, ent = next_token_logprobs(
        logits, torch.tensor([1, 0, 1]), torch.tensor([1.0, 2.0, 1.0]), entropy=True
    )
    s3 = math.sqrt(3)
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(1 / (1 + s3)), math.log(0.5)], abs=1e-6)
    # entropy of [1/4, 3/4] = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335; of [1/2, 1/2] = ln 2
    assert ent is not None and not ent.requires_grad
    assert ent[[0, 2]].tolist() == pytest.approx([0.562335, math.log(2)], abs=1e-6)
    assert next_token_logprobs(logits, torch.tensor([1, 0, 1]))[1] is None


def test_validate_rejects_malformed_batches():
    b = make_batch([3, 2])
    b.validate()
    bad = make_batch([3, 2])
    bad.loss_mask[0] = True
    with pytest.raises(ValueError, match="first token"):
        bad.validate()
    with pytest.raises(ValueError, match="sum"):
        PackedBatch(b.input_ids, b.position_ids, torch.tensor([3, 3]), b.loss_mask).validate()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_samples_run_alone(model_dir: Path, attn: str):
    model = load_model(model_dir, "float32", "cpu", attn_impl=attn).eval()
    b = make_batch([5, 1, 7, 3])
    out = forward_packed(model, b)
    assert out.logprobs.shape == (16,) and out.entropy is not None
    starts = 0
    with torch.no_grad():
        for i, n in enumerate(b.seq_lens.tolist()):
            ids = b.input_ids[starts : starts + n]
            logits = model(input_ids=ids[None]).logits[0].float() / b.temperatures[i]
            ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
            got = out.logprobs[starts : starts + n]
            assert got[0] == 0.0
            torch.testing.assert_close(got[1:], ref, atol=1e-5, rtol=0)
            starts += n
    # position-id packing (what varlen kernels rely on) agrees with the explicit mask
    with torch.no_grad():
        a = model(input_ids=b.input_ids[None], position_ids=b.position_ids[None]).logits
        m = model(
            input_ids=b.input_ids[None],
            position_ids=b.position_ids[None],
            attention_mask=block_causal_mask(b.seq_lens, torch.bool if attn == "sdpa" else torch.float32),
        ).logits
    torch.testing.assert_close(a, m, atol=1e-5, rtol=0)


def test_wanted_tokens_only_same_values_and_gradients(model_dir: Path):
    """Logits only where a wanted token is predicted: identical logprobs there, exact zeros elsewhere,
    identical gradients of a loss over the wanted tokens; a model without ``logits_to_keep`` too."""
    b = make_batch([5, 1, 7, 3])
    wanted = torch.zeros(16, dtype=torch.bool)
    wanted[[2, 3, 4, 9, 10, 15]] = True
    grads, outs = [], []
    for w in (None, wanted):
        model = load_model(model_dir)
        out = forward_packed(model, b, wanted=w)
        torch.where(wanted, out.logprobs * b.advantages, 0.0).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        outs.append(out)
    full, part = outs
    torch.testing.assert_close(part.logprobs[wanted], full.logprobs[wanted], atol=1e-6, rtol=0)
    assert not part.logprobs[~wanted].any() and part.entropy is not None and not part.entropy[~wanted].any()
    torch.testing.assert_close(part.entropy[wanted], full.entropy[wanted], atol=1e-6, rtol=0)
    for g_full, g_part in zip(*grads):
        torch.testing.assert_close(g_part, g_full, atol=1e-6, rtol=0)
    # [5, 1, 7, 3] at width 7 (the longest) would be [5, 1, pad] | [7] | [3, pad x 4] = 21 slots for 16
    # tokens (31 % padding); layout.choose_width takes the cheapest width that pads <= 5 %: all 16
    # tokens in one row of 16 (4 x 7 = 28 capped at the total), no padding.
    assert (full.slots, full.padding) == (16, 0)

    class NoLogitsToKeep(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids, attention_mask, use_cache):
            return self.inner(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=use_cache,
            )

    plain = forward_packed(NoLogitsToKeep(load_model(model_dir)), b, wanted=wanted)
    torch.testing.assert_close(plain.logprobs, part.logprobs, atol=1e-6, rtol=0)


def test_dummy_micro_batch_runs_and_trains_nothing(model_dir: Path):
    from hpcrl.trainer.loss import LossParams, compute_loss

    model = load_model(model_dir)
    mb = dummy_micro_batch()
    out = forward_packed(model, mb)
    loss = compute_loss(
        LossParams(),
        trainer_logprobs=out.logprobs,
        inference_logprobs=mb.inference_logprobs,
        advantages=mb.advantages,
        loss_mask=mb.loss_mask,
        num_loss_tokens=10,
    ).loss
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


# ------------------------------------------------------------------------------------------ model


def test_export_roundtrip_and_activation_checkpointing(model_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = load_model(model_dir, "float32", "cpu", activation_checkpointing=True)
    names = dict(hf_named_tensors(model))
    assert "lm_head.weight" not in names  # tied to embed_tokens: exported once, like save_pretrained
    out = export_hf(model, None, tmp_path / "weights" / "step_1")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not list((tmp_path / "weights").glob(".*"))  # no temp dirs left behind
    again = AutoModelForCausalLM.from_pretrained(out)
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, model.state_dict()[k], atol=0, rtol=0)
    # checkpointed and plain forward/backward give the same gradients
    b = make_batch([4, 5])
    plain = load_model(model_dir)
    grads = []
    for m in (model, plain):
        forward_packed(m, b).logprobs.sum().backward()
        grads.append(m.model.layers[0].mlp.up_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)
    export_hf(plain, None, out)  # replacing an existing export also works
    assert (out / "model.safetensors").is_file()


def test_export_in_the_compute_dtype(model_dir: Path, tmp_path: Path):
    """fp32 master weights exported/published as bf16: every floating tensor cast once, config.json
    says bfloat16, transformers loads it in bf16 with exactly those values."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = load_model(model_dir, "float32", "cpu")
    named = dict(hf_named_tensors(model, dtype="bfloat16"))
    assert {t.dtype for t in named.values()} == {torch.bfloat16}
    for k, t in named.items():
        assert torch.equal(t, model.state_dict()[k].to(torch.bfloat16))
    out = export_hf(model, None, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(torch.equal(v, named[k]) for k, v in load_file(str(out / "model.safetensors")).items())
    assert model.config.dtype == torch.float32  # the live model's config is untouched
    again = AutoModelForCausalLM.from_pretrained(out)
    assert again.dtype == torch.bfloat16


def test_lora_merge_and_adapter(model_dir: Path, tmp_path: Path):
    model = load_model(model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj", "up_proj")))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at 0; make the adapter matter
    merged = merged_state_dict(model)
    reference = model.merge_and_unload().state_dict()
    assert set(merged) == set(reference) - {"lm_head.weight"}
    for k, v in merged.items():
        torch.testing.assert_close(v, reference[k], atol=1e-6, rtol=0)
    # the saved adapter loads back with peft and reproduces the same merged weights
    from peft import PeftModel

    lora = load_model(model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj",)))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_()
    save_adapter(lora, tmp_path / "adapter")
    back = PeftModel.from_pretrained(load_model(model_dir), tmp_path / "adapter")
    for (k, v), (k2, v2) in zip(hf_named_tensors(lora), hf_named_tensors(back), strict=True):
        assert k == k2
        torch.testing.assert_close(v, v2, atol=0, rtol=0)
    # the adapter init is seeded: every FSDP rank (and a rerun) starts from the same adapter
    torch.manual_seed(123)
    again = load_model(model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj",)))
    a_init = {n: p for n, p in again.named_parameters() if "lora_A" in n}
    fresh = load_model(model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj",)))
    assert all(p.equal(a_init[n]) for n, p in fresh.named_parameters() if "lora_A" in n)
    with pytest.raises(ValueError, match="no LoRA"):
        save_adapter(load_model(model_dir), tmp_path / "x")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------------------ optim


def test_schedules_by_hand():
    # warmup 2: steps 0, 1 -> 1/2, 2/2.  cosine over steps 2..6 to min 0.1:
    # step 4 is half way: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55; step 6 and beyond: 0.1
    f = [
        O.lr_lambda(s, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
        for s in (0, 1, 2, 4, 6, 9)
    ]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    # linear, no warmup, total 4, min 0: 1, 0.75, 0.5, 0.25, 0
    f = [O.lr_lambda(s, schedule="linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.0) for s in range(5)]
    assert f == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="total_steps"):
        O.build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), "cosine")


def test_optimizer_groups_scheduler_resume_and_clipping():
    lin = torch.nn.Linear(2, 1)
    opt = O.build_optimizer(lin, "adamw", lr=0.1, weight_decay=0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]  # matrix decays, bias does not
    sched = O.build_scheduler(opt, "linear", warmup_steps=1, total_steps=5)
    for _ in range(3):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = O.build_optimizer(lin, "sgd", lr=0.1)
    sched2 = O.build_scheduler(opt2, "linear", warmup_steps=1, total_steps=5)
    O.load_scheduler_state(sched2, state)
    # after 3 steps: warmup over, progress (3 - 1) / 4 = 0.5 -> lr 0.1 * 0.5
    assert O.current_lr(opt2) == pytest.approx(O.current_lr(opt)) == pytest.approx(0.05)
    # grads (3, 4) and bias 0: norm 5, clipped to 1 -> (0.6, 0.8)
    lin.weight.grad = torch.tensor([[3.0, 4.0]])
    lin.bias.grad = torch.zeros(1)
    assert O.clip_grad_norm(lin.parameters(), 1.0) == pytest.approx(5.0)
    assert lin.weight.grad[0].tolist() == pytest.approx([0.6, 0.8])
    lin.weight.grad[0, 0] = float("nan")
    assert math.isnan(O.clip_grad_norm(lin.parameters(), None))
    with pytest.raises(ValueError, match="optim.name"):
        O.build_optimizer(lin, "lion")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- parallel


def test_dist_env_torchrun_then_slurm():
    e = dist_env(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"}
    )
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (1, 2, 1, "h", 123)
    e = dist_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[03-05,7],cpu1",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (3, 4, 1, "gpu03", 24242)
    assert dist_env({}).world_size == 1
    assert first_host("n1") == "n1"
    with pytest.raises(ValueError, match="outside"):
        dist_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_transformers_without_2d_logits_to_keep_masks(model_dir: Path, monkeypatch):
    """transformers releases before ~5.2x index hidden states with a 2-D ``logits_to_keep`` as
    positions and fail on hpcrl's bool mask: the trainer never passes one (the LM head is given the
    kept rows inside the forward), so chunked and unchunked logprobs work with any release."""
    b = make_batch([5, 1, 7, 3])
    ref = forward_packed(load_model(model_dir), b)
    model = load_model(model_dir)
    forward = model.forward

    def old_forward(*args, logits_to_keep=0, **kwargs):
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 2:
            raise IndexError("too many indices for tensor of dimension 3")  # transformers 5.17 / 5.20
        return forward(*args, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(model, "forward", old_forward)
    for chunk in (0, 4):
        out = forward_packed(model, b, chunk_tokens=chunk)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-6, rtol=0)
