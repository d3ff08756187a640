"""`hpcrl sft ... --wandb --wandb.offline` (seed 001's launch line) leaves an offline W&B run holding the
SFT loss, even with HPCRL_WANDB_WRITER=trainer set for RL runs; the seed's SFT metric names
(tests/seed_names.toml, when = sft-cpu); data.batch_size in tokens (data.batch_unit = tokens)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from hpcrl.monitor.metrics import read_metrics  # noqa: E402
from hpcrl.monitor.wandb_offline import read_offline_run  # noqa: E402
from hpcrl.paths import RunPaths  # noqa: E402
from tests.integration.test_sft import run_sft, write_config  # noqa: E402
from tests.unit.test_seed_names import sft_cpu_metric_names  # noqa: E402


def test_sft_logs_its_loss_to_an_offline_wandb_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcrl.trainer.sft_data import make_demo

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no user W&B settings
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HPCRL_WANDB_WRITER", "trainer")
    data = tmp_path / "data"  # two subsets (files): their realized mixing ratios are logged
    make_demo(data / "a.jsonl", "reverse-text", n=30, seed=0)
    make_demo(data / "b.jsonl", "reverse-text", n=10, seed=1)
    cfg = write_config(tmp_path / "sft.toml", tiny_model_dir, data, tmp_path / "run")
    run = tmp_path / "run"
    run_sft(
        str(cfg),
        *("--max-steps", "2", "--no-ckpt", "--wandb", "--wandb.offline", "--wandb.project", "sft-t"),
        *("--data.batch-unit", "tokens", "--data.batch-size", "200"),  # seed 001: tokens per step
    )

    records = {r["step"]: r for r in read_metrics(RunPaths(run).metrics_file)}
    assert sorted(records) == [1, 2]
    # rows are taken until their tokens reach 200: at most one row (<= seq_len 64 tokens) more
    assert 200 <= records[1]["progress/num_tokens"] < 264
    assert 400 <= records[2]["progress/num_tokens"] < 528
    last = records[2]
    for name in sft_cpu_metric_names("a") | sft_cpu_metric_names("b"):
        assert name in last, name
    for r in records.values():
        for kind in ("samples", "tokens"):
            a, b = r[f"progress/a/ratio_{kind}"], r[f"progress/b/ratio_{kind}"]
            assert 0 <= a <= 1 and a + b == pytest.approx(1.0)
    assert 0.0 <= last["optim/zero_grad_ratio"] < 1.0
    # one rank on CPU: per GPU (rank) = overall; no peak FLOP/s known on CPU, so no MFU
    assert last["perf/throughput_per_gpu"] == pytest.approx(last["perf/throughput"])
    assert "perf/mfu" not in last

    wandb_run = read_offline_run(run / "wandb")
    assert wandb_run.project == "sft-t" and wandb_run.exited
    logged = {h["step"]: h["loss/mean"] for h in wandb_run.history if "loss/mean" in h}
    assert sorted(logged) == [1, 2]
    assert all(math.isclose(logged[s], records[s]["loss/mean"], rel_tol=1e-6) for s in (1, 2))
