"""What the seeds promise, shown on real processes: a demo RL run (hosted shape, `[eval]` with no
`[[eval.env]]`) logs every metric name tests/seed_names.toml marks rl-cpu, eval of the training env
included; seed 004's self-hosted example passes `hpcrl run --dry-run` and says how its GPUs were split.
The demo run also names its model by a Hub id that exists only in a local Hugging Face cache, with
HF_HUB_OFFLINE=1 (test_hub_run.py's training run, folded into this one: one run, not two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.models.hub import seed_cache
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.unit.test_seed_names import rl_cpu_metric_names

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "tiny-org/tiny-qwen3"
HOSTED_WITH_EVAL = """
model = "{model}"
max_steps = 2
seq_len = 64
batch_size = 8
rollouts_per_example = 4
[sampling]
max_tokens = 8
[[env]]
id = "reverse-text"
[eval]
interval = 2
num_examples = 4
rollouts_per_example = 2
eval_base_model = false
"""


def _hpcrl(*args: str, cwd: Path, timeout: float, hf_home: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOME": str(cwd)}
    if hf_home is not None:  # only the local cache, offline: no network, no user HF settings
        env = {k: v for k, v in env.items() if not k.startswith("HF_")}
        env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env |= {"WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    for var in ("WANDB_API_KEY", "WANDB_DIR"):
        env.pop(var, None)
    env["HPCRL_WANDB_WRITER"] = "trainer"  # documented: moves the W&B writer; it must not turn W&B off
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(the finished `hpcrl run`, its output dir, the cached snapshot its model id resolves to).

    One run checked by both tests below. The model is named by a Hub id seeded into a local HF cache
    and resolved offline; it is the same tiny model either way, and the metric names, W&B sink and
    log levels checked do not depend on where the weights were found."""
    tmp_path = tmp_path_factory.mktemp("seed_metrics")
    hf_home = tmp_path / "hf"
    snap = seed_cache(tiny_model_dir, HUB_ID, hf_home / "hub")
    cfg = tmp_path / "hosted.toml"
    cfg.write_text(HOSTED_WITH_EVAL.format(model=HUB_ID))
    out = tmp_path / "run"
    extras = (  # per-role log extras do what they say: trainer tables at half the rows, none from the orchestrator
        *("--wandb", "--wandb.offline", "--wandb.log-extras.interval", "1"),
        *("--trainer.wandb.log-extras.sample-ratio", "0.5", "--no-orchestrator.wandb.log-extras.samples"),
        *("--orchestrator.log.vf-level", "warning"),  # env servers and workers log at it (seed: info)
        *("--log.plots", "false"),  # a run-only [log] field: [orchestrator.log] is merged without it
    )
    proc = _hpcrl(
        "run", str(cfg), "--output-dir", str(out), *extras, cwd=tmp_path, timeout=280, hf_home=hf_home
    )
    return proc, out, snap


@pytest.mark.timeout(300)
def test_demo_rl_run_logs_every_seed_metric_name(demo_run) -> None:
    proc, out, _ = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[eval] has no [[eval.env]]: evaluating the training env(s) reverse-text" in proc.stdout
    records = read_metrics(RunPaths(out).metrics_file)
    logged: dict[str, set[str]] = {}
    for r in records:
        logged.setdefault(r["role"], set()).update(r)
    for role, names in rl_cpu_metric_names("reverse-text", 2).items():
        missing = sorted(names - logged.get(role, set()))
        assert not missing, f"{role} never logged {missing}"
    trainer = [r for r in records if r["role"] == "trainer"]
    assert all(r["policy/kl"] == r["mismatch_kl/all/mean"] == r["mismatch_kl/mean"] for r in trainer)
    assert all(r["mismatch_kl/all/max"] >= r["mismatch_kl/all/mean"] >= 0 for r in trainer)
    assert all(r["entropy/reverse-text/mean"] == r["entropy/all/mean"] for r in trainer)  # one env
    orch = [r for r in records if r["role"] == "orchestrator" and "reward/all/mean" in r]
    assert orch and all(r["time/wait_for_ckpt"] == r["time/wait_for_policy"] for r in orch)
    assert "perf/mfu" not in set().union(*map(set, trainer))  # CPU, no configured peak
    paths = RunPaths(out)
    for step in (1, 2):  # 8 rollouts on the one rank, sample_ratio 0.5: 4 rows
        rows = paths.samples_file(step, "trainer").read_text().splitlines()
        assert len(rows) == 4, rows
        assert not paths.samples_file(step, "orchestrator").exists()
    row = json.loads(rows[0])
    assert row["env"] == "reverse-text" and row["completion"] and {"reward", "advantage"} <= set(row)
    env_logs = out / "logs" / "envs" / "train" / "reverse-text"
    for name in ("server.log", "worker_0.log"):  # their INFO start-up lines are below warning
        assert " INFO " not in (env_logs / name).read_text(), name
    from hpcrl.monitor.wandb_offline import read_offline_run

    run = read_offline_run(out / "wandb")  # written by the trainer's sink: both roles' records
    assert run.exited
    logged = {k for h in run.history for k in h}
    assert {"loss/mean", "reward/all/mean", "policy/kl", "eval/reverse-text/avg@2"} <= logged, sorted(logged)


@pytest.mark.timeout(300)
def test_demo_runs_two_steps_from_a_hub_id_in_the_cache(demo_run) -> None:
    proc, out, snap = demo_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step    2/2" in proc.stdout and "hpcrl: run finished" in proc.stdout
    # The trainer really loaded the cached snapshot (not a built-in tiny model).
    assert f"model {snap}" in (out / "logs" / "trainer.log").read_text()


def test_seed004_self_hosted_example_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _hpcrl(
        "run",
        str(REPO / "configs/self_hosted/seed004.toml"),
        "--dry-run",
        "--output-dir",
        str(out),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run OK" in proc.stdout
    assert (
        "num_gpus = 8 split: 4 trainer GPU(s), 4 inference GPU(s) (1 server(s) x tensor_parallel_size 4)"
        in proc.stdout
    )
    resolved = (out / "configs" / "resolved.toml").read_text()
    assert "num_train_gpus = 4" in resolved and "num_infer_gpus = 4" in resolved
