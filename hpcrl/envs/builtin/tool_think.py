"""tool-think: a multi-turn tool conversation with reasoning, the shape Qwen3-style templates get wrong
when history is re-rendered.

Every prompt holds a worked example first: a user question, an assistant turn with reasoning
(`reasoning_content`, rendered as a <think> block) and a `calculate` tool call, the tool's answer,
and the assistant's final answer with its own reasoning; then the real question. After each assistant
turn the environment answers with tool messages: the results of the turn's tool calls (parsed from
the completion ids by the renderer when one is configured), or, when the turn made none, the
calculator's result for the question, as a hint. The rollout has exactly `turns` assistant turns
(>= 3), a turn cut at max_tokens included. Qwen3's template drops the worked example's <think> blocks and renders an empty one before
the last assistant turn, so re-rendering never reproduces what was sampled; renderers'
`bridge_to_next_turn` does (docs/renderers.md).

Reward: the final answer is right (1), plus 0.1 x the fraction of the answer's digits that the last
turn mentions, so even an untrained model's groups differ.
"""

from __future__ import annotations

import random
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task, Trajectory
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    extract_number,
    last_assistant_text,
)
from hpcrl.envs.builtin.calculator import calculate
from hpcrl.envs.tools import ToolEnvironment, parse_tool_calls

SYSTEM_PROMPT = "Think in <think> blocks, use the calculate tool, end with '#### <number>'."


def worked_example(rng: random.Random) -> list[Message]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    expr = f"{a} + {b}"
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculate", "arguments": {"expression": expr}},
    }
    return [
        {"role": "user", "content": f"What is {expr}?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"I add {a} and {b}.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "calculate", "content": calculate(expr)},
        {
            "role": "assistant",
            "content": f"#### {calculate(expr)}",
            "reasoning_content": "The tool answered.",
        },
    ]


def answer_correct(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(extract_number(last_assistant_text(completion)) == task.answer)


def answer_digits(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    text = last_assistant_text(completion)
    digits = [d for d in task.answer if d.isdigit()]
    return sum(d in text for d in digits) / max(len(digits), 1)


def tool_calls_made(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(state.get("tool_calls", 0))


class ToolThinkEnv(ToolEnvironment, GeneratedEnvironment):
    name = "tool-think"

    def __init__(self, *, turns: int, max_operand: int, follow_up: bool = False, **kw: Any):
        rubric = Rubric([(answer_correct, 1.0), (answer_digits, 0.1), (tool_calls_made, 0.0)])
        super().__init__(rubric, **kw)
        self.set_tools([calculate], turns)
        self.max_operand, self.follow_up = max_operand, follow_up

    def make_task(self, rng: random.Random):
        a, b, c = (rng.randint(2, self.max_operand) for _ in range(3))
        expr = f"{a} * {b} - {c}"
        prompt = [
            {"role": "system", "content": SYSTEM_PROMPT},
            *worked_example(rng),
            {"role": "user", "content": f"What is {expr}?"},
        ]
        return expr, prompt, calculate(expr), {"expression": expr}

    async def rollout(self, task: Task, client: Any, sampling: Any) -> Trajectory:
        """The reference loop, except that a turn cut at max_tokens is answered too: every rollout
        has exactly `turns` assistant turns, and the next prompt must close the cut turn (renderers'
        bridge synthesizes the missing </think> and <|im_end|>)."""
        state = self.initial_state(task)
        messages = self.initial_messages(task)
        num_prompt, turns = len(messages), []
        for _ in range(self.max_turns):
            turn = await client.chat(messages, self.tools, sampling)
            turns.append(turn)
            messages.append(turn.message())
            new_messages, done = await self.env_response(task, messages, state)
            messages.extend(new_messages)
            if done:
                break
        reward, metrics = await self.score(task, messages[num_prompt:], state)
        metrics.setdefault("num_turns", float(len(turns)))
        truncated = any(t.finish_reason == "length" for t in turns)
        return Trajectory(task, messages, num_prompt, turns, reward, metrics, state, truncated)

    async def env_response(self, task: Task, messages: list[Message], state: dict[str, Any]):
        state["turn"] += 1
        if state["turn"] >= self.max_turns:
            return [], True
        if self.follow_up and state["turn"] == self.max_turns - 1:  # a new user query before the last turn
            return [{"role": "user", "content": "Give only the final number."}], False
        calls = parse_tool_calls(messages[-1], state["turn"])
        out: list[Message] = []
        for call in calls:
            result, ok = self.call_tool(call["name"], call["arguments"])
            state["tool_calls"] += 1
            state["tool_errors"] += 0 if ok else 1
            out.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result})
        if not out:
            hint = calculate(task.info["expression"])
            out.append({"role": "tool", "tool_call_id": "hint", "name": "calculate", "content": hint})
        return out, False


def sft_rows(env: ToolThinkEnv, n: int, split: str = "train") -> list[dict[str, Any]]:
    """`n` ideal transcripts (`messages` + `tools` rows for `hpcrl sft`): reason, call the tool, check
    with it again, answer. A warm start that teaches a tiny model the format (reasoning, tool calls,
    ending its turn), so RL rollouts really have >= 3 turns of them."""
    rows = []
    for task in list(env.tasks(split))[:n]:
        expr, answer = task.info["expression"], task.answer

        def call(i: int, expr: str = expr) -> dict[str, Any]:
            fn = {"name": "calculate", "arguments": {"expression": expr}}
            return {"id": f"call_{i}", "type": "function", "function": fn}

        msgs = [
            *env.initial_messages(task),
            {"role": "assistant", "content": "", "reasoning_content": "compute", "tool_calls": [call(1)]},
            {"role": "tool", "tool_call_id": "call_1", "name": "calculate", "content": answer},
            {"role": "assistant", "content": "", "reasoning_content": "check", "tool_calls": [call(2)]},
            {"role": "tool", "tool_call_id": "call_2", "name": "calculate", "content": answer},
            {"role": "assistant", "content": f"#### {answer}", "reasoning_content": "done"},
        ]
        rows.append({"messages": msgs, "tools": env.tools})
    return rows


def _check(turns: int, max_operand: int, follow_up: bool) -> None:
    if turns < 3:
        raise ValueError(f"turns must be >= 3 (a multi-turn tool conversation), got {turns}")


load_environment = builtin_loader(
    ToolThinkEnv,
    {"turns": 3, "max_operand": 20, "follow_up": False},
    check=_check,
    num_examples=2000,
    num_eval_examples=64,
    num_val_examples=32,
    doc="""`turns` (>= 3) assistant turns per rollout; questions `a * b - c` with operands up to max_operand.
    `follow_up`: the last turn answers a new user question instead of a tool result (under Qwen3's
    default thinking retention the bridge declines there: the turn is re-rendered, a new sample).""",
)
