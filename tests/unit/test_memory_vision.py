"""hpcrl.launch.memory_vision by hand: the image geometry a preprocessor_config.json gives, the patches
of a micro-batch, and the elements a patch costs (the module docstring's formulas)."""

from __future__ import annotations

import pytest

from hpcrl.launch import memory_vision as mv

GIB = 1024**3
# Qwen2.5-VL-7B's vision_config (E 1280, I 3420, O 3584, depth 32, p 14): a gated MLP (VIS_MLP 4)
QWEN25_VL = {
    "model_type": "qwen2_5_vl",
    "vision_config": dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
}  # fmt: skip
# its release's preprocessor_config.json (the older max_pixels key)
QWEN25_PROCESSOR = {"max_pixels": 12845056, "min_pixels": 3136, "patch_size": 14, "merge_size": 2,
                    "temporal_patch_size": 2}  # fmt: skip


def test_geometry_from_the_processor_config_and_the_release_defaults():
    g = mv.image_geometry(None, "qwen2_5_vl", QWEN25_PROCESSOR)
    # 12,845,056 / 28^2 = 16,384 cells of 2 x 2 patches: 65,536 patches, 16,384 tokens
    assert (g.patches, g.tokens, g.source) == (65_536, 16_384, "preprocessor_config.json")
    new = mv.image_geometry(
        None, "qwen3_vl", {"size": {"longest_edge": 64 * 64}, "patch_size": 16, "merge_size": 2}
    )
    assert (new.max_pixels, new.patches, new.tokens) == (4096, 16, 4)  # 4096 / 32^2 = 4 cells
    rel = mv.image_geometry(None, "qwen3_vl", {})
    assert (rel.max_pixels, rel.patch, rel.tokens) == (16_384 * 32**2, 16, 16_384)
    odd = mv.image_geometry(
        None, "qwen3_vl", {"size": {"longest_edge": 5000}, "patch_size": 16, "merge_size": 2}
    )
    assert odd.patches == 4 * 4  # floor(5000 / 1024) = 4 cells: resized sides are multiples of 32


def test_patches_of_a_micro_batch():
    """The worst case: every token of the sample an image token, N = seq_len x m^2."""
    small = mv.ImageGeometry(64 * 64, 16, 2, 2, "x")  # 16 patches, 4 tokens an image
    n, how = mv.micro_batch_patches(small, 4096)
    assert n == 4096 * 4 and how == "1024 image(s) of max_pixels 4096 (16 patches, 4 tokens each)"
    n, how = mv.micro_batch_patches(small, 10)
    assert n == 40 and how.endswith("(16 patches, 4 tokens each) + smaller ones in the last 2 tokens")
    big = mv.ImageGeometry(16_384 * 32**2, 16, 2, 2, "x")  # 16,384 tokens an image
    n, how = mv.micro_batch_patches(big, 4096)
    assert n == 4096 * 4 and "needs 16384 tokens > seq_len 4096 (dropped from its sample)" in how


def test_qwen2_5_vl_rows_by_hand():
    """E 1280, I 3420, O 3584, D 32, no deepstack; voxel 3 x 2 x 14^2 = 1176; seq_len 8192 < T 16384:
    N = 8192 x 4 = 32,768 patches, bf16.
      frozen:  1176 + max(7E = 8960, 2E + 2I = 9400) + O / 4 = 896 -> 11,472 elements
               x 2 B x 32,768 / 2^30 = 11,472 / 16,384 = 0.700195 GiB
      trained: 1176 + 32 x (10E + 4I = 12,800 + 13,680 = 26,480) = 847,360 + 4E = 5120 -> 853,656
               / 16,384 = 52.10303 GiB (freezing saves 52.10303 - 0.70020 = 51.40283)
      trained, [model.ac] freq 1: 1176 + 32E = 40,960 + 26,480 (one block recomputed) + 5120 = 73,736
               / 16,384 = 4.50049 GiB
      freq 3: c = ceil(32 / 3) = 11 blocks keep E: 1176 + 11E = 14,080 + (32 - 11 + 1) x 26,480 = 582,560
               + 5120 = 602,936 / 16,384 = 36.80029 GiB"""
    g = mv.image_geometry(None, "qwen2_5_vl", QWEN25_PROCESSOR)
    frozen, saved = mv.image_item(QWEN25_VL, g, seq_len=8192, compute="bfloat16", trained=False)
    assert frozen.gib == pytest.approx(11_472 / 16_384) and saved == 0
    trained, saved = mv.image_item(QWEN25_VL, g, seq_len=8192, compute="bfloat16", trained=True)
    assert trained.gib == pytest.approx(853_656 / 16_384)  # 52.10303
    assert saved == pytest.approx((853_656 - 11_472) / 16_384)
    ckpt, _ = mv.image_item(QWEN25_VL, g, seq_len=8192, compute="bfloat16", trained=True, ckpt_freq=1)
    assert ckpt.gib == pytest.approx(73_736 / 16_384)  # 4.50049
    assert "blocks checkpointed (every 1)" in ckpt.note
    every3, _ = mv.image_item(QWEN25_VL, g, seq_len=8192, compute="bfloat16", trained=True, ckpt_freq=3)
    assert every3.gib == pytest.approx(602_936 / 16_384)  # 36.80029
    fz, _ = mv.image_item(QWEN25_VL, g, seq_len=8192, compute="bfloat16", trained=False, ckpt_freq=1)
    assert fz.gib == frozen.gib  # a frozen tower saves nothing to checkpoint
    assert trained.name == "images" and trained.dtype == "bf16" and "32768 patches" in trained.note
    assert mv.image_item({"model_type": "qwen3"}, g, seq_len=8192, compute="bfloat16", trained=True) == (
        None,
        0.0,
    )


