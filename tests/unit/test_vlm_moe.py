"""hpcrl.models.vlm_moe: transformers' VL MoE blocks swapped for hpcrl's MoE compute the same outputs
and gradients with the same parameter names (Qwen3-VL-MoE; Qwen3.5-MoE with its gated shared
expert), on the meta device too; the dry run's ep check for [model.vlm]."""

from __future__ import annotations

import copy

import pytest
import torch


def _qwen3_vl_moe():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)  # fmt: skip
    return Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
                linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  num_position_embeddings=16)  # fmt: skip
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))


@pytest.mark.parametrize("make", [_qwen3_vl_moe, _qwen3_5_moe])
def test_swapped_blocks_compute_what_transformers_does(make):
    from hpcrl.models.vlm_moe import VLMoE, swap_moe_blocks

    torch.manual_seed(0)
    ref = make().float()
    for name, p in ref.named_parameters():  # transformers leaves the stacked experts / router empty
        if ".mlp." in name:
            torch.nn.init.normal_(p, std=0.1)
    ours = copy.deepcopy(ref)
    assert swap_moe_blocks(ours.model.language_model) == 2
    assert all(isinstance(layer.mlp, VLMoE) for layer in ours.model.language_model.layers)
    assert list(ours.state_dict()) == list(ref.state_dict())  # transformers' names, in its order
    ids = torch.randint(0, 128, (1, 12))
    a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        if p.grad is not None:
            scale = float(p.grad.abs().max())
            assert float((q.grad - p.grad).abs().max()) <= 1e-5 * scale, (name, scale)
    moe = ours.model.language_model.layers[0].mlp
    assert int(moe.stats.load.sum()) == 12 * 2  # hpcrl's routing statistics (MoE metrics) count


def test_swap_on_the_meta_device_keeps_the_parameters():
    from hpcrl.models.vlm_moe import swap_moe_blocks

    with torch.device("meta"):
        model = _qwen3_vl_moe()
    before = {n: p for n, p in model.named_parameters()}
    swap_moe_blocks(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in after)


def test_dry_run_ep_with_vlm_needs_a_vl_moe_type():
    from hpcrl.errors import ConfigError
    from hpcrl.launch.checks import _vl_ep

    class M:
        ep = 2

    _vl_ep(M(), "model", {"model_type": "qwen3_5_moe"})
    _vl_ep(M(), "model", None)  # not local: checked when the trainer swaps the blocks
    with pytest.raises(ConfigError) as e:
        _vl_ep(M(), "model", {"model_type": "qwen3_vl"})
    assert e.value.path == "model.ep" and "qwen3_vl_moe, qwen3_5_moe only" in str(e.value)


def test_expert_lora_starts_at_the_base_model_and_merges_into_it():
    """LoRA on the stacked experts (model.lora's "experts"): B = 0 at start, so the outputs are the
    base model's; with B trained, the forward equals the base model with s B @ A merged into every
    expert (what the export writes, merge_lora), and gradients reach A and B."""
    from hpcrl.models.vlm_moe import add_expert_lora, merge_lora, swap_moe_blocks

    torch.manual_seed(0)
    ref = _qwen3_vl_moe().float()
    for name, p in ref.named_parameters():
        if ".mlp." in name:
            torch.nn.init.normal_(p, std=0.1)
    ours = copy.deepcopy(ref)
    swap_moe_blocks(ours)
    assert add_expert_lora(ours, rank=4, alpha=8, dropout=0.0, seed=0) == 2
    ids = torch.randint(0, 128, (1, 12))
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    experts = ours.model.language_model.layers[0].mlp.experts
    assert experts.lora_A_gate_up.shape == (4, 4, 32) and experts.lora_B_down.shape == (4, 32, 4)
    assert experts.lora_scaling == 2.0
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B_" in name:
                p.normal_(std=0.1)
    sd = ours.state_dict()
    merged = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                p.copy_(merge_lora(ours, name, sd[name], sd.__getitem__))
                assert not p.equal(sd[name])
    out = ours(input_ids=ids).logits
    torch.testing.assert_close(out, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    assert experts.lora_A_down.grad is not None and experts.lora_B_gate_up.grad.abs().sum() > 0


def test_transformers_4_57_layout_is_refused_in_one_line():
    """transformers 4.57's Qwen3-VL-MoE block (gate an nn.Linear, experts gate_up_proj [E, H, 2I],
    down_proj [E, I, H]) is not read as hpcrl's layout: one ConfigError naming the field and the
    transformers version (was: AttributeError in VLMoE.__init__)."""
    import transformers
    from torch import nn

    from hpcrl.errors import ConfigError
    from hpcrl.models.vlm_moe import swap_moe_blocks

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 2 * 16))
            self.down_proj = nn.Parameter(torch.zeros(4, 16, 32))
            self.act_fn = nn.SiLU()

    block = type("Qwen3VLMoeTextSparseMoeBlock", (nn.Module,), {})()
    block.gate, block.experts = nn.Linear(32, 4, bias=False), Experts()
    with pytest.raises(ConfigError) as e:
        swap_moe_blocks(nn.ModuleDict({"mlp": block}), "model.ep")
    assert e.value.path == "model.ep" and f"transformers {transformers.__version__}" in str(e.value)
    assert "\n" not in str(e.value)
