"""metrics.jsonl: the record schema, NaN -> null, torn lines, extras, the follower and the console."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hpcrl.config.schema import LogExtrasConfig
from hpcrl.launch.console import ConsoleReporter, Eta, fmt_duration
from hpcrl.monitor.metrics import Metrics, MetricsFollower, histogram, read_metrics
from hpcrl.monitor.wandb_sink import is_writer, run_id, sample_table, scalar_payload, wandb_key
from hpcrl.paths import RunPaths


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_record_schema_and_nan_becomes_null(run_dir: Path) -> None:
    np = pytest.importorskip("numpy")
    paths = RunPaths(run_dir)
    m = Metrics(paths, "trainer")
    m.log(3, {"loss/mean": np.float32(0.5), "bad": float("nan"), "inf": float("inf"), "n": 7, "flag": True})
    m.close()
    (rec,) = _lines(paths.metrics_file)
    assert rec["role"] == "trainer" and rec["step"] == 3 and isinstance(rec["step"], int)
    assert abs(rec["time"] - __import__("time").time()) < 60
    assert rec["loss/mean"] == 0.5 and rec["bad"] is None and rec["inf"] is None and rec["n"] == 7
    for k, v in rec.items():
        if k != "role":
            assert v is None or isinstance(v, (int, float)), k


def test_disabled_rank_writes_nothing(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    m = Metrics(paths, "trainer", enabled=False, extras=LogExtrasConfig(interval=1))
    assert m.log(1, {"x": float("nan")}) == {"x": None}
    assert m.log_samples(1, [{"prompt": "p"}]) is None and m.log_distribution(1, "r", [1.0]) is None
    m.close()
    assert not paths.metrics_file.exists()


def test_torn_last_line_and_garbage_are_tolerated(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    m = Metrics(paths, "orchestrator")
    m.log(1, {"reward/all/mean": 0.1})
    m.log(2, {"reward/all/mean": 0.2})
    m.close()
    with open(paths.metrics_file, "ab") as f:
        f.write(b'\xff\xfe not json\n{"role": "trainer", "step": 3, "loss/me')  # corrupt line + torn tail
    assert [r["step"] for r in read_metrics(paths.metrics_file)] == [1, 2]
    assert read_metrics(run_dir / "missing.jsonl") == []


def test_concurrent_roles_never_interleave(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    a, b = Metrics(paths, "trainer"), Metrics(paths, "orchestrator")
    big = {f"k{i}": float(i) for i in range(300)}
    for s in range(50):
        a.log(s, big)
        b.log(s, big)
    a.close()
    b.close()
    recs = read_metrics(paths.metrics_file)
    assert len(recs) == 100 and all(len(r) == 303 for r in recs)


def test_follower_reads_only_complete_lines(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    fol = MetricsFollower(f)
    assert fol.poll() == []
    f.write_bytes(b'{"step": 1}\n{"step": 2')
    assert fol.poll() == [{"step": 1}]
    with open(f, "ab") as fh:
        fh.write(b"}\n")
    assert fol.poll() == [{"step": 2}] and fol.poll() == []
    f.write_bytes(b'{"step": 9}\n')  # replaced by a shorter file: start over
    assert fol.poll() == [{"step": 9}]


def test_extras_follow_interval_and_ratio(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    m = Metrics(paths, "orchestrator", extras=LogExtrasConfig(interval=5, sample_ratio=0.25))
    rows = [
        {"prompt": f"p{i}", "completion": "c", "reward": float(i), "advantage": math.nan} for i in range(8)
    ]
    assert (
        not m.samples_due(4)
        and m.log_samples(4, rows) is None
        and m.log_distribution(4, "reward", [1]) is None
    )
    assert m.samples_due(5) and m.distributions_due(5)
    path = m.log_samples(5, rows)
    h = m.log_distribution(5, "reward", [0.0, 1.0, 1.0, float("nan")])
    assert m.log_distribution(5, "empty", [float("nan")]) is None
    m.close()
    assert path == paths.samples_file(5, "orchestrator")
    kept = _lines(path)
    assert len(kept) == 2 and all(r["advantage"] is None for r in kept)
    assert (
        h is not None
        and h["count"] == 3
        and sum(h["counts"]) == 3
        and len(h["edges"]) == len(h["counts"]) + 1
    )
    assert read_metrics(paths.metrics_file) == []  # scalar readers never see extras
    extras = read_metrics(paths.metrics_file, extras=True)
    assert [r["extra"] for r in extras] == ["samples", "distribution"]
    assert extras[0]["file"] == "samples/step_5/orchestrator.jsonl" and extras[0]["rows"] == 2
    assert not list(path.parent.glob("*.tmp-*"))


def test_extras_off_without_wandb(run_dir: Path) -> None:
    from hpcrl.config.schema import Config, WandbConfig

    paths = RunPaths(run_dir)
    assert not Metrics.for_run(Config(), paths, "trainer", enabled=False).samples_due(10)
    assert Metrics.for_run(Config(wandb=WandbConfig()), paths, "trainer", enabled=False).extras is not None


def test_a_roles_log_extras_override_the_global_ones_field_by_field(run_dir: Path, tmp_path: Path) -> None:
    """prime-rl's per-process knobs: `--no-trainer.wandb.log-extras.distributions` turns off the
    trainer's distributions only; `--orchestrator.wandb.log-extras.interval` changes its cadence only;
    unset fields come from [wandb.log_extras]."""
    from hpcrl.launch.checks import load
    from tests.conftest import rl_toml

    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(rl_toml())
    cfg = load(
        [
            str(cfg_file),
            "--wandb",
            "--wandb.log-extras.interval",
            "7",
            "--wandb.log-extras.sample-ratio",
            "0.5",
        ]
        + ["--no-trainer.wandb.log-extras.distributions", "--orchestrator.wandb.log-extras.interval", "50"]
    ).config
    paths = RunPaths(run_dir)
    trainer = Metrics.for_run(cfg, paths, "trainer", enabled=True)
    orch = Metrics.for_run(cfg, paths, "orchestrator", enabled=True)
    assert (trainer.extras.interval, trainer.extras.sample_ratio, trainer.extras.distributions) == (
        7,
        0.5,
        False,
    )
    assert not trainer.distributions_due(7) and trainer.samples_due(7)
    assert (orch.extras.interval, orch.extras.sample_ratio, orch.extras.distributions) == (50, 0.5, True)
    assert orch.distributions_due(50) and not orch.distributions_due(7)
    for m in (trainer, orch):
        m.close()


def test_histogram_of_arrays() -> None:
    np = pytest.importorskip("numpy")
    h = histogram(np.arange(1000, dtype=np.float32))
    assert h["count"] == 1000 and h["min"] == 0 and h["max"] == 999 and len(h["counts"]) == 64


def test_wandb_keys_keep_names_and_separate_roles() -> None:
    assert wandb_key("orchestrator", "reward/all/mean") == "reward/all/mean"
    assert wandb_key("trainer", "loss_tokens") == "trainer/loss_tokens"
    assert wandb_key("trainer", "progress/total_samples") == "progress/trainer/total_samples"
    assert wandb_key("trainer", "progress/epoch", multi_role=False) == "progress/epoch"
    rec = {"role": "trainer", "step": 2, "time": 1.0, "loss/mean": 0.5, "x": None, "s": "txt", "b": True}
    assert scalar_payload(rec) == {"loss/mean": 0.5, "trainer/b": 1}


def test_sample_table_columns() -> None:
    cols, data = sample_table([{"reward": 1.0, "prompt": "p", "zeta": 3}, {"completion": "c"}], step=7)
    assert cols == ["step", "prompt", "completion", "reward", "zeta"]
    assert data == [[7, "p", None, 1.0, 3], [7, None, "c", None, None]]


def test_run_id_is_fixed_in_the_run_dir(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    rid = run_id(paths, "my run/1")
    assert rid.startswith("my-run-1-") and run_id(paths, "other") == rid
    assert paths.wandb_run_id_file.read_text().strip() == rid


def test_writer_designation(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.config.schema import Config, SFTConfig

    monkeypatch.delenv("HPCRL_WANDB_WRITER", raising=False)
    assert is_writer(Config(), "orchestrator") and not is_writer(Config(), "trainer")
    assert is_writer(SFTConfig(), "trainer")
    monkeypatch.setenv("HPCRL_WANDB_WRITER", "trainer")
    assert is_writer(Config(), "trainer") and not is_writer(Config(), "orchestrator")


# -- console ------------------------------------------------------------------------------------
def test_eta_uses_this_sessions_pace() -> None:
    e = Eta(max_steps=20)
    assert e.text() == "eta -"
    e.update(10, now=100.0)
    e.update(12, now=104.0)  # 2 s/step, 8 steps left
    assert e.seconds_left() == pytest.approx(16.0) and e.text() == "eta 16s"
    assert fmt_duration(3725) == "1h02m" and fmt_duration(75) == "1m15s"


def test_console_plain_lines_with_eta(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = RunPaths(run_dir)
    console = ConsoleReporter(paths, max_steps=3, bar=False)
    orch, tr = Metrics(paths, "orchestrator"), Metrics(paths, "trainer")
    for s in (1, 2):
        orch.log(s, {"reward/all/mean": 0.25 * s, "off_policy/mean": 1.0})
        orch.log_distribution(s, "reward", [1.0])  # no extras config: nothing written
        tr.log(s, {"loss/mean": 0.5, "perf/throughput": 1234.0, "time/step": 0.5})
    orch.log(2, {"eval/rev/avg@4": 0.75})
    console.update()
    console.finish()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step    1/3 | reward 0.250 | loss 0.5000 | 1,234 tok/s | lag 1.0 | 0.50s | eta")
    assert out[1].startswith("step    2/3 | reward 0.500")
    assert out[2] == "eval @ step 2: eval/rev/avg@4=0.750"
    assert out[3].startswith("elapsed ")


def test_console_progress_bar(run_dir: Path) -> None:
    import io

    from rich.console import Console

    paths = RunPaths(run_dir)
    console = ConsoleReporter(paths, max_steps=4, bar=True)
    from hpcrl.launch.console import _Bar

    buf = io.StringIO()
    console.bar = _Bar(4, Console(file=buf, force_terminal=True, width=120))
    tr = Metrics(paths, "trainer")
    for s in (1, 2):
        tr.log(s, {"loss/mean": 0.5})
    console.update()
    assert console.bar.progress.tasks[0].completed == 2
    console.finish()
    text = buf.getvalue()
    assert "step    2/4 | reward -" in text and "training" in text  # the line, then the bar


def test_a_trainer_side_wandb_sink_waits_for_the_orchestrators_finish(tmp_path) -> None:
    """With HPCRL_WANDB_WRITER=trainer the sink must not stop at the orchestrator's last training
    record: its final eval (same step) comes after it, then its `finished` record."""
    from types import SimpleNamespace

    from hpcrl.monitor.metrics import EXTRA_KEY
    from hpcrl.monitor.wandb_sink import WandbSink
    from hpcrl.paths import RunPaths

    sink = WandbSink(SimpleNamespace(offline=True), RunPaths(tmp_path), "run", role="trainer")
    sink.run = SimpleNamespace(log=lambda payload: None)
    sink._log({"role": "trainer", "step": 3, "loss/mean": 1.0})
    sink._log({"role": "orchestrator", "step": 3, "reward/all/mean": 0.5})
    assert not sink._done(3)  # the orchestrator's eval of step 3 may still come
    sink._log({"role": "orchestrator", "step": 3, EXTRA_KEY: "finished"})
    assert sink._done(3)
    own = WandbSink(SimpleNamespace(offline=True), RunPaths(tmp_path), "run", role="orchestrator")
    own.run = sink.run
    own._log({"role": "trainer", "step": 3, "loss/mean": 1.0})
    own._log({"role": "orchestrator", "step": 3, "reward/all/mean": 0.5})
    assert own._done(3)  # in the orchestrator, close() comes after its own eval
