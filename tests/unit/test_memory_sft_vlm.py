"""`hpcrl sft --dry-run`'s memory plan with `[model.vlm]`: the vision encoder's row, by hand.

A Qwen3-VL-8B-shaped config.json: its text model is Qwen3-8B's shape (tests/unit/test_memory_sft.py:
8,190,735,360 params; 4 ranks, fp32 master, bf16 compute, AdamW, 4096 tokens: 61.451 GiB a rank), its
vision_config the release's (tests/unit/test_arch_vision.py checks the count against transformers):
V = 576,388,336 params.
  frozen (the default): shard V x 4 B / 4 = 0.53680 GiB + gathered whole V x 2 B = 1.07361 GiB
                        = 1.61041 GiB; the rank 61.451 + 1.610 = 63.062 GiB
  trained:              + gradients V x 4 B / 4 + AdamW's 2 states V x 4 B x 2 / 4 = 1.61041 GiB
                        = 3.22082 GiB
The "images" row (hpcrl.launch.memory_vision): no preprocessor_config.json in the fixture, so the
release's geometry: p = 16, m = 2, max_pixels = 16384 x 32^2 = 16,777,216 -> P = 16384 cells x 4 =
65,536 patches, T = 16,384 tokens an image; seq_len 4096 < T: N = 4096 x m^2 = 16,384 patches.
E = 1152, I = 4304, O = 4096, D = 27, k = 3 deepstack mergers, a voxel C t p^2 = 3 x 2 x 256 = 1536.
  frozen:  1536 + max(7E = 8064, 2E + 2I = 10912) + (1 + 3) x O / 4 = 4096 -> 16,544 elements a patch
           x 2 B (bf16) x 16,384 patches = 16,544 / 32,768 GiB = 0.50488 GiB; the rank 63.566 GiB
  trained: 1536 + D x (10E + 2I = 20,128) = 543,456 + 4E x (1 + 3) = 18,432 -> 563,424 elements
           / 32,768 = 17.19434 GiB; the rank 61.451 + 3.22082 + 17.19434 = 81.866 GiB (refused on 64 GiB,
           freezing saves 1.61041 + 17.19434 - 0.50488 = 18.300 GiB)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config import schema
from hpcrl.errors import ConfigError
from hpcrl.launch import memory_sft as ms
from hpcrl.launch.checks import load

GIB = 1024**3
V = 576_388_336
TEXT_RANK = 61.451  # Qwen3-8B's trainer rank on 4 ranks (tests/unit/test_memory_sft.py)
QWEN3_VL_8B = {
    "model_type": "qwen3_vl",
    "text_config": dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
    ),
    "vision_config": dict(
        deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_size=1152, intermediate_size=4304,
        num_heads=16, num_position_embeddings=2304, out_hidden_size=4096, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, model_type="qwen3_vl",
    ),
}  # fmt: skip


def vlm_cfg(tmp_path: Path, vlm: str = "", model: Path | None = None):
    if model is None:
        model = tmp_path / "qwen3-vl-8b"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(QWEN3_VL_8B))
    f = tmp_path / "sft.toml"
    f.write_text(
        f'max_steps = 10\nseq_len = 4096\n[model]\nname = "{model}"\n[model.vlm]\n{vlm}\n'
        f'[data]\nname = "{tmp_path / "d.jsonl"}"\n[deployment]\nnum_train_gpus = 4\n'
    )
    return load(["@", str(f)], schema.SFTConfig).config


def rows(items):
    return {i.name: i for i in items}


def test_a_frozen_vision_encoder_is_its_shard_and_its_gathered_copy(tmp_path: Path):
    cfg = vlm_cfg(tmp_path)
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, visible=8))
    assert plan is not None and plan.arch.vision_params == V
    r = rows(plan.trainer)
    assert [i.name for i in plan.trainer][3:5] == ["gathered", "vision encoder"]
    assert r["vision encoder"].gib == pytest.approx(V * 4 / 4 / GIB + V * 2 / GIB)  # 1.61041
    assert r["vision encoder"].gib == pytest.approx(1.61041, abs=1e-5)
    assert "frozen: no gradients, no optimizer state" in r["vision encoder"].note
    assert r["vision encoder"].dtype == "mixed"  # fp32 shard, bf16 gathered
    # the text rows are the text model's alone, as without [model.vlm]
    assert r["parameters"].gib == pytest.approx(8_190_735_360 / GIB)
    assert [i.name for i in plan.trainer][5] == "images"
    assert r["images"].gib == pytest.approx(16_544 * 2 * 16_384 / GIB)  # 0.50488
    assert r["images"].gib == pytest.approx(0.50488, abs=1e-5)
    assert "16384 patches" in r["images"].note and "frozen: nothing saved" in r["images"].note
    assert plan.trainer_gib == pytest.approx(TEXT_RANK + 1.61041 + 0.50488, abs=1e-3)  # 63.566
    assert plan.vision_trained_gib == 0
    lines = plan.lines(80)
    assert "8.19 B params + 576.39 M in the vision encoder" in lines[0]
    assert any(line.startswith("    vision encoder mixed     1.61 GiB") for line in lines)
    assert any(line.startswith("    images         bf16      0.50 GiB") for line in lines)
    plan.check(64)  # 63.57 GiB fits a 64 GiB GPU


def test_a_trained_vision_encoder_adds_gradients_and_optimizer_state(tmp_path: Path):
    cfg = vlm_cfg(tmp_path, "freeze_vision_encoder = false")
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, visible=8))
    v = rows(plan.trainer)["vision encoder"]
    shard = V * 4 / 4 / GIB
    assert v.gib == pytest.approx(shard + V * 2 / GIB + shard + 2 * shard)  # 3.22082
    assert "trained: + gradients + 2 optimizer state(s)" in v.note
    images = rows(plan.trainer)["images"]
    assert images.gib == pytest.approx(563_424 * 2 * 16_384 / GIB)  # 17.19434
    assert "trained: saved for the backward, every block" in images.note
    assert plan.vision_trained_gib == pytest.approx(3 * shard + 17.19434 - 0.50488, abs=1e-5)  # 18.300
    assert plan.trainer_gib == pytest.approx(TEXT_RANK + 3.22082 + 17.19434, abs=1e-3)  # 81.866
    with pytest.raises(ConfigError) as e:  # the check counts it: over 64 GiB, and says what freezing saves
        plan.check(64)
    assert "a trainer rank needs 81.9 GiB of 64 GiB" in e.value.message
    assert e.value.message.endswith(
        "model.vlm.freeze_vision_encoder = true saves the vision encoder's gradients, optimizer state "
        "and saved image activations (18.3 GiB)"
    )
    plan.check(82)
    # the optimizer on the host: no optimizer state on the GPU for it either
    host = vlm_cfg(tmp_path, "freeze_vision_encoder = false")
    host.model.optim_cpu_offload = True
    v = rows(ms.sft_plan(host, ms.local_gpus(host, 8)).trainer)["vision encoder"]
    assert v.gib == pytest.approx(shard + V * 2 / GIB + shard)


def test_no_vlm_section_no_vision_row(tmp_path: Path):
    cfg = vlm_cfg(tmp_path)
    cfg.model.vlm = None  # the same directory trained as a text model
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, 8))
    assert "vision encoder" not in rows(plan.trainer)
    assert plan.trainer_gib == pytest.approx(TEXT_RANK, abs=1e-3)


def test_the_dry_run_on_the_tiny_vlm_prints_the_vision_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from hpcrl.cli import main
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "tiny-vlm")
    vlm_cfg(tmp_path, model=model)
    rc = main(["sft", "@", str(tmp_path / "sft.toml"), "--dry-run", "--output-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0, out
    head = next(line for line in out.splitlines() if line.startswith("memory plan:"))
    assert " params + " in head and "in the vision encoder" in head
    row = next(line for line in out.splitlines() if line.startswith("    vision encoder "))
    assert row.endswith("frozen: no gradients, no optimizer state")
    # the tiny model's preprocessor_config.json: longest_edge 64 x 64 = 4096 pixels, p 16, m 2 -> 4 cells
    # of 32 x 32, 16 patches (4 tokens) an image; seq_len 4096 holds 1024 of them: 16,384 patches
    images = next(line for line in out.splitlines() if line.startswith("    images "))
    assert (
        "16384 patches of a micro-batch: 1024 image(s) of max_pixels 4096 (16 patches, 4 tokens each)"
        in images
    )
    assert "from preprocessor_config.json" in images


def test_activation_checkpointing_checkpoints_a_trained_towers_blocks(tmp_path: Path):
    """[model.ac] (full mode) with a trained tower: its 27 blocks keep only their input (E = 1152
    each) and one is recomputed: 1536 + 27 x 1152 = 31,104 + 20,128 + 18,432 -> 71,200 elements a
    patch, / 32,768 = 2.17285 GiB (17.19434 without)."""
    cfg = vlm_cfg(tmp_path, "freeze_vision_encoder = false\n[model.ac]\n")
    images = rows(ms.sft_plan(cfg, ms.local_gpus(cfg, 8)).trainer)["images"]
    assert images.gib == pytest.approx(71_200 / 32_768)  # 2.17285
    assert "blocks checkpointed (every 1)" in images.note
    selective = vlm_cfg(
        tmp_path, 'freeze_vision_encoder = false\n[model.ac]\nmode = "selective"\ntargets = ["mlp"]\n'
    )
    assert rows(ms.sft_plan(selective, ms.local_gpus(selective, 8)).trainer)["images"].gib == pytest.approx(
        563_424 / 32_768
    )  # selective: the tower as without