def test_expert_lora_params_by_hand():
    """Qwen3.6-35B-A3B's text shape (40 layers, 256 experts, H 2048, I 512) with prime-rl's rank 32 on
    "experts": 40 x 256 x 32 x (2 x 2048 + 3 x 512 = 5632) = 1,845,493,760 parameters."""
    from hpcrl.models.arch import Arch

    arch = Arch(hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256, intermediate=0, vocab=248320,
                num_experts=256, top_k=8, moe_intermediate=512)  # fmt: skip

    class Lora:
        rank = 32
        target_modules = ["q_proj", "experts"]

    assert mv.expert_lora_params(arch, Lora()) == 1_845_493_760
    Lora.target_modules = ["q_proj"]
    assert mv.expert_lora_params(arch, Lora()) == 0


def test_the_rl_plan_counts_the_vision_rows_too(tmp_path):
    """hpcrl run's trainer with [trainer.model.vlm] (multimodal RL): the same rows through vlm_rows.
    Qwen3-VL-8B (tests/unit/test_memory_sft_vlm.py's config.json, no preprocessor_config.json: the
    release's 16384 tokens an image) on the 8 ranks of one node, seq_len 4096, bf16 compute: the
    tower's shard + gathered copy V x 4 / 8 + V x 2 = 1.34201 GiB, its frozen images' peak at
    16,384 patches 16,544 x 2 x 16,384 / 2^30 = 0.50488 GiB (as the SFT plan's)."""
    import json

    from hpcrl.launch import memory_plan as mp
    from hpcrl.launch.placement import slurm_placement
    from tests.unit.test_memory_plan import cfg_of
    from tests.unit.test_memory_sft_vlm import QWEN3_VL_8B, V

    model = tmp_path / "qwen3-vl-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_VL_8B))
    (tmp_path / "vlm.toml").write_text("[trainer.model.vlm]\n")
    cfg = cfg_of(str(tmp_path / "vlm.toml"), "--model.name", str(model), "--seq-len", "4096")
    trainer = {i.name: i for i in mp.plan_for(cfg, slurm_placement(cfg)).trainer}
    assert trainer["vision encoder"].gib == pytest.approx(V * 4 / 8 / GIB + V * 2 / GIB)
    assert trainer["images"].gib == pytest.approx(16_544 * 2 * 16_384 / GIB)
    cfg.trainer.model.vlm = None
    assert "images" not in {i.name for i in mp.plan_for(cfg, slurm_placement(cfg)).trainer}


def test_the_rl_plan_counts_expert_lora_too(tmp_path):
    """hpcrl run's trainer with [trainer.model.vlm] and LoRA (rank 8) on q_proj and "experts" of a
    Qwen3-VL-30B-A3B-shaped text model (48 layers, H 2048, 32 heads x 128, 128 experts, I 768), 8 ranks,
    fp32 master: q_proj 48 x 8 x (2048 + 4096) = 2,359,296, experts 48 x 128 x 8 x (2 x 2048 + 3 x 768)
    = 314,572,800; the LoRA gradients are (2,359,296 + 314,572,800) / 8 x 4 B = 0.147583 GiB."""
    import json

    from hpcrl.launch import memory_plan as mp
    from hpcrl.launch.placement import slurm_placement
    from tests.unit.test_memory_plan import cfg_of

    text = dict(model_type="qwen3_vl_moe_text", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936,
                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)  # fmt: skip
    model = tmp_path / "vl-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "text_config": text}))
    (tmp_path / "vlm.toml").write_text(
        "[trainer.model.vlm]\n[trainer.model.lora]\nrank = 8\ntarget_modules = ['q_proj', 'experts']\n"
    )
    cfg = cfg_of(str(tmp_path / "vlm.toml"), "--model.name", str(model), "--seq-len", "4096")
    pl = slurm_placement(cfg)
    assert pl.trainer_ranks == 8 and mp.find_arch(str(model)).num_experts == 128
    trainer = {i.name: i for i in mp.plan_for(cfg, pl).trainer}
    assert trainer["gradients"].gib == pytest.approx(0.147583, abs=1e-6)
    assert trainer["gradients"].gib == pytest.approx((2_359_296 + 314_572_800) / 8 * 4 / GIB)
