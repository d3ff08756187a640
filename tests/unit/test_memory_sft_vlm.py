"""`hpcrl sft --dry-run`'s memory plan with `[model.vlm]`: the vision encoder's row, by hand.

A Qwen3-VL-8B-shaped config.json: its text model is Qwen3-8B's shape (tests/unit/test_memory_sft.py:
8,190,735,360 params; 4 ranks, fp32 master, bf16 compute, AdamW, 4096 tokens: 61.451 GiB a rank), its
vision_config the release's (tests/unit/test_arch_vision.py checks the count against transformers):
V = 576,388,336 params.
  frozen (the default): shard V x 4 B / 4 = 0.53680 GiB + gathered whole V x 2 B = 1.07361 GiB
                        = 1.61041 GiB; the rank 61.451 + 1.610 = 63.062 GiB
  trained:              + gradients V x 4 B / 4 + AdamW's 2 states V x 4 B x 2 / 4 = 1.61041 GiB
                        = 3.22082 GiB; the rank 64.672 GiB (over 64 GiB: refused, naming the fix)
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
    assert plan.trainer_gib == pytest.approx(TEXT_RANK + 1.61041, abs=1e-3)  # 63.062
    assert plan.vision_trained_gib == 0
    lines = plan.lines(80)
    assert "8.19 B params + 576.39 M in the vision encoder" in lines[0]
    assert any(line.startswith("    vision encoder mixed     1.61 GiB") for line in lines)
    plan.check(64)  # 63.06 GiB fits a 64 GiB GPU


def test_a_trained_vision_encoder_adds_gradients_and_optimizer_state(tmp_path: Path):
    cfg = vlm_cfg(tmp_path, "freeze_vision_encoder = false")
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, visible=8))
    v = rows(plan.trainer)["vision encoder"]
    shard = V * 4 / 4 / GIB
    assert v.gib == pytest.approx(shard + V * 2 / GIB + shard + 2 * shard)  # 3.22082
    assert "trained: + gradients + 2 optimizer state(s)" in v.note
    assert plan.vision_trained_gib == pytest.approx(3 * shard)  # 1.61041
    assert plan.trainer_gib == pytest.approx(TEXT_RANK + 3.22082, abs=1e-3)  # 64.672
    with pytest.raises(ConfigError) as e:  # the check counts it: over 64 GiB, and says what freezing saves
        plan.check(64)
    assert "a trainer rank needs 64.7 GiB of 64 GiB" in e.value.message
    assert e.value.message.endswith(
        "model.vlm.freeze_vision_encoder = true saves the vision encoder's gradients and optimizer "
        "state (1.6 GiB)"
    )
    plan.check(65)
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
    assert "frozen: no gradients, no optimizer state; image activations not counted" in row
