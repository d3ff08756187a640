"""A verifiers 0.4 environment that is not part of hpcrl: a v1 taskset played by `SingleAgentEnv`
(the env a plain taskset resolves to) with a multi-turn tool harness, written the way verifiers'
v1 docs show (TaskData + Task with @vf.reward/@vf.metric, a Taskset and a Harness exported through
`__all__`, so the taskset's own harness is its default).

The harness runs its chat program in the seat's runtime (`runtime.run_program`), like verifiers'
own `bash`/`null` harnesses, but the program is stdlib-only Python written into the runtime with
`runtime.write`: no `uv`, no package downloads, so it works offline in the `subprocess` runtime.
Every model call goes through the interception endpoint the harness is handed (the contract), so
the trace records each turn's token ids and logprobs. Loaded by id
"vf1_tool_env" with tests/vf1_envs on PYTHONPATH (as an installed env package is) in
tests/integration/test_vf1_train.py."""

from __future__ import annotations

import json

import verifiers.v1 as vf

# The agent program: a chat loop with one tool (`add`). A tool call is executed and answered; a
# plain reply gets one nudge; it stops after `--max-turns` model turns or on a final answer.
PROGRAM = r"""
import argparse, json, sys, urllib.request
p = argparse.ArgumentParser()
p.add_argument("--base-url"); p.add_argument("--api-key"); p.add_argument("--model")
p.add_argument("--prompt"); p.add_argument("--max-turns", type=int, default=3)
a = p.parse_args()
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                         "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
messages = [{"role": "user", "content": a.prompt}]
for turn in range(a.max_turns):
    req = urllib.request.Request(
        a.base_url.rstrip("/") + "/chat/completions",
        data=json.dumps({"model": a.model, "messages": messages, "tools": TOOLS}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + a.api_key},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        msg = json.load(r)["choices"][0]["message"]
    messages.append({k: v for k, v in msg.items() if v is not None})
    calls = msg.get("tool_calls") or []
    if calls:
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"] or "{}")
                out = str(int(args["a"]) + int(args["b"]))
            except Exception as e:
                out = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": out})
    elif turn + 1 < a.max_turns:
        messages.append({"role": "user", "content": "Answer with just the number."})
print(json.dumps({"turns": turn + 1}))
"""


class AddData(vf.TaskData):
    a: int
    b: int


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == str(self.data.a + self.data.b))

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        """Shaping with spread on a random model: the share of digits in the last reply."""
        reply = trace.last_reply or ""
        return sum(ch.isdigit() for ch in reply) / max(1, len(reply))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 8


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self) -> list[AddTask]:
        return [
            AddTask(
                AddData(idx=i, prompt=f"What is {i} + {2 * i}? Use the add tool.", a=i, b=2 * i),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class AddToolHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3


class AddToolHarness(vf.Harness[AddToolHarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        _, prompt = self.resolve_text_prompt(data)
        await runtime.write("agent.py", PROGRAM.encode())
        argv = [
            "python3",
            "agent.py",
            f"--base-url={endpoint}",
            f"--api-key={secret}",
            f"--model={ctx.model}",
        ]
        argv += [f"--prompt={prompt}", f"--max-turns={self.config.max_turns}"]
        result = await runtime.run_program(argv, {})
        await self._check_result(trace, runtime, result)
        json.loads(result.stdout.strip().splitlines()[-1])  # the program's own summary line
        return result


__all__ = ["AddTaskset", "AddToolHarness"]
