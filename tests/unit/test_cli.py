"""The `hpcrl` command surface: help text, flags the docs promise, and help staying light (no torch)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy")


def test_top_level_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n  {name} " in out
    assert main([]) == 0 and "usage: hpcrl" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("hpcrl ")


def test_run_help_shows_the_documented_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--output-dir",
        "--max-steps",
        "--clean-output-dir",
        "--dry-run",
        "--ckpt | --no-ckpt",
        "--ckpt.interval",
        "--ckpt.keep-last",
        "--ckpt.keep-interval",
        "--ckpt.resume-step",
        "--ckpt.weights-only",
        "--wandb | --no-wandb",
        "--wandb.project",
        "--wandb.name",
        "--model.name",
        "--server.port",
        "--orchestrator.batch-size",
        "--trainer.optim.lr",
        "--seq-len",
    ):
        assert f"  {flag} " in out, flag
    # each field's docstring is its help text, with its default
    assert "--orchestrator.rollouts-per-example int  Completions per task" in out
    assert "(default: 8)" in out


def test_sft_help_uses_the_sft_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--data.name", "--data.batch-size", "--loss-mask.assistant", "--val.interval", "--dry-run"):
        assert f"  {flag} " in out, flag
    assert "--orchestrator" not in out


@pytest.mark.parametrize(
    "command", ["run", "submit", "resume", "inference", "trainer", "orchestrator", "sft"]
)
def test_config_commands_have_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "-h"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: hpcrl {command} ")


def test_help_does_not_import_heavy_modules() -> None:
    """One interpreter asks every command for --help and reports the first that pulled in torch & co."""
    probe = f"""
import contextlib, io, json, sys
from hpcrl.cli import COMMANDS, main
report = {{}}
for name in [None, *COMMANDS]:
    argv = ([name] if name else []) + ["--help"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
        except ModuleNotFoundError as e:  # a command whose module is not written yet
            if not (e.name or "").startswith("hpcrl."):
                raise
            report[name or "-"] = "missing " + e.name
            continue
    heavy = [m for m in {HEAVY!r} if m in sys.modules]
    report[name or "-"] = heavy
    if heavy:
        break
print(json.dumps(report))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    offenders = {k: v for k, v in report.items() if isinstance(v, list) and v}
    assert not offenders, f"--help imported heavy modules: {offenders}"
    assert "-" in report and "run" in report and "sft" in report


def test_bench_script_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_cli", REPO / "scripts" / "bench" / "cli.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--runs", "1", "--commands", "-", "run", "--target", "30"]) == 0
    out = capsys.readouterr().out
    assert "hpcrl --help" in out and "hpcrl run --help" in out
    assert out.strip().endswith("2/2 within target")
