"""`hpcrl sft` with `[model.vlm]` and expert parallelism on a tiny Qwen3-VL-MoE built offline
(hpcrl.models.tiny_vlm, moe=True: 8 experts, top-2, both text layers MoE): two gloo ranks with ep = 2
(each MoE block of transformers' VL class on hpcrl's expert-parallel MoE, hpcrl.models.vlm_moe) give
the losses of one rank with ep = 1 (transformers' own MoE blocks), on the images of test_sft_vlm;
the exported weights keep transformers' names and match, and a resume lands on the same weights; LoRA on the projections and the stacked
experts beside ep gives one rank's losses too; prime-rl's examples/vlm_sft_moe passes the dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.paths import RunPaths
from tests.conftest import child_env
from tests.integration.test_sft import REPO, losses, resumed_at_step_2, run_sft
from tests.integration.test_sft_vlm import changed, make_data, weights, write_config


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("sft-vlm-moe")
    model = build_tiny_vlm(root / "tiny-vlm-moe", moe=True)
    return root, model, make_data(root / "data")


def _ep2(cfg: Path, extra: str = "") -> Path:
    text = cfg.read_text().replace("[model]\n", "[model]\nep = 2\n")
    cfg.write_text(text + extra + "[deployment]\nnum_trainer_ranks = 2\n")
    return cfg


@pytest.mark.slow
def test_vlm_moe_ep2_on_two_ranks_matches_one_rank(moe_setup, tmp_path):
    _, model, data = moe_setup
    one = write_config(tmp_path / "one.toml", model, data, tmp_path / "one")
    run_sft(str(one))
    two = _ep2(write_config(tmp_path / "two.toml", model, data, tmp_path / "two"))
    proc = run_sft(str(two), timeout=600)
    assert "[vlm]: 2 MoE blocks of the language model on hpcrl's MoE (ep 2)" in proc.stdout + proc.stderr
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    # measured: equal to ~1e-7 relative (the ranks' gradient sums differ in order only)
    for s in (1, 2, 3, 4):
        assert b[s]["loss/mean"] == pytest.approx(a[s]["loss/mean"], rel=1e-5)
    for s in (2, 4):
        assert b[s]["val/loss"] == pytest.approx(a[s]["val/loss"], rel=1e-5)
    assert a[4]["loss/mean"] < a[1]["loss/mean"] - 0.5
    init = weights(model)
    w1, w2 = (
        weights(RunPaths(tmp_path / "one").weights_dir(4)),
        weights(RunPaths(tmp_path / "two").weights_dir(4)),
    )
    assert sorted(init) == sorted(w1) == sorted(w2)  # transformers' names, experts fused and stacked
    for k in w1:
        assert (w2[k].float() - w1[k].float()).abs().max() < 1e-4, k
    assert not any(changed(init, w2, vision=True))  # frozen encoder
    experts = [k for k in init if ".mlp.experts." in k or k.endswith(".mlp.gate.weight")]
    assert len(experts) == 6 and all(not init[k].equal(w2[k]) for k in experts)  # every expert trained
    # a resume from step 2 (ep-sharded experts in the checkpoint) lands on the same losses, bit for bit
    copy = resumed_at_step_2(tmp_path / "two", two, tmp_path / "resumed")
    c = losses(copy)
    assert [c[s]["loss/mean"] for s in (3, 4)] == [b[s]["loss/mean"] for s in (3, 4)]
    wc = weights(RunPaths(copy).weights_dir(4))
    assert all(wc[k].equal(w2[k]) for k in w2)


LORA = (
    '[model.lora]\nrank = 8\nalpha = 8\ntarget_modules = ["q_proj", "k_proj", "v_proj", "o_proj", '
    '"gate_proj", "up_proj", "down_proj", "experts"]\n[model.ac]\nmode = "selective"\n'
    'targets = ["norm", "attn_proj"]\n'
)


@pytest.mark.slow
def test_vlm_moe_lora_on_the_experts_with_ep2_matches_one_rank(moe_setup, tmp_path):
    """prime-rl's vlm_sft_moe keys (LoRA on the projections and "experts", selective AC): peft's
    adapters on the attention, hpcrl's on the stacked experts (hpcrl.models.vlm_moe), over ep = 2 on
    two ranks: the losses of one rank with ep = 1; the export merges both adapters; the router, the
    vision tower and every base weight stay as they were under LoRA."""
    _, model, data = moe_setup
    one = write_config(tmp_path / "one.toml", model, data, tmp_path / "one", extra="")
    one.write_text(one.read_text().replace("[model]\n", '[model]\nimpl = "auto"\n') + LORA)
    proc = run_sft(str(one), "--max-steps", "2")
    assert "LoRA (rank 8) on the stacked experts of 2 MoE blocks" in proc.stdout + proc.stderr
    two = write_config(tmp_path / "two.toml", model, data, tmp_path / "two")
    two.write_text(two.read_text().replace("[model]\n", '[model]\nimpl = "auto"\n'))
    _ep2(two, LORA)
    run_sft(str(two), "--max-steps", "2", timeout=600)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a[2]["loss/mean"] < a[1]["loss/mean"]
    for s in (1, 2):
        assert b[s]["loss/mean"] == pytest.approx(a[s]["loss/mean"], rel=1e-5)
    init = weights(model)
    w1, w2 = (weights(RunPaths(tmp_path / d).weights_dir(2)) for d in ("one", "two"))
    assert sorted(w2) == sorted(init)
    for k in init:
        assert (w2[k].float() - w1[k].float()).abs().max() < 1e-4, k
    assert not any(changed(init, w2, vision=True))
    for k in init:
        if k.endswith(".mlp.gate.weight") or "norm" in k:
            assert init[k].equal(w2[k]), k  # not adapted: frozen under LoRA
        if ".mlp.experts." in k or "self_attn.q_proj" in k:
            assert not init[k].equal(w2[k]), k  # the adapters merged into the exported weights


def _dry_run(cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg), "--dry-run"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_prime_rl_vlm_sft_moe_example_shape_dry_run(tmp_path):
    """examples/vlm_sft_moe/sft.toml as written (Qwen3.6-35B-A3B, ep = 8 on 8 GPUs, [model.vlm], LoRA
    on the projections and "experts", selective AC) passes the dry run; LoRA on "experts" alone is
    refused in one line naming model.lora.target_modules."""
    example = (
        'max_steps = 1000\ndist_timeout_seconds = 3600\n[model]\nname = "Qwen/Qwen3.6-35B-A3B"\n'
        'optimization_dtype = "bfloat16"\nreduce_dtype = "bfloat16"\nimpl = "custom"\n'
        'attn = "flash_attention_2"\nep = 8\n[renderer]\nname = "auto"\n[model.vlm]\n'
        'vision_encoder_attr = "model.visual"\nlanguage_model_attr = "model.language_model"\n'
        "freeze_vision_encoder = true\n[model.lora]\nrank = 32\nalpha = 32\n"
        'target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"TARGET]\n'
        '[model.ac]\nmode = "selective"\ntargets = ["norm", "attn_proj", "linear_attn"]\n'
        '[data]\ntype = "sft"\nname = "your-org/your-multimodal-dataset"\nbatch_size = 8\n'
        "micro_batch_size = 1\nseq_len = 16384\n[data.loss_mask]\nsystem = false\nuser = false\n"
        "assistant = true\ntool = false\n[optim]\nlr = 1e-5\n[ckpt]\ninterval = 200\n"
        '[deployment]\ntype = "single_node"\nnum_train_gpus = 8\n'
    )
    ok = tmp_path / "ok.toml"
    ok.write_text(f'output_dir = "{tmp_path / "run"}"\n' + example.replace("TARGET", ', "experts"'))
    proc = _dry_run(ok)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "dry run OK" in proc.stdout
    alone = tmp_path / "alone.toml"
    text = example.replace("TARGET", "").replace(
        '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]', '["experts"]'
    )
    alone.write_text(f'output_dir = "{tmp_path / "run2"}"\n' + text)
    proc = _dry_run(alone)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "model.lora.target_modules" in err[0] and "alone" in err[0], proc.stderr
