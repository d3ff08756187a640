"""hpcrl's own Qwen3 / Qwen3-MoE (impl = custom) against transformers on the same weights, fp32.

Tolerance: fp32 logits agree to 1e-4 absolute (observed ~1e-6: only the summation order of the experts'
outputs and of RMSNorm differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), preset="tiny-moe", seed=3)


def _pair(path: Path):
    from transformers import AutoModelForCausalLM

    from hpcrl.models.spec import load_model

    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    custom = load_model(path, impl="custom").eval()
    return hf, custom


def _ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (2, 24), generator=g)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_logits_match_transformers(which: str, tiny_model_dir: Path, moe_dir: Path) -> None:
    path = tiny_model_dir if which == "dense" else moe_dir
    hf, custom = _pair(path)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = custom(input_ids=ids).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < ATOL


def test_export_round_trips_hf_names(moe_dir: Path) -> None:
    from safetensors import safe_open

    from hpcrl.trainer.model import hf_named_tensors

    _, custom = _pair(moe_dir)
    named = dict(hf_named_tensors(custom))
    with safe_open(str(moe_dir / "model.safetensors"), framework="pt") as f:
        assert set(named) == set(f.keys())  # noqa: SIM118
        for k in f.keys():  # noqa: SIM118
            assert torch.equal(named[k], f.get_tensor(k)), k


def test_router_replay_forces_experts_and_keeps_router_grad(moe_dir: Path) -> None:
    _, custom = _pair(moe_dir)
    ids = _ids(custom.config.vocab_size)
    moes = custom.moe_layers()
    k = moes[0].top_k
    forced = torch.zeros(2, 24, len(moes), k, dtype=torch.long)
    forced[..., 1] = 5  # every token to experts 0 and 5
    forced[0, :4] = -1  # first tokens route freely
    out = custom(input_ids=ids, routed_experts=forced).logits
    load = moes[0].stats.load
    assert int(load[0]) >= 44 and int(load[5]) >= 44  # 2*24-4 replayed tokens hit both
    out.sum().backward()
    assert moes[0].gate.weight.grad is not None and moes[0].gate.weight.grad.abs().sum() > 0


def test_hf_views_write_fused_experts_in_place(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hpcrl.models.qwen3.state_dict_adapter import hf_views

    hf = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    views = hf_views(dict(hf.state_dict()))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    views[name].copy_(torch.ones_like(views[name]))
    fused = hf.model.layers[0].mlp.experts.gate_up_proj
    inter = fused.shape[1] // 2
    assert bool((fused[3, inter:] == 1).all()) and not bool((fused[3, :inter] == 1).all())


def test_pick_impl() -> None:
    from hpcrl.errors import ConfigError
    from hpcrl.models.registry import pick_impl

    assert pick_impl("auto", "qwen3_moe") == "custom"
    assert pick_impl("auto", "qwen3", lora=True) == "hf"
    assert pick_impl("auto", "qwen3", attn="flash_attention_2") == "hf"
    assert pick_impl("auto", "llama") == "hf"
    assert pick_impl("hf", "qwen3") == "hf"
    with pytest.raises(ConfigError, match="trainer.model.impl"):
        pick_impl("custom", "llama")
    with pytest.raises(ConfigError, match="LoRA"):
        pick_impl("custom", "qwen3", lora=True)


@pytest.mark.parametrize("replay, aux", [(True, 0.0), (False, 0.01)])
def test_moe_activation_checkpointing_matches_plain(moe_dir: Path, replay: bool, aux: float) -> None:
    """The backward's recompute of a checkpointed layer must route the replayed tokens as the forward
    did (replay routes every token to experts the trainer's router would not all pick, so a recompute
    that routed freely would differ) and save the same tensors (routing statistics, aux loss):
    gradients with checkpointing equal those without."""
    from hpcrl.models.spec import load_model

    ids = _ids(256)
    grads = []
    for ckpt in (False, True):
        model = load_model(moe_dir, impl="custom")
        model.activation_checkpointing = ckpt
        moes = model.moe_layers()
        forced = torch.zeros(2, 24, len(moes), moes[0].top_k, dtype=torch.long)
        forced[..., 1] = 5
        forced[1, :3] = -1
        for m in moes:
            m.aux_coef = aux
        loss = model(input_ids=ids, routed_experts=forced if replay else None).logits.pow(2).mean()
        (loss + sum(a for m in moes for a in m.stats.aux)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, ckpt = grads
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-6, rtol=1e-5), n


def test_shared_prefix_stops_where_replayed_routes_differ(moe_dir: Path) -> None:
    """Two samples with the same first 6 tokens, replayed with the same routes except at position 3:
    they share 3 tokens, not 6, and every logprob equals the unshared forward's."""
    from hpcrl.models.spec import load_model
    from hpcrl.trainer.layout import common_prefix
    from hpcrl.trainer.packing import PackedBatch, forward_packed, with_shared_prefixes

    ids = torch.tensor([7, 8, 9, 10, 11, 12, 20, 21, 7, 8, 9, 10, 11, 12, 30, 31, 32])
    lens = [8, 9]
    routes = torch.zeros(17, 4, dtype=torch.long)  # 2 layers x top-2
    routes[:, 1::2] = 5
    routes[8 + 3] = torch.tensor([1, 2, 3, 4])  # the second sample's 4th token went elsewhere
    mb = PackedBatch(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.cat([torch.arange(n) >= 6 for n in lens]),
        routed_experts=routes,
    )
    np_ids, np_pos = mb.input_ids.numpy(), mb.position_ids.numpy()
    assert common_prefix(np_ids, np_pos, (0, 8), (8, 9)) == 6
    assert common_prefix(np_ids, np_pos, (0, 8), (8, 9), routes.numpy()) == 3
    shared = with_shared_prefixes(mb, 64)
    assert shared.prefix_lens.tolist() == [0, 3]
    model = load_model(moe_dir, impl="custom").eval()
    with torch.no_grad():
        alone = forward_packed(model, mb).logprobs
        together = forward_packed(model, shared).logprobs
    assert torch.allclose(alone, together, atol=1e-6)


