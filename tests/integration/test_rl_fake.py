"""prime-rl's RL trainer on fake data (configs/debug/fake/rl.toml's shape, `[data.fake]`) through
`hpcrl trainer`: the real model trains on seeded random batches with no orchestrator and no
inference server, and logs every step to metrics.jsonl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from hpcrl.trainer.rl_fake import fake_batch, rows_of_rank, sample_lengths
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]


def test_rows_are_split_over_ranks():
    assert [rows_of_rank(5, r, 2) for r in range(2)] == [3, 2]
    assert [rows_of_rank(2, r, 4) for r in range(4)] == [1, 1, 0, 0]


def test_fake_batch_shape_mask_and_seed():
    b = fake_batch(step=3, rank=1, world=2, rows=2, seq_len=16, vocab=50, generate_samples=False, seed=0)
    assert b.seq_lens.tolist() == [16, 16] and len(b.input_ids) == 32
    assert b.position_ids.tolist() == list(range(16)) * 2
    assert b.loss_mask.tolist() == ([False] + [True] * 15) * 2  # a sample's first token: no prefix
    assert b.total_loss_tokens == 30
    assert int(b.input_ids.max()) < 50
    # the uniform sampler's logprob on trained tokens, 0 elsewhere; advantages only on trained tokens
    assert np.allclose(b.inference_logprobs[b.loss_mask], -np.log(50))
    assert not b.inference_logprobs[~b.loss_mask].any() and not b.advantages[~b.loss_mask].any()
    same = fake_batch(3, 1, 2, 2, 16, 50, False, 0)
    assert np.array_equal(b.input_ids, same.input_ids)
    assert not np.array_equal(b.input_ids, fake_batch(3, 0, 2, 2, 16, 50, False, 0).input_ids)


def test_generate_samples_packs_rows_of_seq_len():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 64, True)
    assert sum(lens) == 64 and len(lens) > 1 and all(1 <= n < 8 for n in lens[:-1])
    b = fake_batch(1, 0, 1, 3, 64, 50, True, 0)
    assert len(b.input_ids) == 3 * 64 and len(b.seq_lens) > 3


def test_run_refuses_fake_data_and_trainer_takes_it(tmp_path: Path):
    from hpcrl.config import schema
    from hpcrl.errors import ConfigError
    from hpcrl.launch.checks import load

    cfg = tmp_path / "rl.toml"
    cfg.write_text('max_steps = 2\n[trainer.data.fake]\nbatch_size = 2\n[model]\nname = "hpcrl/tiny-qwen3"\n')
    with pytest.raises(ConfigError, match="trainer.data.fake"):
        load(["@", str(cfg)], schema.Config, require_envs=True)
    loaded = load(["@", str(cfg)], schema.Config, require_envs=False, role="trainer")
    assert loaded.config.trainer.data.fake.batch_size == 2


def test_trainer_alone_trains_on_fake_batches(tiny_model_dir: Path, tmp_path: Path):
    out = tmp_path / "run"
    cfg = tmp_path / "rl.toml"
    # prime-rl's configs/debug/fake/rl.toml, with the tiny model and a short sequence
    cfg.write_text(
        f'max_steps = 3\noutput_dir = "{out}"\n'
        "[data.fake]\nbatch_size = 2\ngenerate_samples = true\n"
        f'[model]\nname = "{tiny_model_dir}"\nseq_len = 128\n'
    )
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "trainer", "@", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(RunPaths(out).metrics_file) if r.get("role") == "trainer"}
    assert sorted(rows) == [1, 2, 3]
    assert all(np.isfinite(r["loss/mean"]) for r in rows.values())
    assert all(r["progress/total_tokens"] == 2 * 128 * s for s, r in rows.items())  # 2 rows of 128 a step
    assert not RunPaths(out).rollouts_dir.exists() or not any(RunPaths(out).rollouts_dir.iterdir())


def test_two_ranks_share_the_rows(tiny_model_dir: Path, tmp_path: Path):
    """batch_size is over all ranks (prime-rl's): 3 rows on 2 ranks train 2 + 1 rows a step, FSDP."""
    from tests.integration.ranks import Ranks, wait_ranks

    out = tmp_path / "run"
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        f'max_steps = 2\noutput_dir = "{out}"\n[data.fake]\nbatch_size = 3\n'
        f'[model]\nname = "{tiny_model_dir}"\nseq_len = 128\n'
    )
    # the rendezvous store is this process's, on a port the kernel picked and held (tests/integration/
    # ranks.py): a port picked free, then bound seconds later, can be taken meanwhile (a rank left
    # waiting on a stranger); a rank that fails stops the other at once
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    command = [sys.executable, "-m", "hpcrl.cli", "trainer", "@", str(cfg)]
    wait_ranks(Ranks("", [], logs, command=command), timeout=300)
    rows = {r["step"]: r for r in read_metrics(RunPaths(out).metrics_file) if r.get("role") == "trainer"}
    assert sorted(rows) == [1, 2]
    assert all(r["progress/total_tokens"] == 3 * 128 * s for s, r in rows.items())
    assert all(np.isfinite(r["loss/mean"]) for r in rows.values())


def test_fake_trainer_owns_the_wandb_run(tiny_model_dir: Path, tmp_path: Path):
    """Alone, the trainer is the W&B writer (a whole run's is the orchestrator): its steps reach W&B."""
    pytest.importorskip("wandb")
    from hpcrl.monitor.wandb_offline import read_offline_run

    out = tmp_path / "run"
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        f'max_steps = 2\noutput_dir = "{out}"\n[data.fake]\nbatch_size = 1\n'
        f'[model]\nname = "{tiny_model_dir}"\nseq_len = 128\n'
    )
    wandb_vars = ("WANDB_API_KEY", "WANDB_DIR", "WANDB_MODE", "HPCRL_WANDB_WRITER")
    env = child_env(*wandb_vars, OMP_NUM_THREADS="1", HOME=str(tmp_path), WANDB_SILENT="true")
    argv = ["trainer", "@", str(cfg), "--wandb", "--wandb.offline", "--wandb.project", "fake-t"]
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = read_offline_run(out / "wandb")
    assert run.project == "fake-t" and run.exited
    assert sorted(h["step"] for h in run.history if "loss/mean" in h) == [1, 2]
