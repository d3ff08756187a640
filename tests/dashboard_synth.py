"""Synthetic run directories for the dashboard's tests and scripts/bench/dashboard.py: metrics.jsonl,
configs/, logs/ (roles, an env with its server and worker), progress files, error causes, and saved
rollouts in the documented format (docs/observability.md "Saved rollouts": traces.jsonl + its
traces.index.json), a multi-turn tool conversation among them, with per-token logprobs.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from hpcrl.monitor import rollout_files as rf
from hpcrl.paths import RunPaths

ENVS = ("reverse-text", "calc-tools")
RUBRIC = {"reverse-text": {"lcs_ratio": 1.0}, "calc-tools": {"correct": 0.8, "format": 0.2}}


def metrics_records(step: int, t: float, rng: random.Random, width: int = 60) -> list[dict]:
    """An orchestrator and a trainer record of one step, about as wide as a real run's."""
    base = 1 - math.exp(-step / 400)
    orch: dict = {"role": "orchestrator", "step": step, "time": t}
    for env in ENVS:
        r = min(1.0, max(0.0, base * 0.8 + rng.gauss(0, 0.05)))
        orch[f"reward/{env}/mean"] = r
        orch[f"reward/{env}/std"] = abs(rng.gauss(0.2, 0.03))
        for fn in RUBRIC[env]:
            orch[f"reward/{env}/{fn}/mean"] = min(1.0, max(0.0, r + rng.gauss(0, 0.05)))
            orch[f"reward/{env}/{fn}/std"] = abs(rng.gauss(0.2, 0.03))
        orch[f"seq_len/{env}/mean"] = 40 + rng.random() * 20
    orch["reward/all/mean"] = sum(orch[f"reward/{e}/mean"] for e in ENVS) / len(ENVS)
    orch["time/generate"] = 1.5 + rng.random()
    orch["time/wait_for_policy"] = rng.random() * 0.2
    for i in range(max(0, width - len(orch))):
        orch[f"buffer/stat_{i}"] = rng.random()
    trainer: dict = {"role": "trainer", "step": step, "time": t + 0.5}
    trainer["loss/mean"] = rng.gauss(0, 0.01)
    trainer["optim/grad_norm"] = abs(rng.gauss(0.5, 0.1)) * (8 if rng.random() < 0.002 else 1)
    trainer["optim/lr"] = 1e-5
    trainer["entropy/all/mean"] = 2.0 - base
    trainer["mismatch_kl/all/mean"] = abs(rng.gauss(1e-3, 3e-4))
    trainer["perf/throughput"] = 20000 + rng.gauss(0, 500)
    for i in range(max(0, width - len(trainer))):
        trainer[f"perf/stat_{i}"] = rng.random()
    return [orch, trainer]


def write_metrics(
    paths: RunPaths, steps: int, seed: int = 0, start: float | None = None, step_s: float = 5.0
) -> None:
    rng = random.Random(seed)
    t0 = (time.time() - steps * step_s) if start is None else start
    with open(paths.metrics_file, "w") as f:
        for s in range(1, steps + 1):
            for rec in metrics_records(s, t0 + s * step_s, rng):
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if s % 10 == 0 or s == 1:
                ev = {"role": "orchestrator", "step": s, "time": t0 + s * step_s + 1}
                for env in ENVS:
                    ev[f"eval/{env}/avg@4"] = min(1.0, 1 - math.exp(-s / 500) + rng.gauss(0, 0.02))
                f.write(json.dumps(ev) + "\n")


def tool_conversation(example: int, index: int) -> list[dict]:
    return [
        {"role": "system", "content": "You are a calculator agent. Use the tools."},
        {"role": "user", "content": f"What is ({example} + 17) * 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": f"call_{index}_0",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": example, "b": 17})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": f"call_{index}_0", "content": str(example + 17)},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": f"call_{index}_1",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": json.dumps({"a": example + 17, "b": 3})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": f"call_{index}_1", "content": str((example + 17) * 3)},
        {"role": "assistant", "content": f"The answer is {(example + 17) * 3}."},
    ]


