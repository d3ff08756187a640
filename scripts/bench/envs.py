"""Env servers (issue 29): what running environments out of the orchestrator's process costs and buys.

    python scripts/bench/envs.py [--rollouts 96] [--steps 10] [--skip-e2e]

1. Throughput, one run: an env whose reward burns 50 ms of CPU per rollout (scripts/bench/burn_env.py),
   `--rollouts` concurrent rollouts answered by an instant model (no inference: only the env path is
   timed), rollouts/s for the in-process path (what every env did before: the orchestrator's event
   loop runs the reward) and for env servers with 1 and 2 worker processes.
2. IPC overhead on a trivial env: two real `hpcrl run`s of the tiny reverse-text config (CPU,
   embedded inference), `orchestrator.env_workers = 0` (in-process) vs 1 (env server), the mean
   orchestrator step time (time/generate, steps 2..N) and the whole run's wall time.
Prints one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])

ENV_ID = "burn_env:load_environment"


class InstantModel:
    """A ChatClient that answers at once: the benchmark times the env path only."""

    async def chat(self, messages, tools, sampling):
        from hpcrl.envs.base import Turn

        return Turn("ok", [1, 2, 3], [4, 5], [-0.1, -0.2], [0])


async def _drive(env, n: int) -> float:
    tasks = env.tasks("train")
    t0 = time.perf_counter()
    await asyncio.gather(*(env.rollout(tasks[i % len(tasks)], InstantModel(), {}) for i in range(n)))
    return time.perf_counter() - t0


def throughput(n: int, workers: int, log_dir: Path, burn_s: float = 0.05) -> float:
    """rollouts/s: workers = 0 runs the env on this event loop (the in-process path)."""
    from hpcrl.envs.registry import load_environment
    from hpcrl.envs.remote import RemoteEnvironment, server_spec

    args = {"burn_s": burn_s}
    if workers == 0:
        env = load_environment(ENV_ID, **args)
        asyncio.run(_drive(env, 4))  # warm-up
        return n / asyncio.run(_drive(env, n))
    where = log_dir / f"w{workers}-{burn_s}"
    env = RemoteEnvironment(server_spec(ENV_ID, args, "burn", "train", workers, 60.0, where))

    async def main() -> float:
        await _drive(env, 4 * workers)  # warm-up: every worker has loaded and answered once
        dt = await _drive(env, n)
        await env.aclose()
        return dt

    return n / asyncio.run(main())


E2E = """max_steps = {steps}
seq_len = 64
[model]
name = "hpcrl/tiny-qwen3"
[orchestrator]
batch_size = 32
rollouts_per_example = 4
max_async_level = 1
env_workers = {workers}
[orchestrator.advantage]
zero_advantage = "keep"
[orchestrator.train.sampling]
max_tokens = 8
[[orchestrator.train.env]]
id = "reverse-text"
"""


def e2e(steps: int, workers: int, tmp: Path) -> dict[str, float]:
    from hpcrl.monitor.metrics import read_metrics
    from hpcrl.paths import RunPaths

    cfg, out = tmp / f"e2e_{workers}.toml", tmp / f"run_{workers}"
    cfg.write_text(E2E.format(steps=steps, workers=workers))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"e2e run (env_workers={workers}) failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    recs = [x for x in read_metrics(RunPaths(out).metrics_file) if x.get("role") == "orchestrator"]
    gen = [x["time/generate"] for x in recs if x.get("step", 0) >= 2 and "time/generate" in x]
    return {
        "generate_s_mean": statistics.mean(gen),
        "generate_s_median": statistics.median(gen),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=96)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip-e2e", action="store_true")
    args = p.parse_args(argv)
    out: dict[str, object] = {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rates = {w: throughput(args.rollouts, w, tmp) for w in (0, 1, 2)}
        out["rollouts_per_s"] = {"in_process": rates[0], "workers_1": rates[1], "workers_2": rates[2]}
        out["speedup_2_workers_vs_in_process"] = rates[2] / rates[0]
        out["speedup_1_worker_vs_in_process"] = rates[1] / rates[0]
        # the same with a reward that costs nothing: what one rollout's trip through the server costs
        trivial = {w: throughput(args.rollouts * 4, w, tmp, 0.0) for w in (0, 1)}
        out["trivial_rollouts_per_s"] = {"in_process": trivial[0], "workers_1": trivial[1]}
        out["ipc_ms_per_rollout"] = 1000 * (1 / trivial[1] - 1 / trivial[0])
        if not args.skip_e2e:
            base, served = e2e(args.steps, 0, tmp), e2e(args.steps, 1, tmp)
            out["e2e_in_process"], out["e2e_env_server"] = base, served
            out["step_overhead_pct"] = 100 * (served["generate_s_mean"] / base["generate_s_mean"] - 1)
    out["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
