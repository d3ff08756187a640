"""Per-env algorithms through the real orchestrator (prime-rl's configs/debug/algo/mixed_grpo_opd.toml
shape): a grpo env and an opd env in one run, one step against a real inference server that is also
the opd env's teacher (same weights). The opd env's samples carry their per-token reverse-KL signal as
advantages (about 0 here: the teacher is the sampler), the grpo env's one group-relative advantage per
sample; no teacher_logprobs ride on the batch (the trainer runs the rl loss)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import InferenceServer
from tests.integration.test_orchestrator import run_one_step


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("per_env_server"))
    yield srv
    srv.stop()


@pytest.mark.timeout(240)
def test_grpo_and_opd_envs_in_one_batch(tiny_model_dir: Path, run_dir: Path, server: InferenceServer) -> None:
    envs = (
        '[{id = "reverse-text", name = "rt-grpo", args = { num_examples = 50 }}, '
        '{id = "reverse-text", name = "rt-opd", args = { num_examples = 50 }, '
        f'algo = {{ type = "opd", teacher = {{ base_url = "{server.base_url}" }} }} }}]'
    )
    batch = run_one_step(tiny_model_dir, run_dir, server, "--orchestrator.train.env", envs)
    log = (run_dir / "orchestrator.out").read_text()
    assert "env rt-opd: algorithm opd" in log
    assert batch.teacher_logprobs is None and set(batch.env_names) == {"rt-grpo", "rt-opd"}
    offsets = batch.sample_offsets()
    for i, env in enumerate(batch.env_names):
        a, b = offsets[i], offsets[i + 1]
        m = batch.loss_mask[a:b]
        adv = batch.advantages[a:b][m]
        assert m.any()
        if env == "rt-opd":  # (teacher - sampler) logprob per token, x N / N_kl: ~0 (same weights)
            assert np.abs(adv).max() < 0.05, adv
        else:  # one group-relative advantage per sample, x N / N_rl
            assert np.allclose(adv, adv[0])
