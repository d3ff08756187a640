"""`hpcrl sft` end to end on the tiny model: a real run in a subprocess, checkpoints, HF weights, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]


def write_config(path: Path, model: Path, data: Path, out: Path, **extra: str) -> Path:
    lines = [
        "max_steps = 4",
        "seq_len = 64",
        f'output_dir = "{out}"',
        "[model]",
        f'name = "{model}"',
        "[data]",
        f'name = "{data}"',
        "batch_size = 8",
        "seed = 0",
        "[val]",
        "interval = 2",
        "fraction = 0.1",
        "[optim]",
        "lr = 3e-3",
        "warmup_steps = 1",
        "[ckpt]",
        "interval = 2",
    ]
    for k, v in extra.items():
        lines.insert(0, f"{k} = {v}")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_sft(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(RunPaths(run).metrics_file) if r.get("role") == "trainer"}


def resumed_at_step_2(run: Path, cfg: Path, tmp_path: Path) -> Path:
    """A copy of a finished 4-step run without its step 4 (checkpoint, weights, metrics), resumed from
    its step-2 checkpoint to the end: its path."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    paths = RunPaths(copy)
    shutil.rmtree(paths.checkpoint_dir(4))
    shutil.rmtree(paths.weights_dir(4))
    paths.metrics_file.unlink()
    run_sft(str(cfg), "--output-dir", str(copy), "--ckpt.resume-step", "2")
    return copy


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from hpcrl.trainer.sft_data import make_demo

    root = tmp_path_factory.mktemp("sft")
    data, _ = make_demo(root / "demo-sft-data" / "train.jsonl", "reverse-text", n=200, seed=0)
    cfg = write_config(root / "sft.toml", tiny_model_dir, data, root / "run")
    run_sft(str(cfg))
    return root / "run", cfg


def test_sft_run_learns_and_writes_checkpoints_and_weights(sft_run):
    run, _ = sft_run
    paths = RunPaths(run)
    m = losses(run)
    assert sorted(m) == [1, 2, 3, 4]
    assert m[4]["loss/mean"] < m[1]["loss/mean"] - 0.3
    assert "val/loss" in m[2] and "val/loss" in m[4] and "val/loss" not in m[3]
    assert m[4]["val/loss"] < m[2]["val/loss"]
    for key in (
        "progress/epoch",
        "progress/num_samples",
        "progress/num_tokens",
        "optim/grad_norm",
        "optim/lr",
        "perf/throughput",
        "time/step",
        "time/forward_backward",
    ):
        assert key in m[4], key
    assert m[4]["progress/num_samples"] == 32 and m[4]["progress/epoch"] == pytest.approx(32 / 180)

    from hpcrl import checkpoint

    for step in (2, 4):
        assert checkpoint.verify(paths, step) is None
        manifest = json.loads(paths.complete_file(step).read_text())
        assert manifest["parts"] == ["trainer"]
    assert checkpoint.latest_complete(paths) == 4

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(paths.weights_dir(4)))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_sft_stops_at_a_validation_loss(sft_run, tiny_model_dir, tmp_path):
    """val.stop_at_loss ends the warm-up at a level of skill: the first validation at or below it
    (step 2 here, the same run as the fixture's) saves weights and stops."""
    run, cfg = sft_run
    target = losses(run)[2]["val/loss"] + 1e-3
    out = tmp_path / "stopped"
    run_sft(str(cfg), "--output-dir", str(out), "--val.stop-at-loss", str(target), "--ckpt.interval", "100")
    m = losses(out)
    assert sorted(m) == [1, 2] and m[2]["val/loss"] <= target
    assert (RunPaths(out).weights_dir(2) / "config.json").is_file()


def test_sft_resume_continues_with_the_next_samples(sft_run, tmp_path):
    """Resume from step 2 in a copy of the run: steps 3-4 see the same rows in the same order and land
    on bitwise the same weights as the uninterrupted run."""
    run, cfg = sft_run
    copy = resumed_at_step_2(run, cfg, tmp_path)
    paths = RunPaths(copy)
    a, b = losses(run), losses(copy)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert b[step]["loss/mean"] == a[step]["loss/mean"]
        assert b[step]["progress/num_samples"] == a[step]["progress/num_samples"]
    assert b[4]["val/loss"] == a[4]["val/loss"]

    from safetensors.torch import load_file

    wa = load_file(str(RunPaths(run).weights_dir(4) / "model.safetensors"))
    wb = load_file(str(paths.weights_dir(4) / "model.safetensors"))
    assert all((wa[k] == wb[k]).all() for k in wa)


@pytest.mark.parametrize("carry", [True, False], ids=["warm-start-optimizer", "fresh-optimizer"])
def test_sft_warm_start_carries_optimizer_state_when_asked(sft_run, tmp_path, carry):
    """`hpcrl sft` warm-started from the run's step_2 starts at its own step 1; with
    ckpt.warm_start_optimizer its AdamW state continues A's (saved step counters 2 + 1 = 3, moments
    from A's), without it the optimizer starts fresh (step counters 1)."""
    from safetensors.torch import load_file

    run, cfg = sft_run
    out = tmp_path / "warm"
    flags = ["--ckpt.warm-start-optimizer"] if carry else []
    ref = str(RunPaths(run).checkpoint_dir(2))
    proc = run_sft(str(cfg), "--output-dir", str(out), "--max-steps", "1", "--ckpt.warm-start", ref, *flags)
    assert sorted(losses(out)) == [1]
    assert ("warm start: optimizer state from" in proc.stderr + proc.stdout) == carry
    saved = load_file(str(RunPaths(out).trainer_ckpt_dir(1) / "rank_0.optim.safetensors"))
    counters = {float(v) for k, v in saved.items() if k.endswith(".step")}
    assert counters == ({3.0} if carry else {1.0})