def _turn(text: str, rng: random.Random, finish: str, policy: int) -> dict:
    toks = [text[i : i + 3] for i in range(0, len(text), 3)] or [""]
    return {
        "prompt_len": 40,
        "finish_reason": finish,
        "policy": {"start": policy, "end": policy},
        "completion_ids": [rng.randrange(300) for _ in toks],
        "logprobs": [round(-abs(rng.gauss(0, 1.2)), 4) for _ in toks],
        "tokens": toks,
    }


def rollout(
    step: int,
    split: str,
    env: str,
    example: int,
    index: int,
    size: int,
    rewards: list[float],
    advs: list[float],
    rng: random.Random,
) -> dict:
    if env == "calc-tools":
        messages = tool_conversation(example, index)
        sampled = [m for m in messages[2:] if m["role"] == "assistant"]
        texts = [m["content"] or json.dumps(m["tool_calls"][0]["function"]) for m in sampled]
        finishes = ["tool_calls"] * (len(sampled) - 1) + ["stop"]
    else:
        word = "".join(rng.choice("abcdefghij") for _ in range(5))
        messages = [
            {"role": "system", "content": "Reverse the text."},
            {"role": "user", "content": word},
            {"role": "assistant", "content": word[::-1] if rewards[index] > 0.5 else word},
        ]
        texts, finishes = [messages[-1]["content"]], ["stop"]
    r = rewards[index]
    fns = {fn: {"score": r, "weight": w} for fn, w in RUBRIC[env].items()}
    ok = not (env == "calc-tools" and index == size - 1 and example % 7 == 0)
    return {
        "id": f"{split}-{step}-{env}-{example}-{index}",
        "step": step,
        "split": split,
        "env": {"id": env, "name": env},
        "task": {"example_id": example, "epoch": 0, "answer": None, "info": {}},
        "group": {"id": f"{env}/{example}", "index": index, "size": size},  # members: in the index
        "ok": ok,
        "trained": split == "train",
        "is_truncated": False,
        "errors": [] if ok else [{"type": "ToolError", "message": "multiply: timed out after 30 s"}],
        "reward": r if ok else 0.0,
        "advantage": advs[index],
        "rewards": fns,
        "metrics": {"num_turns": float(len(texts))},
        "policy": {"start": max(0, step - 1), "end": max(0, step - 1)},
        "num_turns": len(texts),
        "num_input_tokens": 40,
        "num_output_tokens": sum(len(t) // 3 + 1 for t in texts),
        "num_total_tokens": 40 + sum(len(t) // 3 + 1 for t in texts),
        "timing": {"start": 1.7e9, "end": 1.7e9 + 0.3, "duration": 0.3},
        "messages": messages,
        "num_prompt_messages": 2,
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        if env == "calc-tools"
        else [],
        "traces": [
            {
                "index": 0,
                "reward": r,
                "advantage": advs[index],
                "turns": [_turn(t, rng, f, max(0, step - 1)) for t, f in zip(texts, finishes)],
            }
        ],
    }


def write_rollouts(paths: RunPaths, step: int, split: str, groups: int, size: int, rng: random.Random) -> int:
    """One step's traces.jsonl and its index, written as the orchestrator does (index last)."""
    import msgspec

    enc = msgspec.json.Encoder()
    lines, rows, offset = [], [], 0
    for g in range(groups):
        env = ENVS[g % len(ENVS)]
        example = step * groups + g
        rewards = [round(rng.random(), 3) for _ in range(size)]
        mean = sum(rewards) / size
        advs = [round(r - mean, 4) for r in rewards]
        for i in range(size):
            rec = rollout(step, split, env, example, i, size, rewards, advs, rng)
            line = enc.encode(rec) + b"\n"
            rows.append(rf.row_of(rf.summary_of(rec, offset, len(line))))
            lines.append(line)
            offset += len(line)
    f = paths.saved_rollouts_file(step, split)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"".join(lines))
    idx = {"format": rf.INDEX_FORMAT, "size": offset, "columns": list(rf.COLUMNS), "rows": rows}
    paths.saved_rollouts_index(step, split).write_bytes(enc.encode(idx))
    return len(rows)


LOG_LINES = [
    "INFO    [orchestrator] step {s}: published batch ({n} samples)",
    "INFO    [orchestrator] policy {s} loaded by 1 server(s)",
]


def write_logs(paths: RunPaths, lines: int = 200) -> None:
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    t = 10 * 3600
    with open(paths.log_file("orchestrator"), "w") as f:
        for i in range(lines):
            hh, mm, ss = t // 3600, (t % 3600) // 60, t % 60
            f.write(f"{hh:02d}:{mm:02d}:{ss:02d} " + LOG_LINES[i % 2].format(s=i // 2, n=128) + "\n")
            if i == lines // 2:
                f.write(
                    f"{hh:02d}:{mm:02d}:{ss:02d} WARNING [orchestrator] inference server 0: no answer for 31 s\n"
                )
                f.write(f"{hh:02d}:{mm:02d}:{ss:02d} ERROR   [orchestrator] env calc-tools: rollout failed\n")
                f.write(
                    'Traceback (most recent call last):\n  File "env.py", line 3, in step\nToolError: multiply: timed out after 30 s\n'
                )
            t += 1
    with open(paths.log_file("trainer"), "w") as f:
        for i in range(lines // 2):
            hh, mm, ss = (10 * 3600 + 2 * i) // 3600, ((10 * 3600 + 2 * i) % 3600) // 60, (2 * i) % 60
            f.write(f"{hh:02d}:{mm:02d}:{ss:02d} INFO    [trainer] step {i}: loss 0.01\n")
    for kind in ("train", "eval"):
        d = paths.env_server_dir(kind, "calc-tools")
        d.mkdir(parents=True, exist_ok=True)
        (d / "server.log").write_text(
            "10:00:01 INFO    [hpcrl.envs.runtime.server] worker 0 started (pid 10, restart 0)\n"
        )
        (d / "worker_0.log").write_text(
            "10:00:02 INFO    [hpcrl.envs.runtime.worker] worker 0 (pid 10) serving calc-tools\n"
        )
        paths.env_log_file(kind, "calc-tools").write_text(
            "10:00:03 WARNING [orchestrator] calc-tools: 1 rollout errored (ToolError)\n"
        )


def write_state(paths: RunPaths, steps: int, alive_pid: int | None = None) -> None:
    paths.configs_dir.mkdir(parents=True, exist_ok=True)
    paths.resolved_config.write_text(
        f'type = "rl"\nmax_steps = {steps + 100}\nseq_len = 128\noutput_dir = "{paths.root}"\n\n[model]\nname = "hpcrl/tiny-qwen3"\n\n'
        "[trainer.optim]\nlr = 1e-5\n\n[orchestrator]\nbatch_size = 64\nrollouts_per_example = 8\n"
    )
    for role in ("trainer", "orchestrator", "inference"):
        paths.process_config(role).write_text(
            f'# {role}\nmax_steps = {steps + 100}\n[model]\nname = "hpcrl/tiny-qwen3"\n'
        )
    paths.progress_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for role, last in (
        ("orchestrator", f"published batch {steps}"),
        ("trainer_0", f"trained and published step {steps}"),
    ):
        doc = {
            "role": role,
            "pid": 1,
            "time": now,
            "state": "running",
            "step": steps,
            "last": last,
            "idle_s": 0.4,
            "bound_s": 60.0,
            "waiting_on": None,
            "waiting_s": None,
            "stall": None,
        }
        (paths.progress_dir / f"{role}.json").write_text(json.dumps(doc))
    paths.causes_file.write_text(
        json.dumps({"calc-tools": {"total": 3, "causes": {"ToolError: multiply: timed out": 3}}})
    )
    import os

    paths.job_file.write_text(
        json.dumps({"target": "local", "pid": alive_pid or os.getpid(), "started_at": now})
    )


def make_run(
    root: Path,
    steps: int = 30,
    groups: int = 4,
    size: int = 4,
    rollout_steps: int | None = None,
    seed: int = 0,
) -> RunPaths:
    """A whole synthetic run: `steps` steps of metrics, and saved rollouts (train every step, eval
    every 10th) for the last `rollout_steps` of them (default: all)."""
    paths = RunPaths(root)
    paths.make_dirs()
    write_state(paths, steps)
    write_metrics(paths, steps, seed)
    write_logs(paths)
    rng = random.Random(seed)
    first = 1 if rollout_steps is None else max(1, steps - rollout_steps + 1)
    for s in range(first, steps + 1):
        write_rollouts(paths, s, "train", groups, size, rng)
        if s % 10 == 0:
            write_rollouts(paths, s, "eval", groups, 2, rng)
    return paths
