"""The verifiers adapter runs a classic vf environment against our ChatClient protocol."""

from __future__ import annotations

import asyncio

import pytest

from hpcrl.envs import Turn
from hpcrl.envs.verifiers.adapter03 import VerifiersEnvironment, is_verifiers_env, wrap_verifiers_env
from tests.vf_classic import classic_verifiers

vf = classic_verifiers()
datasets = pytest.importorskip("datasets")


class ReverseClient:
    """Replies with the last message reversed; records what it was asked."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[dict], object, dict]] = []

    async def chat(self, messages, tools, sampling):
        self.requests.append((messages, tools, dict(sampling)))
        text = messages[-1]["content"][::-1]
        return Turn(
            text=text,
            prompt_token_ids=list(range(10 * len(messages))),
            completion_token_ids=[7, 8, 9],
            completion_logprobs=[-0.1, -0.2, -0.3],
            policy_steps=[4, 4, 5],
            finish_reason="stop",
        )


def exact(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"] == answer)


def make_single_turn():
    ds = datasets.Dataset.from_list(
        [{"question": "abc", "answer": "cba"}, {"question": "xy", "answer": "zz"}]
    )
    return vf.SingleTurnEnv(dataset=ds, system_prompt="Reverse.", rubric=vf.Rubric(funcs=[exact]))


def test_single_turn_env_through_adapter():
    vf_env = make_single_turn()
    assert is_verifiers_env(vf_env)
    env = wrap_verifiers_env(vf_env, name="vf-reverse")
    tasks = env.tasks("train")
    assert [t.example_id for t in tasks] == [0, 1]
    assert tasks[0].prompt == [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "abc"}]

    client = ReverseClient()
    group = asyncio.run(env.rollout_group(tasks[0], client, {"temperature": 0.7, "max_tokens": 8}, 2))
    assert len(group) == 2
    for traj in group:
        assert traj.reward == 1.0 and traj.metrics["exact"] == 1.0 and traj.error is None
        (turn,) = traj.turns
        assert turn.completion_token_ids == [7, 8, 9] and turn.completion_logprobs == [-0.1, -0.2, -0.3]
        assert turn.policy_steps == [4, 4, 5] and traj.oldest_policy_step == 4
        assert traj.completion == [{"role": "assistant", "content": "cba"}]
    messages, tools, sampling = client.requests[0]
    assert messages[-1] == {"role": "user", "content": "abc"} and tools is None
    assert sampling == {"temperature": 0.7, "max_tokens": 8}

    wrong = asyncio.run(env.rollout(tasks[1], client, {}))
    assert wrong.reward == 0.0


class CountdownEnv(vf.MultiTurnEnv):
    """Two-turn vf env: the environment answers 'again' once, then stops."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def test_multi_turn_env_through_adapter():
    ds = datasets.Dataset.from_list([{"question": "hello", "answer": "niaga"}])
    vf_env = CountdownEnv(dataset=ds, max_turns=2, rubric=vf.Rubric(funcs=[exact]))
    env = VerifiersEnvironment(vf_env, name="vf-multi")
    assert env.max_turns == 2
    traj = asyncio.run(env.rollout(env.tasks()[0], ReverseClient(), {}))
    assert [m["role"] for m in traj.completion] == ["assistant", "user", "assistant"]
    assert len(traj.turns) == 2 and traj.reward == 1.0


def test_registry_wraps_an_installed_verifiers_env_module(tmp_path, monkeypatch):
    (tmp_path / "my_vf_env.py").write_text(
        "import verifiers as vf\n"
        "from datasets import Dataset\n"
        "def load_environment(n: int = 2):\n"
        "    ds = Dataset.from_list([{'question': str(i), 'answer': str(i)} for i in range(n)])\n"
        "    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion, answer: 1.0]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from hpcrl.envs import load_environment, validate_env_spec

    env = load_environment("someone/my-vf-env", n=3)
    assert isinstance(env, VerifiersEnvironment) and env.name == "someone/my-vf-env"
    assert len(env.tasks("train")) == 3
    validate_env_spec("my_vf_env", {"n": 1})
    with pytest.raises(ValueError, match=r"unknown argument 'm'; accepted: n"):
        validate_env_spec("my-vf-env", {"m": 1})
