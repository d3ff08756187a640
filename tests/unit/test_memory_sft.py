"""`hpcrl sft --dry-run`'s memory plan (hpcrl/launch/memory_sft.py): a trainer rank and the online
evals' inference server, on its own GPU or beside the trainer's, against numbers worked out by hand.

Qwen3-8B (tests/unit/test_memory_plan.py counts it): 8,190,735,360 params, 36 layers, 8 kv heads of
128, hidden 4096, intermediate 12288, vocab 151,936. On 80 GiB GPUs:
  eval server (bf16, tp 1, gpu_memory_utilization 0.9): weights 8,190,735,360 x 2 B = 15.2565 GiB,
  reserve 2 GiB, KV 72 - 15.2565 - 2 = 54.7435 GiB at 2 x 36 x 8 x 128 x 2 B = 147,456 B a token:
  (77,309,411,328 - 16,381,470,720 - 2,147,483,648) // 147,456 = 398,630 tokens.
  trainer rank (fp32 master, bf16 compute, AdamW, 4096 tokens, no checkpointing), N ranks:
  parameters + gradients + optimizer = 4 x 8,190,735,360 x 4 B / N = 122.05 / N GiB;
  gathered (151,936 x 4096 + 4096 + 2 x 192,946,432) x 2 + 192,946,432 x 4 = 2.5968 GiB;
  activations 4096 x 36 x (4 x 4096 + 6 x 6144 + 4 x 12288) x 2 B = 28.125 GiB;
  logits (chunks of 256) 256 x 151,936 x (2 + 4) = 0.2173 GiB. N = 8: 46.195 GiB; N = 4: 61.451 GiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import schema
from hpcrl.errors import ConfigError
from hpcrl.launch import memory_sft as ms
from hpcrl.launch.checks import load

GIB = 1024**3
PARAMS = 8_190_735_360


def sft_cfg(tmp_path: Path, deployment: str = "", eval_extra: str = "", with_eval: bool = True):
    f = tmp_path / "sft.toml"
    text = (
        'max_steps = 10\nseq_len = 4096\n[model]\nname = "Qwen/Qwen3-8B"\n'
        f'[data]\nname = "{tmp_path / "d.jsonl"}"\n[deployment]\n{deployment}\n'
    )
    if with_eval:
        text += f'[eval]\ninterval = 5\n{eval_extra}\n[[eval.env]]\nid = "reverse-text"\n'
    f.write_text(text)
    return load(["@", str(f)], schema.SFTConfig).config


def rows(items):
    return {i.name: i.gib for i in items}


def test_trainer_rank_and_eval_server_rows_by_hand(tmp_path: Path):
    cfg = sft_cfg(tmp_path, "num_train_gpus = 4")
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, visible=8))
    assert plan is not None and plan.gpus == ms.SFTGpus(node=8, ranks=4, ranks_per_node=4)
    t = rows(plan.trainer)
    assert t["parameters"] == pytest.approx(PARAMS * 4 / 4 / GIB)  # 7.628
    assert t["optimizer"] == pytest.approx(2 * PARAMS * 4 / 4 / GIB)
    assert t["gathered"] == pytest.approx(2_788_239_360 / GIB)  # 2.5968
    assert t["activations"] == pytest.approx(28.125)
    assert plan.trainer_gib == pytest.approx(61.451, abs=1e-3)
    s = plan.server
    assert s is not None and s.gpus == ["4"]  # the GPU after the 4 trainer ranks', prime-rl's layout
    assert rows(s.items) == pytest.approx(
        {"weights": PARAMS * 2 / GIB, "reserve": 2.0, "KV cache": 72 - PARAMS * 2 / GIB - 2}
    )
    assert s.kv_tokens == 398_630 and s.max_model_len == 4096
    plan.check(80)  # fits: 61.5 GiB a trainer rank, the server on a GPU of its own
    lines = ms.dry_run_lines(cfg, plan.gpus, on_gpu=True)
    assert (
        "  online eval server (GPU 4 of its own; tp 1, bf16, gpu_memory_utilization 0.9): 72.0 GiB of 80 GiB"
        in lines
    )
    # no [eval]: no server rows
    bare = sft_cfg(tmp_path, "num_train_gpus = 4", with_eval=False)
    assert ms.sft_plan(bare, ms.local_gpus(bare, 8)).server is None


def test_a_server_sharing_the_trainers_gpu_must_fit_beside_a_rank(tmp_path: Path):
    # 8 ranks on 8 GPUs: the server starts on GPU 0 beside a trainer rank of 46.195 GiB; vLLM takes
    # 0.9 x 80 = 72 GiB of it up front: 118.2 > 80. Up to (80 - 46.195) / 80 = 0.4226 fits.
    cfg = sft_cfg(tmp_path)
    gpus = ms.local_gpus(cfg, visible=8)
    assert gpus.ranks == 8
    plan = ms.sft_plan(cfg, gpus)
    assert plan.server.gpus is None and plan.trainer_gib == pytest.approx(46.195, abs=1e-3)
    with pytest.raises(ConfigError) as e:
        plan.check(80)
    assert e.value.path == "deployment.num_train_gpus"
    assert "72.0 GiB beside a trainer rank's 46.2 GiB" in e.value.message
    assert "deployment.num_train_gpus = 7" in e.value.message
    assert "eval.inference.gpu_memory_utilization <= 0.42" in e.value.message
    fits = sft_cfg(tmp_path, eval_extra="[eval.inference]\ngpu_memory_utilization = 0.42")
    ms.sft_plan(fits, gpus).check(80)  # 46.195 + 33.6 = 79.8 GiB
    over = sft_cfg(tmp_path, eval_extra="[eval.inference]\ngpu_memory_utilization = 0.43")
    with pytest.raises(ConfigError, match="does not fit"):
        ms.sft_plan(over, gpus).check(80)  # 46.195 + 34.4 = 80.6 GiB
    # SLURM: one rank per GPU whatever num_train_gpus says: the fix is the utilization
    with pytest.raises(ConfigError) as e:
        ms.sft_plan(cfg, ms.SFTGpus(8, 16, 8, local=False)).check(80)
    assert e.value.path == "eval.inference.gpu_memory_utilization"
    assert "num_train_gpus" not in e.value.message
    # on CPU the plan informs and refuses nothing
    assert ms.dry_run_lines(cfg, gpus, on_gpu=False)[-1].startswith("  note:       CPU compute")


def test_a_server_on_its_own_gpu_must_hold_a_sequence_and_get_its_tp(tmp_path: Path):
    long = sft_cfg(tmp_path, "num_train_gpus = 4", "[eval.inference]\nmax_model_len = 400000")
    with pytest.raises(ConfigError) as e:
        ms.sft_plan(long, ms.local_gpus(long, 8)).check(80)
    assert e.value.path == "eval.inference.max_model_len"
    assert "keeps 398630 tokens of KV cache" in e.value.message
    ms.sft_plan(sft_cfg(tmp_path, "num_train_gpus = 4", "[eval.inference]\nmax_model_len = 398630"),
                ms.local_gpus(long, 8)).check(80)  # fmt: skip
    tp2 = sft_cfg(tmp_path, "num_train_gpus = 4", "[eval.inference]\ntp = 2")
    with pytest.raises(ConfigError) as e:
        ms.sft_plan(tp2, ms.local_gpus(tp2, 8)).check(80)
    assert e.value.path == "deployment.num_infer_gpus" and "tp = 2 but gets 1 GPU(s)" in e.value.message
    ok = sft_cfg(tmp_path, "num_train_gpus = 4\nnum_infer_gpus = 2", "[eval.inference]\ntp = 2")
    plan = ms.sft_plan(ok, ms.local_gpus(ok, 8))
    assert plan.server.gpus == ["4", "5"]
    assert rows(plan.server.items)["weights"] == pytest.approx(PARAMS / GIB)  # / tp 2
    plan.check(80)


def test_the_sft_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from hpcrl.cli import main

    cfg = sft_cfg(tmp_path, "num_train_gpus = 1\nnum_infer_gpus = 1")
    del cfg
    rc = main(["sft", "@", str(tmp_path / "sft.toml"), "--dry-run", "--output-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "memory plan:  Qwen/Qwen3-8B" in out and "online eval server (GPU 1 of its own" in out


def test_a_trainer_rank_that_cannot_fit_names_the_sft_fields(tmp_path: Path):
    # 8 ranks, 32768 tokens a micro-batch: activations 8 x 28.125 = 225 GiB, the biggest row
    cfg = sft_cfg(tmp_path, "num_train_gpus = 8\nnum_infer_gpus = 0", with_eval=False)
    cfg.micro_batch_tokens = 32768
    plan = ms.sft_plan(cfg, ms.local_gpus(cfg, 8))
    assert rows(plan.trainer)["activations"] == pytest.approx(225.0)
    with pytest.raises(ConfigError) as e:
        plan.check(80)
    assert e.value.path == "model.activation_checkpointing"  # SFT's [model], not trainer.model
    assert "model.cp or a smaller micro_batch_tokens" in e.value.message and "trainer." not in e.value.message
