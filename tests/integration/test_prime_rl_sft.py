"""prime-rl's SFT configs of today through `hpcrl sft`: a real run on the tiny model with prime-rl's
fake data loader (`[data] type = "fake"`, configs/debug/fake/sft.toml's shape) and its
micro_batch_size / [monitors.wandb] / [resume] keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcrl.trainer.sft_fake import fake_sample
from tests.integration.test_sft import losses, run_sft


def test_fake_rows_are_pure_functions_of_seed_and_index():
    a = fake_sample(5, 16, 100, "fixed", "increasing", 0)
    assert a.input_ids.tolist() == [5] * 16  # row 5: all token 5
    assert a.loss_mask.tolist() == [False] + [True] * 15  # the first token has no prefix
    assert fake_sample(105, 16, 100, "fixed", "increasing", 0).input_ids[0] == 5  # mod vocab
    r1 = fake_sample(3, 16, 100, "variable", "random", 7)
    r2 = fake_sample(3, 16, 100, "variable", "random", 7)
    assert np.array_equal(r1.input_ids, r2.input_ids) and 2 <= len(r1) < 16
    assert not np.array_equal(r1.input_ids, fake_sample(3, 16, 100, "variable", "random", 8).input_ids)


def test_a_prime_rl_fake_sft_config_trains_and_resumes(tiny_model_dir: Path, tmp_path: Path):
    out = tmp_path / "run"
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'max_steps = 3\noutput_dir = "{out}"\n'
        f'[model]\nname = "{tiny_model_dir}"\n'
        '[data]\ntype = "fake"\nbatch_size = 4\nseq_len = 32\nmicro_batch_size = 2\ninput_ids = "random"\n'
        "[optim]\nlr = 1e-3\n[ckpt]\ninterval = 2\n"
    )
    run_sft(str(cfg))
    first = losses(out)
    assert sorted(first) == [1, 2, 3]
    assert all(np.isfinite(r["loss/mean"]) for r in first.values())
    # prime-rl's [resume] table: continue from step 2 to 4, the same rows a never-stopped run sees
    resume = tmp_path / "resume.toml"
    resume.write_text("max_steps = 4\n[resume]\nstep = 2\n")
    run_sft(str(cfg), "@", str(resume))
    after = losses(out)
    assert 4 in after
