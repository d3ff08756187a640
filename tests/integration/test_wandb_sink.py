"""The W&B sink, offline and with no network: trainer and orchestrator processes write metrics.jsonl,
one sink logs both into ONE W&B run, and we read that run's transaction log back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from hpcrl.config.schema import Config, LogExtrasConfig, WandbConfig  # noqa: E402
from hpcrl.monitor.metrics import Metrics  # noqa: E402
from hpcrl.monitor.wandb_offline import read_offline_run, read_offline_runs  # noqa: E402
from hpcrl.monitor.wandb_sink import start_wandb_sink  # noqa: E402
from hpcrl.paths import RunPaths  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# One writer process per role, as in a real run; the orchestrator is ahead of the trainer.
WRITER = """
import sys, time
from hpcrl.config.schema import Config, LogExtrasConfig, WandbConfig
from hpcrl.monitor.metrics import Metrics
from hpcrl.paths import RunPaths
role, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = Config(wandb=WandbConfig(offline=True, log_extras=LogExtrasConfig(interval=2, sample_ratio=0.5)))
m = Metrics.for_run(cfg, RunPaths(sys.argv[4]), role)
for s in range(first, last + 1):
    if role == "orchestrator":
        m.log(s, {"reward/all/mean": 0.1 * s, "off_policy/mean": float("nan") if s == 1 else 1.0,
                  "progress/total_samples": 8 * s})
        m.log_samples(s, [{"prompt": f"p{i}", "completion": f"c{i}", "reward": float(i), "advantage": i - 1.5,
                           "env": "rev"} for i in range(4)])
        m.log_distribution(s, "reward", [0.0, 1.0, 2.0, 3.0])
        m.log_distribution(s, "advantage", [-1.5, -0.5, 0.5, 1.5])
    else:
        time.sleep(0.05)
        m.log(s, {"loss/mean": 1.0 / s, "entropy/mean": 2.0, "progress/total_samples": 8 * s, "loss_tokens": 5})
        m.log_distribution(s, "entropy", [0.5, 0.7, 0.9])
m.close()
"""


@pytest.fixture
def offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no user W&B settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("HPCRL_WANDB_WRITER", raising=False)
    return wandb_dir


def _cfg(run_dir: Path, offline: bool = True) -> Config:
    return Config(
        output_dir=str(run_dir),
        name="demo-run",
        max_steps=4,
        wandb=WandbConfig(
            project="hpcrl-test", offline=offline, log_extras=LogExtrasConfig(interval=2, sample_ratio=0.5)
        ),
    )


def _write(run_dir: Path, first: int, last: int) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, role, str(first), str(last), str(run_dir)], cwd=ROOT)
        for role in ("orchestrator", "trainer")
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]


def _scalars(history: list[dict], key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in history if key in h}


def test_one_offline_run_holds_both_roles_and_resumes(run_dir: Path, offline_env: Path) -> None:
    paths = RunPaths(run_dir)
    cfg = _cfg(run_dir)
    assert start_wandb_sink(cfg, paths, role="trainer").run is None  # not the designated writer
    sink = start_wandb_sink(cfg, paths, role="orchestrator", poll_s=0.2)
    _write(run_dir, 1, 2)
    sink.close(wait_for_step=2, timeout=30)
    assert sink.error is None

    run = read_offline_run(offline_env)
    rid = paths.wandb_run_id_file.read_text().strip()
    assert run.exited, "close() returned before the W&B run was complete"
    assert run.run_id == rid and rid.startswith("demo-run-") and run.project == "hpcrl-test"
    assert {"name": "", "glob": "*", "step_metric": "step"} in run.metrics
    h = run.history
    assert _scalars(h, "reward/all/mean") == pytest.approx({1: 0.1, 2: 0.2})
    assert _scalars(h, "loss/mean") == {1: 1.0, 2: 0.5}
    assert _scalars(h, "off_policy/mean") == {2: 1.0}  # NaN -> null -> not logged
    assert _scalars(h, "progress/trainer/total_samples") == {1: 8, 2: 16}
    assert _scalars(h, "progress/orchestrator/total_samples") == {1: 8, 2: 16}
    assert _scalars(h, "trainer/loss_tokens") == {1: 5, 2: 5}
    tables = [x for x in h if x.get("samples/orchestrator/_type") == "table-file"]
    assert [t["step"] for t in tables] == [2] and tables[0]["samples/orchestrator/nrows"] == 2
    table_file = next(offline_env.rglob(tables[0]["samples/orchestrator/path"].split("/")[-1]))
    assert '"prompt"' in table_file.read_text() and '"advantage"' in table_file.read_text()
    for name in ("reward", "advantage", "entropy"):
        hist = [x for x in h if x.get(f"distributions/{name}/_type") == "histogram"]
        assert [x["step"] for x in hist] == [2] and sum(hist[0][f"distributions/{name}/values"]) in (3, 4)

    # Resume: the same W&B run continues with only the new records.
    sink = start_wandb_sink(cfg, paths, role="orchestrator", poll_s=0.2)
    _write(run_dir, 3, 4)
    sink.close(wait_for_step=4, timeout=30)
    assert sink.error is None
    first, second = read_offline_runs(offline_env)
    assert second.run_id == rid and second.exited and first.history
    assert _scalars(second.history, "loss/mean") == {3: 1 / 3, 4: 0.25}
    assert _scalars(second.history, "reward/all/mean") == pytest.approx({3: 0.3, 4: 0.4})


def test_online_without_credentials_falls_back_to_offline(
    run_dir: Path, offline_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE")
    paths = RunPaths(run_dir)
    sink = start_wandb_sink(_cfg(run_dir, offline=False), paths, poll_s=0.2)
    m = Metrics(paths, "orchestrator")
    m.log(1, {"reward/all/mean": 0.5})
    m.close()
    sink.close(wait_for_step=1, timeout=30)
    assert sink.error is None and sink.mode == "offline" and sink.logged == 1
    assert _scalars(read_offline_run(offline_env).history, "reward/all/mean") == {1: 0.5}


def test_no_wandb_config_is_a_no_op(run_dir: Path) -> None:
    handle = start_wandb_sink(Config(output_dir=str(run_dir)), RunPaths(run_dir))
    handle.close(wait_for_step=3)
    assert handle.run is None and not RunPaths(run_dir).wandb_dir.exists()
