"""calculator: arithmetic questions that reward calling a `calculate(expression)` tool.

The tool evaluates with an AST walker (numbers, + - * / // % **, unary +/-, parentheses) and
never `eval`: model output is untrusted. Reward = the final answer (the last assistant turn
without a tool call) equals the true value; tool usage is reported as metrics.
"""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    chat_prompt,
    extract_number,
    last_assistant_text,
)
from hpcrl.envs.tools import ToolEnvironment

SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculate", "arguments": {"expression": "2 * (3 + 4)"}}</tool_call> '
    "and wait for the result. When you know the answer, reply with '#### <number>'."
)

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR_CHARS = 200
MAX_ABS_VALUE = 1e15


def safe_eval(expression: str) -> float | int:
    """Evaluate an arithmetic expression; ValueError on anything else or on huge values."""
    if len(expression) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> float | int:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and left != 0 and right * math.log10(abs(left)) > 15:
            raise ValueError("result too large")  # checked before computing: 9**9**9 must not hang
        try:
            return _bounded(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def _bounded(x: float | int) -> float | int:
    if isinstance(x, complex) or abs(x) > MAX_ABS_VALUE:
        raise ValueError("value out of range")
    return x


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '12 * (3 + 4)'."""
    value = safe_eval(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def final_answer_correct(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    final = [m for m in completion if m.get("role") == "assistant"]
    if not final or final[-1].get("tool_calls") or "<tool_call>" in (final[-1].get("content") or ""):
        return 0.0  # ended on a tool call: no answer given
    return float(extract_number(last_assistant_text(completion)) == task.answer)


def num_tool_calls(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(state.get("tool_calls", 0))


def tool_errors(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(state.get("tool_errors", 0))


class CalculatorEnv(ToolEnvironment, GeneratedEnvironment):
    name = "calculator"

    def __init__(
        self, *, max_turns: int, max_operand: int, num_ops: int, system_prompt: str | None, **kw: Any
    ):
        rubric = Rubric([(final_answer_correct, 1.0), (num_tool_calls, 0.0), (tool_errors, 0.0)])
        super().__init__(rubric, **kw)
        self.set_tools([calculate], max_turns)
        self.max_operand, self.num_ops = max_operand, num_ops
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random):
        expr = str(rng.randint(2, self.max_operand))
        for _ in range(self.num_ops):
            op = rng.choice(["+", "-", "*"])
            expr = (
                f"({expr}) {op} {rng.randint(2, self.max_operand)}"
                if op == "*" and rng.random() < 0.5
                else f"{expr} {op} {rng.randint(2, self.max_operand)}"
            )
        answer = calculate(expr)
        prompt = chat_prompt(f"What is {expr}?", self.system_prompt)
        return expr, prompt, answer, {"expression": expr}


def _check(max_turns: int, max_operand: int, num_ops: int) -> None:
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_operand < 2 or num_ops < 1:
        raise ValueError(f"need max_operand >= 2 and num_ops >= 1, got {max_operand}, {num_ops}")


load_environment = builtin_loader(
    CalculatorEnv,
    {"max_turns": 4, "max_operand": 999, "num_ops": 2},
    check=_check,
    system_prompt=SYSTEM_PROMPT,
    doc="""Questions are `num_ops` operations over integers in [2, max_operand]; the model has up to
    max_turns assistant turns (tool calls included) to answer.""",
)
