"""Single-turn groups go to the server as one request with n choices (against the real server):
one request per group, per-rollout token ids/logprobs/policy steps, seeded reproducibility, and a
rollout whose env fails before its turn does not hold up the others."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferenceServer

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("groups_server"))
    yield srv
    srv.stop()


def _groups(server: InferenceServer, model_dir: Path, env, n: int, seed: int | None):
    from transformers import AutoTokenizer

    from hpcrl.orchestrator.rollout import Generator, ServerPool

    tok = AutoTokenizer.from_pretrained(model_dir)
    tasks = list(env.tasks("train")[:3])

    async def go():
        pool = ServerPool([server.base_url], model=str(model_dir), timeout=60, max_concurrent=8)
        try:
            gen = Generator(pool, tok, 256, lambda: 0, seed=seed)
            return await gen.groups(env, tasks, n, {"max_tokens": 6, "temperature": 1.0}, "t", 1)
        finally:
            await pool.aclose()

    return asyncio.run(go())


def _requests(server: InferenceServer) -> int:
    return httpx.get(f"{server.base_url}/stats").json()["requests"]


def test_a_single_turn_group_is_one_request(server, tiny_model_dir: Path) -> None:
    from hpcrl.envs import load_environment
    from hpcrl.orchestrator.rollout import single_turn

    env = load_environment("reverse-text")
    assert single_turn(env)
    before = _requests(server)
    groups = _groups(server, tiny_model_dir, env, 4, seed=3)
    assert _requests(server) - before == 3  # one request per task, not per rollout
    for g in groups:
        assert [r.index for r in g] == [0, 1, 2, 3] and not any(r.errored for r in g)
        for r in g:
            (p,) = r.pieces
            assert sum(p.loss_mask) == r.completion_tokens > 0
            assert all(lp <= 0 for lp, m in zip(p.logprobs, p.loss_mask) if m)
        assert len({tuple(r.pieces[0].input_ids) for r in g}) > 1  # n independent samples
    again = _groups(server, tiny_model_dir, env, 4, seed=3)
    assert [[r.pieces[0].input_ids for r in g] for g in groups] == [
        [r.pieces[0].input_ids for r in g] for g in again
    ]


def test_a_rollout_failing_before_its_turn_does_not_block_the_group(server, tiny_model_dir: Path) -> None:
    from hpcrl.envs import load_environment

    env = load_environment("reverse-text")
    calls = {"n": 0}
    base = type(env).initial_messages

    def flaky(self, task):
        calls["n"] += 1
        if calls["n"] % 4 == 2:
            raise RuntimeError("env broke")
        return base(self, task)

    env.initial_messages = flaky.__get__(env)
    groups = _groups(server, tiny_model_dir, env, 4, seed=None)
    for g in groups:
        assert [r.errored for r in g] == [False, True, False, False]
        assert "env broke" in (g[1].error or "")
