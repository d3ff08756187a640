"""Tool use: OpenAI function schemas from Python functions, tool-call parsing and execution.

Structured `tool_calls` on the assistant message are used when present; otherwise a textual
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block is parsed, because small models
served through a plain chat template rarely emit structured calls.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from hpcrl.envs.base import Environment, Message, Task

_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean"}
_TEXT_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI function-calling schema from a function's signature and docstring (first line)."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, p in inspect.signature(fn).parameters.items():
        props[name] = {"type": _PY_TO_JSON.get(p.annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or fn.__name__).strip().splitlines()[0]
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def parse_tool_calls(message: Message, turn_index: int = 0) -> list[dict[str, Any]]:
    """Tool calls of an assistant message as [{"id", "name", "arguments": dict | str}].
    Arguments that are not valid JSON are kept as the raw string (execution reports the error)."""
    calls: list[dict[str, Any]] = []
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function", tc)
        calls.append(
            {
                "id": tc.get("id") or f"call_{turn_index}_{i}",
                "name": fn.get("name", ""),
                "arguments": _loads(fn.get("arguments", {})),
            }
        )
    if calls:
        return calls
    text = message.get("content") or ""
    for i, raw in enumerate(_TEXT_CALL.findall(text if isinstance(text, str) else "")):
        obj = _loads(raw)
        if isinstance(obj, dict):
            calls.append(
                {
                    "id": f"call_{turn_index}_{i}",
                    "name": str(obj.get("name", "")),
                    "arguments": _loads(obj.get("arguments", {})),
                }
            )
        else:
            calls.append({"id": f"call_{turn_index}_{i}", "name": "", "arguments": raw})
    return calls


def _loads(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


class ToolEnvironment(Environment):
    """Multi-turn tool loop: after each assistant turn, run its tool calls and answer with one
    `tool` message per call; the rollout ends on a turn without tool calls (the final answer)
    or at max_turns. Tool errors are returned to the model as text, never raised."""

    tool_fns: dict[str, Callable[..., Any]]

    def set_tools(self, tool_fns: list[Callable[..., Any]], max_turns: int) -> None:
        # A setter rather than __init__ so that this composes with other Environment bases.
        self.tool_fns = {fn.__name__: fn for fn in tool_fns}
        self.tools = [tool_schema(fn) for fn in tool_fns]
        self.max_turns = max_turns

    def initial_state(self, task: Task) -> dict[str, Any]:
        return {"turn": 0, "tool_calls": 0, "tool_errors": 0}

    def call_tool(self, name: str, arguments: Any) -> tuple[str, bool]:
        """Returns (result text, ok)."""
        fn = self.tool_fns.get(name)
        if fn is None:
            return f"Error: unknown tool {name!r}; available: {', '.join(self.tool_fns)}", False
        if not isinstance(arguments, dict):
            return "Error: arguments must be a JSON object", False
        try:
            return str(fn(**arguments)), True
        except TypeError as e:
            return f"Error: bad arguments for {name}: {e}", False
        except ValueError as e:
            return f"Error: {e}", False

    async def env_response(self, task: Task, messages: list[Message], state: dict[str, Any]):
        calls = parse_tool_calls(messages[-1], state["turn"])
        state["turn"] += 1
        if not calls:
            return [], True
        out: list[Message] = []
        for call in calls:
            result, ok = self.call_tool(call["name"], call["arguments"])
            state["tool_calls"] += 1
            state["tool_errors"] += 0 if ok else 1
            out.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result})
        return out, False
