"""tool-think: >= 3 assistant turns, tool results after each (the turn's own calls, else a hint), an
optional user follow-up, reasoning and a tool call in every prompt's worked example."""

from __future__ import annotations

import asyncio

import pytest

from hpcrl.envs import Turn, load_environment


class Scripted:
    """A ChatClient that answers with fixed turns and records the messages it was shown."""

    def __init__(self, turns: list[Turn]):
        self.turns, self.seen = list(turns), []

    async def chat(self, messages, tools, sampling):
        self.seen.append([dict(m) for m in messages])
        return self.turns.pop(0)


def _turn(text: str, calls=None, finish: str = "stop") -> Turn:
    return Turn(text, [1], [2], [-0.1], [0], finish_reason=finish, tool_calls=calls)


def test_three_turns_tool_results_and_a_cut_turn_answered() -> None:
    env = load_environment("tool-think")
    task = env.tasks("train")[0]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculate", "arguments": '{"expression": "2*3"}'},
    }
    client = Scripted([_turn("", [call]), _turn("cut", finish="length"), _turn(f"#### {task.answer}")])
    traj = asyncio.run(env.rollout(task, client, {}))
    assert len(traj.turns) == 3 and traj.truncated and traj.reward == pytest.approx(1.1)
    tool_msgs = [m for m in traj.completion if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["6", task.answer]  # its call's result, then the hint
    prompt = traj.messages[: traj.num_prompt_messages]
    assert any(m.get("reasoning_content") for m in prompt) and any(m.get("tool_calls") for m in prompt)


def test_follow_up_is_a_user_question_before_the_last_turn() -> None:
    env = load_environment("tool-think", follow_up=True)
    task = env.tasks("train")[0]
    traj = asyncio.run(env.rollout(task, Scripted([_turn("a"), _turn("b"), _turn("c")]), {}))
    roles = [m["role"] for m in traj.completion]
    assert roles == ["assistant", "tool", "assistant", "user", "assistant"]


def test_fewer_than_three_turns_is_refused() -> None:
    with pytest.raises(ValueError, match="turns must be >= 3"):
        load_environment("tool-think", turns=2)


def test_sft_rows_are_ideal_three_turn_transcripts() -> None:
    from hpcrl.envs.builtin.tool_think import sft_rows

    env = load_environment("tool-think")
    (row,) = sft_rows(env, 1)
    asst = [m for m in row["messages"] if m["role"] == "assistant"][-3:]
    assert [bool(m.get("tool_calls")) for m in asst] == [True, True, False]
    assert all(m["reasoning_content"] for m in asst) and row["tools"] == env.tools
