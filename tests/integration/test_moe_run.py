"""A tiny Qwen3-MoE RL run with expert parallelism (ep = 2 over 2 gloo trainer ranks, impl custom,
router replay on) reaches max_steps with reward rising, survives a kill -9 of every process, and
`hpcrl resume --step -1` finishes it on ONE trainer rank (ep = 1): the ep=2 checkpoint reshards.

The environment (tests.integration.short_env) rewards the share of spaces / 'e' in the answer, which
a randomly initialised tiny model learns within a few steps."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.test_reliability import _env, _hpcrl, _role_pids, kill_and_reap

MAX_STEPS = 16
CONFIG = rl_toml(
    MAX_STEPS,
    seq_len=64,
    model="hpcrl/tiny-qwen3-moe",
    max_tokens=8,
    top="seed = 3\n",
    tables=(
        '[trainer.model]\nname = "hpcrl/tiny-qwen3-moe"\nimpl = "custom"\nep = 2\n'
        "[trainer.optim]\nlr = 1e-2\n[ckpt]\ninterval = 2\n[deployment]\nnum_trainer_ranks = 2\n"
    ),
).replace('id = "reverse-text"', 'id = "tests.integration.short_env"')


def _rewards(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/all/mean"] for r in rows if "reward/all/mean" in r and "step" in r}


@pytest.mark.slow
def test_ep2_moe_run_learns_and_resumes_on_one_rank_after_kill9(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "run"
    paths = RunPaths(out)
    proc = subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # kill -9 every process of the run once a checkpoint at step >= 6 exists (mid-run)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        latest = checkpoint.latest_complete(paths)
        if latest is not None and latest >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0][-4000:]
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "router replay on, ep 2" in trainer_log
    victims = [p for role in ("trainer", "orchestrator", "inference") for p in _role_pids(out, role)]
    kill_and_reap([proc.pid, *victims], proc, out, "processes outlived the kill")
    killed_at = checkpoint.latest_complete(paths)
    assert killed_at is not None and killed_at < MAX_STEPS

    resumed = subprocess.run(
        _hpcrl(
            "resume", "--step", "-1", "--output-dir", str(out),
            "--deployment.num-trainer-ranks", "1", "--trainer.model.ep", "1",
        ),
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert checkpoint.latest_complete(paths) == MAX_STEPS
    assert (paths.weights_dir(MAX_STEPS) / "model.safetensors").is_file()
    rewards = _rewards(out)
    assert MAX_STEPS in rewards, sorted(rewards)
    first = sum(rewards[s] for s in (1, 2, 3)) / 3
    last = sum(rewards[s] for s in range(MAX_STEPS - 2, MAX_STEPS + 1)) / 3
    assert last > first + 0.05, (first, last, rewards)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hit = [r["moe/replay_hit_rate"] for r in rows if "moe/replay_hit_rate" in r]
    assert hit and all(0 < h <= 1 for h in hit)  # replay was on before and after the resume
