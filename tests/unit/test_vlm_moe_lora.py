"""LoRA on a VL MoE's stacked experts (model.lora "experts", hpcrl.models.vlm_moe) outside peft's
adapter: LoRA RL publishes every policy in full (merged) since an adapter alone would lose it; the
ckpt's adapter files are refused with it; `hpcrl export` and the warm start from a checkpoint step
dir merge it as the live export does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_vlm_moe import _qwen3_vl_moe


def _peft_vl_moe(only: str = "lora_B"):
    from peft import LoraConfig, get_peft_model

    from hpcrl.models.vlm_moe import add_expert_lora, swap_moe_blocks

    torch.manual_seed(0)
    ref = _qwen3_vl_moe().float()
    for name, p in ref.named_parameters():
        if ".mlp." in name:
            torch.nn.init.normal_(p, std=0.1)
    pm = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    swap_moe_blocks(pm.base_model.model)
    add_expert_lora(pm.base_model.model, 4, 8, 0.0, seed=0)
    with torch.no_grad():  # a trained adapter (B starts at zero: nothing to merge)
        for name, p in pm.named_parameters():
            if only in name:
                p.normal_(std=0.1)
    return pm


def test_lora_rl_publishes_expert_lora_policies_in_full(tmp_path: Path) -> None:
    from hpcrl.bus import Bus, PolicyReady, read_message
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.model import adapter_sync, hf_named_tensors
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.weights.checksum import state_dict_checksum

    model = _peft_vl_moe(only=".experts.lora_B_")  # peft's adapter untrained: it alone would travel
    paths = RunPaths(tmp_path / "run")
    pub = PolicyPublisher(paths, Bus(paths, "trainer", 0, listen=False), 0, "filesystem", keep=4)
    for step in (0, 1):
        if step:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".experts.lora_B_" in name:
                        p.add_(0.1)  # a training step of the expert adapters alone
        pub.publish(model, step)
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert not msg.adapter  # full weights: peft's adapter would drop the experts' change
        assert msg.checksum == state_dict_checksum(dict(hf_named_tensors(model)))
    assert adapter_sync(model) == (False, "the stacked experts' LoRA is not in peft's adapter")


def test_export_and_warm_start_from_a_checkpoint_merge_expert_lora(tmp_path: Path) -> None:
    from hpcrl.trainer.export import checkpoint_tensors, read_weights
    from hpcrl.trainer.model import hf_named_tensors
    from hpcrl.weights.checksum import state_dict_checksum
    from tests.unit.test_export import _checkpoint

    model = _peft_vl_moe()
    step_dir = _checkpoint(model, None, tmp_path / "run", 2, "bfloat16")
    live = {n: t.contiguous() for n, t in hf_named_tensors(model, dtype="bfloat16")}
    got = dict(checkpoint_tensors(step_dir))
    assert sorted(got) == sorted(live)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    torch.testing.assert_close(got[name], live[name], rtol=0, atol=0)
    assert state_dict_checksum(got) == state_dict_checksum(live)
    master = dict(hf_named_tensors(model))
    assert state_dict_checksum(read_weights(step_dir)) == state_dict_checksum(master)


@pytest.mark.parametrize("field", ["save_adapter_separately", "adapter_interval"])
def test_ckpt_adapter_files_are_refused_with_expert_lora(field: str) -> None:
    from types import SimpleNamespace

    from hpcrl.config.validate import _expert_adapters
    from hpcrl.errors import ConfigError

    ckpt = SimpleNamespace(save_adapter_separately=field == "save_adapter_separately", adapter_interval=0)
    if field == "adapter_interval":
        ckpt.adapter_interval = 5
    lora = SimpleNamespace(target_modules=("q_proj", "experts"))
    with pytest.raises(ConfigError) as e:
        _expert_adapters(ckpt, SimpleNamespace(lora=lora, vlm=object()))
    assert e.value.path == f"ckpt.{field}" and "\n" not in str(e.value)
    _expert_adapters(ckpt, SimpleNamespace(lora=SimpleNamespace(target_modules=("q_proj",)), vlm=object()))
