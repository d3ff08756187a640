"""`hpcrl export` (hpcrl.trainer.export): HF weights from a training checkpoint's sharded state, equal to
what the live model publishes (same checksum as `hf_named_tensors`), for the dense tiny model, the
tiny MoE (stacked experts -> per-expert names) and LoRA (merged); the warm start reads either form;
a checkpoint that cannot be exported is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl.paths import RunPaths


class _Sched:
    def state_dict(self):
        return {}


def _checkpoint(model, tokenizer, run: Path, step: int, dtype: str) -> Path:
    from hpcrl import checkpoint
    from hpcrl.trainer.export import write_meta
    from hpcrl.trainer.state import save_trainer_state

    paths = RunPaths(run)
    checkpoint.begin_part(paths, step, "trainer")
    write_meta(model, tokenizer, paths.trainer_ckpt_dir(step) / "hf", dtype)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    save_trainer_state(paths, step, 0, 1, model, opt, _Sched(), {})
    checkpoint.mark_part_done(paths, step, "trainer", rank=0)
    return paths.checkpoint_dir(step)


def _trained(model):
    ids = torch.arange(3, 35).reshape(2, 16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    return model


@pytest.mark.parametrize("kind", ["dense", "moe", "lora"])
def test_export_equals_the_live_policy(tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    from safetensors.torch import load_file

    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model
    from hpcrl.models.tiny import build_tiny_model
    from hpcrl.models.tokenizer import load_tokenizer
    from hpcrl.trainer.export import checkpoint_tensors, export, read_weights
    from hpcrl.trainer.model import hf_named_tensors
    from hpcrl.weights.checksum import state_dict_checksum

    torch.manual_seed(0)
    src = tiny_model_dir
    if kind == "moe":
        src = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
        model = load_model(src, impl="custom")
    elif kind == "lora":
        model = load_model(src, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # peft starts B at zero: the merge would change nothing
    else:
        model = load_model(src)
    model = _trained(model)
    live = {n: t.contiguous() for n, t in hf_named_tensors(model, dtype="bfloat16")}
    step_dir = _checkpoint(model, load_tokenizer(src), tmp_path / "run", 3, "bfloat16")
    got = dict(checkpoint_tensors(step_dir))
    assert sorted(got) == sorted(live)
    assert state_dict_checksum(got) == state_dict_checksum(live)
    if kind == "moe":
        assert any(".experts.0." in n for n in got)  # per-expert HF names, read one expert at a time
    out = export(step_dir, max_file_bytes=200_000)  # several files + index
    assert out == tmp_path / "run" / "weights" / "step_3"
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    files = {}
    for f in out.glob("*.safetensors"):
        files.update(load_file(str(f)))
    assert state_dict_checksum(files) == state_dict_checksum(live)
    # the warm start's reader: an HF dir as written, a checkpoint dir in the master dtype
    assert state_dict_checksum(read_weights(out)) == state_dict_checksum(live)
    master = {n: t.contiguous() for n, t in hf_named_tensors(model)}
    assert state_dict_checksum(read_weights(step_dir)) == state_dict_checksum(master)


def test_unexportable_checkpoints_are_one_line_errors(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from hpcrl.cli import main
    from hpcrl.models.spec import load_model
    from hpcrl.models.tokenizer import load_tokenizer

    model = load_model(tiny_model_dir)
    step_dir = _checkpoint(model, load_tokenizer(tiny_model_dir), tmp_path / "run", 2, "float32")
    (step_dir / "trainer" / "DONE.rank_0").unlink()
    cases = [
        ([str(step_dir)], "trainer rank(s) [0] of 1 did not finish"),
        ([str(tmp_path)], "holds no trainer checkpoint"),
        ([str(step_dir), "--dtype", "int8"], "--dtype int8"),
        ([], "usage: hpcrl export"),
    ]
    for args, want in cases:
        code = main(["export", *args])
        out = capsys.readouterr()
        assert code == 2, (args, out)
        text = out.err or out.out
        assert want in text, (args, text)
    (step_dir / "trainer" / "DONE.rank_0").write_text("1")
    assert main(["export", str(step_dir), "--out", str(tmp_path / "hf"), "--dtype", "master"]) == 0
    assert "exported" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
