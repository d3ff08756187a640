"""`hpcrl eval` and `hpcrl gepa run` as real commands: each starts its own `hpcrl inference` server
(tiny model, CPU) and runs the verifiers environment fixture through the training rollout code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vf_classic import classic_verifiers

classic_verifiers()
pytest.importorskip("gepa")
pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
VF_ENV = "tests.integration.vf_env_fixture:load_environment"


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, env=env, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_writes_one_line_per_rollout_and_a_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    proc = hpcrl(
        "eval", VF_ENV, "-m", str(tiny_model_dir), "-n", "8", "-r", "3", "-t", "8", "--output-dir", str(out)
    )
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 24
    assert sorted((r["example_id"], r["rollout_index"]) for r in rows) == [
        (e, i) for e in range(8) for i in range(3)
    ]
    for r in rows:
        assert isinstance(r["reward"], float) and r["error"] is None
        assert r["prompt"][-1]["role"] == "user" and r["completion"][0]["role"] == "assistant"
        assert r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 and "reversed_exactly" in r["metrics"]
    summary = json.loads((out / "summary.json").read_text())["envs"]
    s = summary[VF_ENV]
    assert {"avg@3", "pass@3", "reward_std", "uniform_fraction"} <= set(s)
    assert s["avg@3"] == pytest.approx(sum(r["reward"] for r in rows) / 24)
    assert "avg@k" in proc.stdout and "pass@k" in proc.stdout
    assert not (out / "logs" / "inference.log").read_text().count("Traceback")


def test_gepa_writes_its_files_keeps_the_budget_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gepa"
    args = (
        "gepa",
        "run",
        VF_ENV,
        "-m",
        str(tiny_model_dir),
        "-n",
        "8",
        "-N",
        "6",
        "--minibatch-size",
        "3",
        "-t",
        "8",
        "--state-columns",
        "answer",
        "--output-dir",
        str(out),
    )
    hpcrl(*args, "-B", "30")
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["total_metric_calls"] <= 30 and meta["best_score"] >= meta["base_score"]
    assert meta["num_candidates"] >= 1 and meta["resumed"] is False
    assert meta["rollouts_this_invocation"] == meta["total_metric_calls"]  # no rollout escapes the count
    best = (out / "best_prompt.txt").read_text()
    assert best == (out / "system_prompt.txt").read_text() and best.strip() == meta["best_prompt"].strip()
    frontier = read_jsonl(out / "pareto_frontier.jsonl")
    assert len(frontier) == 6 and all(
        f["candidates"] and len(f["prompts"]) == len(f["candidates"]) for f in frontier
    )
    results = read_jsonl(out / "results.jsonl")
    assert len(results) == 6
    assert {r["prompt"][0]["content"] for r in results} == {best.strip()}  # the best candidate's rollouts
    # the env ran in its own env server, as in training and `hpcrl eval` (docs/envs.md)
    served = out / "logs" / "envs" / "eval" / VF_ENV
    status = json.loads((served / "components.json").read_text())
    assert status["env"] == VF_ENV and status["workers"] and (served / "worker_0.log").exists()

    # A second invocation with a larger budget continues the same search.
    hpcrl(*args, "-B", "42")
    again = json.loads((out / "metadata.json").read_text())
    assert again["resumed"] is True and again["base_score"] == meta["base_score"]
    assert meta["total_metric_calls"] < again["total_metric_calls"] <= 42
    assert again["rollouts_this_invocation"] == again["total_metric_calls"] - meta["total_metric_calls"]
    assert again["candidates"][: meta["num_candidates"]] == meta["candidates"]

    # The optimised prompt plugs into eval (and training) through system_prompt_file.
    ev = tmp_path / "eval_best"
    hpcrl(
        "eval",
        VF_ENV,
        "-m",
        str(tiny_model_dir),
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "4",
        "-a",
        json.dumps({"system_prompt_file": str(out / "best_prompt.txt")}),
        "--output-dir",
        str(ev),
    )
    assert {r["prompt"][0]["content"] for r in read_jsonl(ev / "results.jsonl")} == {best.strip()}