def _top8_dir(tmp_path: Path, moe_dir: Path) -> Path:
    """tiny-moe's shape with 16 experts, top-8 (the seeds' k): the combine order matters from k = 3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(moe_dir))
    cfg.num_experts, cfg.num_experts_per_tok = 16, 8
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "top8")
    return tmp_path / "top8"


@pytest.mark.parametrize("top_k", [0, 2, 8])
def test_bf16_logits_are_bitwise_transformers(
    top_k: int, tiny_model_dir: Path, moe_dir: Path, tmp_path: Path
) -> None:
    """In bf16 (the dtype inference samples in), with transformers' routes replayed, the custom model's
    logits are bit-identical to transformers' (the embedded engine's model), at positions far past
    the prompt's too: the trainer then scores exactly what the engine sampled from. It failed on the
    rotary frequencies rounded to bf16 with the model (every position). (On CUDA top-8 also needed the
    experts' outputs summed as transformers sums them, not by atomics into a bf16 buffer: measured on
    an H200 with ``python scripts/bench/moe.py --part bitwise``; this CPU test cannot see that one.)"""
    from transformers import AutoModelForCausalLM

    from hpcrl.models.spec import load_model

    path = {0: tiny_model_dir, 2: moe_dir}.get(top_k) or _top8_dir(tmp_path, moe_dir)  # 0: dense
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa")
    custom = load_model(path, "bfloat16", "cpu", attn_impl="sdpa", impl="custom").eval()
    routes: list[torch.Tensor] = []
    for name, mod in hf.named_modules():
        if name.endswith(".mlp.gate"):
            mod.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))
    ids = _ids(hf.config.vocab_size)[:1]
    pos = torch.arange(ids.shape[1])[None] + 30_000
    with torch.no_grad():
        want = hf.eval()(input_ids=ids, position_ids=pos).logits
        replay = torch.stack(routes, 1)[None] if routes else None  # [1, T, layers, k]
        got = custom(input_ids=ids, position_ids=pos, routed_experts=replay).logits
    assert (replay.shape[-1] if replay is not None else 0) == top_k
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_rotary_frequencies_stay_fp32_through_casts() -> None:
    """A dtype cast, to_empty and meta init leave inv_freq fp32 and equal to the fresh values."""
    from hpcrl.models.qwen3.model import Rotary

    fresh = Rotary(32, 1e6).inv_freq.clone()
    r = Rotary(32, 1e6).to(torch.bfloat16)
    assert r.inv_freq.dtype == torch.float32 and torch.equal(r.inv_freq, fresh)
    with torch.device("meta"):
        m = Rotary(32, 1e6)
    m.to(dtype=torch.bfloat16).to_empty(device="cpu")
    assert torch.equal(m.inv_freq, fresh)
