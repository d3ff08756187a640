"""[model.ac] with a trained vision encoder ([model.vlm] freeze_vision_encoder = false): the tower's
blocks are checkpointed too (hpcrl.trainer.memory_savers.checkpoint_vision_blocks), every freq-th,
with the gradients of the model without checkpointing; a frozen tower is left alone."""

from __future__ import annotations

import copy

import torch


def _model():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=128,
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=16)  # fmt: skip
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=5)
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(cfg).float()


def _grads(model, freeze: bool, freq: int | None):
    from hpcrl.config.sections.vlm import VLMConfig
    from hpcrl.trainer.memory_savers import checkpoint_vision_blocks
    from hpcrl.trainer.sft_vlm import prepare_model

    prepare_model(model, VLMConfig(freeze_vision_encoder=freeze))
    line = None if freq is None else checkpoint_vision_blocks(model, freq)
    grid = torch.tensor([[1, 4, 4]])  # one image: 16 patches, 4 tokens
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2, 5, 5, 5, 5, 3, 4]])
    out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == 5).long())
    out.logits.square().mean().backward()
    return line, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_trained_towers_blocks_are_checkpointed_with_the_same_gradients():
    base = _model()
    _, want = _grads(copy.deepcopy(base), freeze=False, freq=None)
    ckpt = copy.deepcopy(base)
    line, got = _grads(ckpt, freeze=False, freq=2)
    assert line == "activation checkpointing: 2 of 3 vision encoder blocks (trained)"  # blocks 0 and 2
    assert [getattr(b, "_hpcrl_checkpointed", False) for b in ckpt.model.visual.blocks] == [True, False, True]
    assert any("visual" in n for n in want) and want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_a_frozen_tower_is_left_alone():
    model = _model()
    line, grads = _grads(model, freeze=True, freq=1)
    assert line is None and not any("visual" in n for n in grads)
    assert not any(getattr(b, "_hpcrl_checkpointed", False) for b in model.model.visual.blocks)
