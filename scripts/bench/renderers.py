"""Multi-turn prompt construction: renderers' bridge vs a full re-render vs hpcrl's stitching.

    PYTHONPATH=. python scripts/bench/renderers.py [--rollouts 100] [--turns 3]

For 100 tool-think conversations on the Qwen3-template tiny tokenizer (hpcrl/tiny-qwen3-think), each
later turn's prompt is built three ways, in the same run, from the same completions:
- bridge:    renderers' `bridge_to_next_turn` (qwen3 renderer) onto the sampled ids;
- bridge/all: the same with thinking_retention = "all" (bridges across a new user question too);
- re-render: `renderer.render(messages)` of the whole conversation;
- stitching: hpcrl's template-prefix stitching (hpcrl.orchestrator.stitching.env_response_ids).
A break is a later turn whose prompt is not prev_prompt + prev_completion + more (the bridge or the
stitching declined, or the re-render rewrote history): that turn cannot continue the training sample.
Completions are either formatted the way a Qwen3 model writes them (<think> + <tool_call> + <|im_end|>)
or random tokens ending in <|im_end|> (an untrained model: non-canonical tokenizations). The
scenarios: tool results only, or tool results and then a new user question on the last turn.
Prints one table: breaks per 100 rollouts and the mean time to build one later turn's prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0] and its name would shadow the renderers package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def formatted_completion(tok: Any, expr: str, turn: int, last: bool) -> list[int]:
    if last:
        text = "<think>\ndone\n</think>\n\n#### 42<|im_end|>"
    else:
        call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
        text = f"<think>\nstep {turn}\n</think>\n\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    return tok.encode(text, add_special_tokens=False)


def random_completion(tok: Any, rng: random.Random, n: int = 16) -> list[int]:
    special = set(tok.convert_tokens_to_ids(list(SPECIAL)))
    ids = [t for t in (rng.randrange(len(tok)) for _ in range(4 * n)) if t not in special][:n]
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def build_prompts(
    renderer: Any, keep_all: Any, tok: Any, history, messages, tools, prev_prompt, prev_completion
):
    """{method: (prompt ids or None, seconds)} for one later turn."""
    from hpcrl.orchestrator.stitching import env_response_ids, stitch_prompt

    out = {}
    for name, r in (("bridge", renderer), ("bridge/all", keep_all)):
        t0 = time.perf_counter()
        b = r.bridge_to_next_turn(prev_prompt, prev_completion, messages[len(history) :], tools=tools)
        out[name] = (None if b is None else list(b.token_ids), time.perf_counter() - t0)
    t0 = time.perf_counter()
    ids = list(renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids)
    out["re-render"] = (ids, time.perf_counter() - t0)
    t0 = time.perf_counter()
    env_ids = env_response_ids(tok, history, messages, tools, prev_completion)
    stitched = None if env_ids is None else stitch_prompt(prev_prompt, prev_completion, env_ids)
    out["stitching"] = (stitched, time.perf_counter() - t0)
    return out


def run(rollouts: int, turns: int, kind: str, follow_up: bool, seed: int = 0) -> dict[str, dict[str, float]]:
    from renderers import Qwen3RendererConfig, create_renderer

    from hpcrl.envs.builtin.tool_think import load_environment
    from hpcrl.models.tiny import build_tokenizer

    tok = build_tokenizer("qwen3")
    renderer = create_renderer(tok, Qwen3RendererConfig())
    keep_all = create_renderer(tok, Qwen3RendererConfig(thinking_retention="all"))
    env = load_environment(turns=turns)
    rng = random.Random(seed)
    methods = ("bridge", "bridge/all", "re-render", "stitching")
    stats = {m: {"breaks": 0, "seconds": 0.0, "turns": 0} for m in methods}
    for task in list(env.tasks("train"))[:rollouts]:
        messages = env.initial_messages(task)
        prompt = list(renderer.render(messages, tools=env.tools, add_generation_prompt=True).token_ids)
        for turn in range(turns):
            completion = (
                formatted_completion(tok, task.info["expression"], turn, turn == turns - 1)
                if kind == "formatted"
                else random_completion(tok, rng)
            )
            parsed = renderer.parse_response(completion, prompt_ids=prompt, tools=env.tools)
            from hpcrl.orchestrator.renderer_client import tool_calls_of

            msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning_content is not None:
                msg["reasoning_content"] = parsed.reasoning_content
            if calls := tool_calls_of(parsed):
                msg["tool_calls"] = calls
            messages.append(msg)
            if turn == turns - 1:
                break
            history = list(messages)
            if follow_up and turn == turns - 2:
                messages.append({"role": "user", "content": "Now double it."})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": "c", "name": "calculate", "content": task.answer}
                )
            built = build_prompts(renderer, keep_all, tok, history, messages, env.tools, prompt, completion)
            exact_prefix = prompt + completion
            for method, (ids, seconds) in built.items():
                s = stats[method]
                s["turns"] += 1
                s["seconds"] += seconds
                if ids is None or ids[: len(exact_prefix)] != exact_prefix:
                    s["breaks"] += 1
            # The next turn continues from what a renderer-driven rollout would send: the bridge, or
            # the full render when it declines.
            prompt = built["bridge"][0] or built["re-render"][0]
    return {
        m: {
            "breaks_per_100": 100 * s["breaks"] / rollouts,
            "ms_per_turn": 1000 * s["seconds"] / max(s["turns"], 1),
        }
        for m, s in stats.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=100)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for kind in ("formatted", "random"):
        for follow_up in (False, True):
            res = run(args.rollouts, args.turns, kind, follow_up)
            scenario = f"{kind}, {'tools + user follow-up' if follow_up else 'tool results only'}"
            rows += [(scenario, m, r["breaks_per_100"], r["ms_per_turn"]) for m, r in res.items()]
    print(f"{args.rollouts} rollouts x {args.turns} turns, qwen3 renderer, Qwen3-template tiny tokenizer")
    print(f"{'completions, scenario':44} {'method':10} {'breaks/100 rollouts':>20} {'ms/turn':>9}")
    print("(a break: a later turn that cannot extend the sampled ids and starts a new training sample)")
    for scenario, method, breaks, ms in rows:
        print(f"{scenario:44} {method:10} {breaks:20.1f} {ms:9.2f}")


if __name__ == "__main__":
    main()