def test_sft_bad_data_is_one_line_error(tiny_model_dir, tmp_path):
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, tmp_path / "missing.jsonl", tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("hpcrl: error: data.name: '") and "does not exist" in err[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sft_two_ranks_fsdp(sft_run, tiny_model_dir, tmp_path):
    """`deployment.num_trainer_ranks = 2` spawns two gloo ranks (FSDP2, rows split by stride)."""
    _, cfg1 = sft_run
    data = tmp_path.parent / "data.jsonl"
    shutil.copy(next(cfg1.parent.glob("demo-sft-data/train.jsonl")), data)
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, data, tmp_path / "run")
    cfg.write_text(cfg.read_text() + "[deployment]\nnum_trainer_ranks = 2\n")
    run_sft(str(cfg), timeout=600)
    paths = RunPaths(tmp_path / "run")
    from hpcrl import checkpoint

    assert checkpoint.verify(paths, 4) is None
    assert sorted(p.name for p in paths.trainer_ckpt_dir(4).glob("DONE.rank_*")) == [
        "DONE.rank_0",
        "DONE.rank_1",
    ]
    m = losses(tmp_path / "run")
    assert m[4]["progress/num_samples"] == 32 and m[4]["loss/mean"] < m[1]["loss/mean"]


def test_sft_cp2_equals_one_rank(sft_run, tiny_model_dir, tmp_path):
    """`model.cp = 2` over 2 ranks: both ranks read the same rows and train one time slice each (ring
    attention, the vocabulary-parallel head); the run counts each row once and follows the 1-rank
    run's losses (the module's run: same data, seed and config)."""
    run1, cfg1 = sft_run
    data = tmp_path.parent / "data_cp.jsonl"
    shutil.copy(next(cfg1.parent.glob("demo-sft-data/train.jsonl")), data)
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, data, tmp_path / "run")
    text = cfg.read_text().replace("[model]\n", "[model]\ncp = 2\n")
    cfg.write_text(text + "[deployment]\nnum_trainer_ranks = 2\n")
    run_sft(str(cfg), timeout=600)
    one, two = losses(run1), losses(tmp_path / "run")
    print(
        "sft cp=2 vs 1 rank: "
        + ", ".join(f"step {s}: {two[s]['loss/mean']:.6f} vs {one[s]['loss/mean']:.6f}" for s in sorted(one))
    )
    for step in sorted(one):
        assert two[step]["loss/mean"] == pytest.approx(one[step]["loss/mean"], abs=1e-4), step
        for k in ("loss_tokens", "progress/num_samples", "progress/num_tokens"):
            assert two[step][k] == one[step][k], (step, k)
        if "val/loss" in one[step]:
            assert two[step]["val/loss"] == pytest.approx(one[step]["val/loss"], abs=1e-4), step
    log = RunPaths(tmp_path / "run").log_file("trainer").read_text()
    assert "context parallel: cp 2" in log and "vocab-parallel embedding and LM head" in log


def test_sft_two_ranks_user_error_is_one_line(tiny_model_dir, tmp_path):
    """The rank spawner (hpcrl.launch.sft_ranks on the local launcher's supervision): a rank's user
    error ends the run with the rank's exit code 2 and its one-line message last, no traceback."""
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, tmp_path / "missing.jsonl", tmp_path / "run")
    cfg.write_text(cfg.read_text() + "[deployment]\nnum_trainer_ranks = 2\n")
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("hpcrl: error: data.name: '") and "does not exist" in err[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sft_two_ranks_sigterm_checkpoints_and_stops(sft_run, tiny_model_dir, tmp_path):
    """SIGTERM to the launcher is passed on to every rank: each finishes its step, they checkpoint
    that step together (COMPLETE, both ranks' parts) and the run exits 0 before max_steps."""
    _, cfg1 = sft_run
    data = next(cfg1.parent.glob("demo-sft-data/train.jsonl"))
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, data, tmp_path / "run")
    cfg.write_text(
        cfg.read_text().replace("max_steps = 4", "max_steps = 200").replace("interval = 2", "interval = 100")
        + "[deployment]\nnum_trainer_ranks = 2\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "MASTER_PORT")
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)],
        cwd=REPO,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    paths = RunPaths(tmp_path / "run")
    deadline = time.monotonic() + 300
    while not (paths.metrics_file.exists() and losses(paths.root)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    from hpcrl import checkpoint

    step = checkpoint.latest_complete(paths)
    assert step is not None and step < 200
    assert sorted(p.name for p in paths.trainer_ckpt_dir(step).glob("DONE.rank_*")) == [
        "DONE.rank_0",
        "DONE.rank_1",
    ]
    assert max(losses(paths.root)) == step
