"""[orchestrator.algo] type = "echo" end to end (prime-rl's configs/debug/algo/echo.toml at tiny size):
`hpcrl run` on the multi-turn alphabet-sort env (tests.integration.feedback_env: feedback after every
reply, a truncated one too), whose feedback arrives as user messages, training the user role. The
trainer adds the cross entropy on those tokens beside the rl loss, and logs it (~20 s on 2 CPUs). With
trajectory_strategy = "branching" (one sample per turn) the second turn's sample carries the feedback
it follows, as prime-rl's branches do (issue 50: it weighed nothing there before)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.test_reliability import _env, _hpcrl

CONFIG = (
    rl_toml(
        2,
        seq_len=256,
        batch_size=4,
        rollouts_per_example=2,
        max_tokens=6,
        top="seed = 1\n",
        tables="args = { min_turns = 2, max_turns = 2 }\n",
    ).replace('id = "reverse-text"', 'id = "tests.integration.feedback_env"')
    + '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.user]\nalpha = 0.1\n'
)


def _ce_rows(tmp_path: Path, strategy: str) -> list[dict]:
    """The trainer's ce rows of one tiny echo run."""
    cfg = tmp_path / f"{strategy}.toml"
    cfg.write_text(
        CONFIG.replace("[orchestrator]\n", f'[orchestrator]\ntrajectory_strategy = "{strategy}"\n', 1)
    )
    out = tmp_path / strategy
    proc = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [m for m in read_metrics(RunPaths(out).metrics_file) if "loss/ce" in m]
    assert sorted(m["step"] for m in rows) == [1, 2], (strategy, rows)
    for m in rows:
        # every rollout has one later user turn (2 turns): its body tokens, each at alpha 0.1
        assert m["ce_tokens"] >= 8 and m["loss/ce_nll"] > 0, (strategy, m)
        assert m["loss/ce"] == pytest.approx(0.1 * m["loss/ce_nll"], rel=1e-4), (strategy, m)
        # a random model's equal rewards leave no rl signal: the ce term alone moves the weights
        # (zero_advantage = "drop" keeps such echo groups for it, as prime-rl does)
        assert m["optim/grad_norm"] > 0, (strategy, m)
    return sorted(rows, key=lambda m: m["step"])


@pytest.mark.timeout(600)
def test_echo_run_trains_the_feedback_tokens(tmp_path: Path) -> None:
    stitched = _ce_rows(tmp_path, "interleaved")
    branched = _ce_rows(tmp_path, "branching")
    # the same seeded rollouts: the second turn's sample weighs the feedback it follows, once, so the
    # step's ce tokens (the normaliser, counted over the whole step) are the stitched run's
    assert [m["ce_tokens"] for m in branched] == [m["ce_tokens"] for m in stitched]
