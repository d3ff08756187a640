"""prime-rl's examples/vlm_sft_moe keys on a tiny Qwen3.5-MoE VL (gated delta net + full attention
layers): selective AC of ["norm", "attn_proj", "linear_attn"] ("linear_attn": Qwen3.5's
layer.linear_attn, prime-rl's meaning) with LoRA on the projections and "experts" builds through the
trainer's path and trains a step (was: "trainer.model.ac.targets: ['linear_attn'] name nothing");
the dry run's check of the targets on the model built on the meta device names the same gap."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from tests.unit.test_vlm_moe import _qwen3_5_moe

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"]


def _cfg(path: Path, targets: list[str]):
    from hpcrl.config.sections.vlm import SFTModelConfig

    raw = {
        "name": str(path), "impl": "auto", "vlm": {}, "lora": {"rank": 4, "alpha": 4, "target_modules": TARGETS},
        "ac": {"mode": "selective", "targets": targets},
    }  # fmt: skip
    return msgspec.convert(raw, SFTModelConfig)


def test_linear_attn_target_builds_and_trains_a_step(tmp_path: Path) -> None:
    from hpcrl.trainer import precision
    from hpcrl.trainer.memory_savers import decoder_layers
    from hpcrl.trainer.packing import PackedBatch
    from hpcrl.trainer.setup import build_model
    from hpcrl.trainer.sft_vlm import VisionBatch, forward_multimodal

    torch.manual_seed(0)
    model = _qwen3_5_moe()  # full attention first: its q_proj LoRA's gradient passes the delta net
    model.config.text_config.layer_types = ["full_attention", "linear_attention"]
    type(model)(model.config).save_pretrained(tmp_path / "m")
    cfg = _cfg(tmp_path / "m", ["norm", "attn_proj", "linear_attn"])
    model = build_model(str(tmp_path / "m"), cfg, precision.of_model(cfg, on_gpu=False), torch.device("cpu"))
    layers = decoder_layers(model)
    assert layers[1].linear_attn._hpcrl_checkpointed and layers[0].self_attn.q_proj._hpcrl_checkpointed
    t = 16
    ids = torch.randint(0, 128, (t,))
    mb = VisionBatch(
        **{
            "input_ids": ids, "position_ids": torch.arange(t), "seq_lens": torch.tensor([t]),
            "loss_mask": torch.ones(t, dtype=torch.bool),
        }
    )  # fmt: skip
    assert isinstance(mb, PackedBatch)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts.lora_B_" in n for n in trained)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    (-forward_multimodal(model, mb).logprobs.sum()).backward()
    opt.step()
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not p.detach().equal(trained[n])]
    assert any("layers.0.self_attn.q_proj.lora_A" in n for n in moved)  # through layer 1's recompute
    assert any(".experts.lora_" in n for n in moved)


def test_dry_run_checks_the_targets_on_the_meta_model(tmp_path: Path) -> None:
    from hpcrl.errors import ConfigError
    from hpcrl.launch.checks import ac_targets

    _qwen3_5_moe().config.save_pretrained(tmp_path / "m")
    ac_targets(_cfg(tmp_path / "m", ["norm", "attn_proj", "linear_attn"]), "model")
    with pytest.raises(ConfigError) as e:
        ac_targets(_cfg(tmp_path / "m", ["norm", "mla_up_proj"]), "model")
    assert e.value.path == "model.ac.targets" and "mla_up_proj" in str(e.value) and "\n" not in str(e.value)
