"""[orchestrator.algo] end to end: short `hpcrl run`s of the tiny model that learn, with the reward
recorded in metrics.jsonl.

The environment (tests.integration.short_env) rewards the share of spaces / 'e' in the answer, which
a randomly initialised tiny model learns within a few steps, so no SFT warm-up is needed:

- max_rl from random init: the train reward rises; its final weights are kept;
- opd from random init, the teacher being another hpcrl inference server on loopback that serves
  the max_rl run's final weights: the student's reward rises towards the teacher's, from the
  teacher's per-token logprobs alone (opd assigns no reward-based credit).

The demo-task figures (reverse-text-demo after the SFT warm-up) are in docs/algorithms.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import InferenceServer, rl_toml
from tests.integration import test_orchestrator
from tests.integration.test_orchestrator import run_one_step
from tests.integration.test_reliability import _env, _hpcrl

STEPS = 16
CONFIG = rl_toml(
    STEPS,
    seq_len=64,
    max_tokens=8,
    top="seed = 3\n",
    tables="[trainer.optim]\nlr = 1e-2\n",
).replace('id = "reverse-text"', 'id = "tests.integration.short_env"')


def run(tmp_path: Path, name: str, *flags: str) -> Path:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / name
    proc = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out), *flags),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def rewards(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/all/mean"] for r in rows if "reward/all/mean" in r and "step" in r}


def first_last(out: Path) -> tuple[float, float]:
    r = rewards(out)
    assert sorted(r) == list(range(1, STEPS + 1)), sorted(r)
    return sum(r[s] for s in (1, 2, 3)) / 3, sum(r[s] for s in range(STEPS - 2, STEPS + 1)) / 3


@pytest.fixture(scope="module")
def max_rl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("max_rl")
    flags = (
        "--orchestrator.algo.type",
        "max_rl",
        "--ckpt.interval",
        str(STEPS),
        "--ckpt.weights-only",
        "true",
    )
    return run(tmp, "run", *flags)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_rl_learns(max_rl_run: Path) -> None:
    resolved = (max_rl_run / "configs" / "orchestrator.toml").read_text()
    assert '[orchestrator.algo]\ntype = "max_rl"' in resolved
    first, last = first_last(max_rl_run)
    assert last > first + 0.05, (first, last, rewards(max_rl_run))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_opd_learns_from_a_teacher_server(max_rl_run: Path, tmp_path: Path) -> None:
    teacher = InferenceServer(max_rl_run / "weights" / f"step_{STEPS}", tmp_path / "teacher")
    try:
        out = run(
            tmp_path,
            "opd",
            "--orchestrator.algo.type",
            "opd",
            "--orchestrator.algo.teacher.base-url",
            f"{teacher.base_url}/v1",
        )
    finally:
        teacher.stop()
    assert (
        f"algorithm opd: reverse KL to {teacher.base_url}/v1"
        in (out / "logs" / "orchestrator.log").read_text()
    )
    first, last = first_last(out)
    _, teacher_reward = first_last(max_rl_run)
    assert last > first + 0.05, (first, last, rewards(out))
    assert last > 0.5 * teacher_reward, (last, teacher_reward)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rae_learns_and_checkpoints_its_baselines(tmp_path: Path) -> None:
    out = run(tmp_path, "rae", "--orchestrator.algo.type", "rae", "--ckpt.interval", "8")
    first, last = first_last(out)
    assert last > first + 0.05, (first, last, rewards(out))
    # the per-agent baseline is part of the orchestrator's checkpoint (a resume continues it exactly)
    state = json.loads((out / "checkpoints" / "step_8" / "orchestrator" / "state.json").read_text())
    (agent, baseline), *more = state["algo"]["rae_baselines"].items()
    assert not more and agent == "tests.integration.short_env/0" and 0.0 < baseline < 1.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("algo_server"))
    yield srv
    srv.stop()


@pytest.mark.timeout(180)
def test_opsd_scores_each_sequence_under_the_demonstration(
    tiny_model_dir: Path, run_dir: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """opsd: the live policy (the same server) scores every sampled sequence with the task's answer
    prepended as a system message. Without it the scores would equal the sampler's (test_orchestrator's
    opd test, same weights); with it they differ, and stay log-probabilities."""
    # room for the demonstration message in front of a seq_len sequence (hpcrl.config.algo_checks)
    monkeypatch.setattr(
        test_orchestrator, "CONFIG", test_orchestrator.CONFIG + "[inference]\nmax_model_len = 512\n"
    )
    batch = run_one_step(
        tiny_model_dir,
        run_dir,
        server,
        "--orchestrator.algo.type",
        "opsd",
        "--orchestrator.algo.demo-key",
        "answer",
    )
    m = batch.loss_mask
    assert batch.teacher_logprobs is not None and m.any()
    ref, sampled = batch.teacher_logprobs[m], batch.inference_logprobs[m]
    assert np.all(np.isfinite(ref)) and np.all(ref <= 0)
    assert np.abs(ref - sampled).max() > 1e-2  # conditioned on the demonstration
    log = (run_dir / "orchestrator.out").read_text()
    assert "algorithm opsd: reverse KL to the policy shown the task demonstration" in log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_muon_learns(tmp_path: Path) -> None:
    """trainer.optim.type = muon (hpcrl.trainer.muon) from random init on the same task: the reward
    rises. The demo-task figures (after the SFT warm-up, against AdamW) are in docs/trainer.md."""
    out = run(tmp_path, "muon", "--trainer.optim.type", "muon")
    assert "optimizer: muon (Muon: " in (out / "logs" / "trainer.log").read_text()
    first, last = first_last(out)
    assert last > first + 0.05, (first, last, rewards(out))
