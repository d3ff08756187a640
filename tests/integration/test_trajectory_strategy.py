"""orchestrator.trajectory_strategy on a multi-turn env (alphabet-sort) against a real server:
interleaved runs every example's turns at once; branching finishes one example's trajectories
before the next example's first request. Both stitch each rollout into one exact sample."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import InferenceServer


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    s = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("run"))
    yield s
    s.stop()


def _run(strategy: str, tiny_model_dir: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoTokenizer

    from hpcrl.envs import load_environment
    from hpcrl.orchestrator.rollout import Generator, RolloutClient, ServerPool

    events: list[tuple[str, str]] = []
    chat = RolloutClient.chat

    async def recorded_chat(self, messages, *a, **kw):
        example = next(m["content"] for m in messages if m["role"] == "user")  # identifies the task
        events.append((example, "send"))
        turn = await chat(self, messages, *a, **kw)
        turn.finish_reason = "stop"  # the untrained model never stops: let the env answer
        events.append((example, "done"))
        return turn

    monkeypatch.setattr(RolloutClient, "chat", recorded_chat)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = load_environment("alphabet-sort", min_turns=3, max_turns=3)
    tasks = list(env.tasks("train")[:3])

    async def go():
        pool = ServerPool([server.base_url], model=str(tiny_model_dir), timeout=60, max_concurrent=16)
        try:
            gen = Generator(pool, tok, 2048, lambda: 0, seed=5, strategy=strategy)
            # the orchestrator asks for each example's group separately, all at once
            return await asyncio.gather(*(gen.groups(env, [t], 2, {"max_tokens": 6}, "k") for t in tasks))
        finally:
            await pool.aclose()

    groups = [g[0] for g in asyncio.run(go())]
    return groups, events


def _blocks(events: list[tuple[str, str]]) -> int:
    """How many runs of consecutive events belong to the same example."""
    return 1 + sum(a[0] != b[0] for a, b in zip(events, events[1:]))


@pytest.mark.timeout(240)
def test_interleaved_and_branching(
    tiny_model_dir: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = {}
    for strategy in ("interleaved", "branching"):
        groups, events = _run(strategy, tiny_model_dir, server, monkeypatch)
        monkeypatch.undo()
        # interleaved: a rollout's 3 turns are one stitched sample; branching: one sample per turn
        pieces = 1 if strategy == "interleaved" else 3
        for g in groups:
            assert all(not r.errored and r.num_turns == 3 and len(r.pieces) == pieces for r in g)
        assert len(events) == 3 * 2 * 3 * 2  # examples x rollouts x turns x (send, done)
        results[strategy] = events
    # branching: each example's 12 events are contiguous (3 blocks for 3 examples)
    assert _blocks(results["branching"]) == 3
    # interleaved: every example has sent its first turn before any example finishes its last one
    inter = results["interleaved"]
    first_sends = {e: inter.index((e, "send")) for e, _ in inter}
    last_dones = {e: len(inter) - 1 - inter[::-1].index((e, "done")) for e, _ in inter}
    assert max(first_sends.values()) < min(last_dones.values())
    assert _blocks(inter) > 3
