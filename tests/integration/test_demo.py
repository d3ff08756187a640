"""scripts/demo.sh end to end, shortened: the same pipeline (SFT data -> `hpcrl sft` -> `hpcrl run` from
the SFT weights with eval before/after -> plots -> summary) with a few steps of each, so CI checks that
the demo completes and prints its summary. Whether it *learns* takes the full ~3 min run; the measured
numbers are in docs/demo.md."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import read_metrics
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, timeout: float = 600, **knobs: str) -> subprocess.CompletedProcess[str]:
    """scripts/demo.sh with its outputs under `tmp_path` and the DEMO_* `knobs` (e.g. DEMO_RL_STEPS)."""
    env = child_env(DEMO_OUT=str(tmp_path), **knobs)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_demo_script_shortened(tmp_path: Path) -> None:
    proc = run_demo(
        tmp_path,
        DEMO_SFT_STEPS="4",
        DEMO_RL_STEPS="3",
        DEMO_RL_ARGS="--orchestrator.batch-size 32 --orchestrator.eval.num-examples 8",
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]

    assert (tmp_path / "demo-sft-data" / "train.jsonl").is_file()
    assert (tmp_path / "demo-sft" / "weights" / "step_4" / "config.json").is_file()
    assert f"from {tmp_path}/demo-sft/weights/step_4 -> {tmp_path}/demo-rl" in out
    # eval of policy 0 (the SFT policy) and of the final policy
    recs = read_metrics(tmp_path / "demo-rl" / "metrics.jsonl")
    evals = sorted(r["step"] for r in recs if "eval/reverse-text-demo/avg@2" in r)
    assert evals == [0, 3]
    assert (tmp_path / "demo-rl" / "plots" / "reward.png").is_file()

    summary = out[out.index("== summary ==") :]
    assert "SFT loss (mean of 1 steps):" in summary
    assert "eval reverse-text-demo/avg@2: " in summary and "(policy 0) -> " in summary
    assert "train reward/all/mean (mean of 1 steps): first " in summary and "over 3 RL steps" in summary
    assert "wall time: " in summary
    assert f"plots: {tmp_path}/demo-rl/plots/ (" in summary and "reward.png" in summary
