"""Env servers (issue 29): what running environments out of the orchestrator's process costs and buys.

    python scripts/bench/envs.py [--rollouts 96] [--steps 10] [--skip-e2e]

1. Throughput, one run: an env whose reward burns 50 ms of CPU per rollout (scripts/bench/burn_env.py),
   `--rollouts` rollouts answered by an instant model (no inference: only the env path is timed),
   rollouts/s for the in-process path (what every env did before: the orchestrator's event loop
   runs the reward) and for env servers with 1 and 2 worker processes, measured in alternating
   rounds, with the cores our processes got meanwhile (`cores`: the machine is shared, and a
   speedup can be no larger than the cores the workers were given allow).
2. IPC overhead on a trivial env: real `hpcrl run`s of the tiny reverse-text config (CPU, embedded
   inference), `orchestrator.env_workers = 0` (in-process) vs 1 (env server), `--e2e-rounds` of
   each in turn, the mean orchestrator step time (time/generate, steps 2..N) and the run's wall
   time; and `step_ipc`, the same step (8 groups x 4 rollouts through run_group) with inference as
   a fixed 100 ms wait, in-process and served step by step in turn: what the IPC adds to a step
   when the trainer and the inference engine are not sharing the two cores with it.
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


def _ticks(path: str) -> int:
    """utime + stime of one process, in clock ticks (0 when it is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def _family() -> list[int]:
    """This process and every live descendant (env servers, workers)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [os.getpid()]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _cpu_snapshot(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds used so far by `pids`, CPU seconds the whole machine has been idle). Linux
    /proc; the two cores are shared, so what the other engineers' processes leave idle is as
    telling as what ours use."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = f.readline().split()[1:]
    return sum(_ticks(f"/proc/{p}/stat") for p in pids) / tick, (int(cpu[3]) + int(cpu[4])) / tick


def throughput(
    n: int, configs: tuple[int, ...], log_dir: Path, burn_s: float = 0.05, rounds: int = 4
) -> dict[int, dict[str, float]]:
    """Per worker count (0: the env runs on this event loop, the in-process path): rollouts/s, and
    how many cores our processes used and how many stood idle meanwhile. Every configuration is
    started and warmed up first (worker start-up is not timed); then `rounds` rounds each drive
    n / rounds rollouts through every configuration in turn, so that the other engineers' load,
    which changes from second to second, falls on all of them alike."""
    from hpcrl.envs.registry import load_environment
    from hpcrl.orchestrator.remote_env import RemoteEnvironment, server_spec

    args = {"burn_s": burn_s}
    envs = {
        w: load_environment(ENV_ID, **args)
        if w == 0
        else RemoteEnvironment(
            server_spec(ENV_ID, args, "burn", "train", w, 60.0, log_dir / f"w{w}-{burn_s}")
        )
        for w in configs
    }
    loop = asyncio.new_event_loop()
    acc = {w: [0.0, 0.0, 0.0] for w in configs}  # seconds, our CPU seconds, idle CPU seconds
    try:
        for w, env in envs.items():
            loop.run_until_complete(_drive(env, 4 * max(1, w)))  # every worker has loaded and answered
        pids = _family()
        for _ in range(rounds):
            for w, env in envs.items():
                c0, i0 = _cpu_snapshot(pids)
                dt = loop.run_until_complete(_drive(env, n // rounds))
                c1, i1 = _cpu_snapshot(pids)
                for k, v in enumerate((dt, c1 - c0, i1 - i0)):
                    acc[w][k] += v
    finally:
        for env in envs.values():
            if isinstance(env, RemoteEnvironment):
                loop.run_until_complete(env.aclose())
        loop.close()
    done = rounds * (n // rounds)
    return {
        w: {"rollouts_per_s": done / dt, "cores_ours": cpu / dt, "cores_idle": idle / dt}
        for w, (dt, cpu, idle) in acc.items()
    }


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


def e2e_run(steps: int, workers: int, tmp: Path, tag: str) -> tuple[list[float], float]:
    """One `hpcrl run` of the tiny reverse-text config: time/generate of steps 2..N, and its wall time."""
    from hpcrl.monitor.metrics import read_metrics
    from hpcrl.paths import RunPaths

    cfg, out = tmp / f"e2e_{workers}_{tag}.toml", tmp / f"run_{workers}_{tag}"
    cfg.write_text(E2E.format(steps=steps, workers=workers))
    t0 = time.perf_counter()
    # the run needs only the repository on its path: this folder's renderers.py would shadow the package
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"e2e run (env_workers={workers}) failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    recs = [x for x in read_metrics(RunPaths(out).metrics_file) if x.get("role") == "orchestrator"]
    return [x["time/generate"] for x in recs if x.get("step", 0) >= 2 and "time/generate" in x], wall


def e2e(steps: int, tmp: Path, rounds: int) -> dict[int, dict[str, float]]:
    """env_workers 0 and 1, `rounds` runs each, alternating (0, 1, 0, 1, ...), step times pooled."""
    gen: dict[int, list[float]] = {0: [], 1: []}
    wall: dict[int, list[float]] = {0: [], 1: []}
    for k in range(rounds):
        for w in (0, 1):
            g, t = e2e_run(steps, w, tmp, str(k))
            gen[w] += g
            wall[w].append(t)
    return {
        w: {
            "generate_s_mean": statistics.mean(gen[w]),
            "generate_s_median": statistics.median(gen[w]),
            "wall_s_mean": statistics.mean(wall[w]),
            "runs": rounds,
        }
        for w in (0, 1)
    }


class DelayModel:
    """A ChatClient whose every request (one turn, or a group's n choices) takes `delay` seconds:
    inference as a fixed wait, so that only what the env path adds to a step varies."""

    def __init__(self, delay: float):
        self.delay = delay

    def _turn(self):
        from hpcrl.envs.base import Turn

        return Turn("olleh", list(range(40)), list(range(8)), [-0.1] * 8, [0] * 8)

    async def chat(self, messages, tools, sampling):
        await asyncio.sleep(self.delay)
        return self._turn()

    async def chat_group(self, messages, tools, sampling, n):
        await asyncio.sleep(self.delay)
        return [self._turn() for _ in range(n)]


def step_ipc(steps: int, tmp: Path, delay: float = 0.1) -> dict[str, float]:
    """The e2e runs' step (8 groups x 4 rollouts of reverse-text, through the orchestrator's own
    run_group) with inference replaced by a fixed `delay`: in-process and through an env server
    with 1 worker, step by step in turn. What the env IPC adds to a step, without the trainer's and
    the inference engine's noise in it."""
    from hpcrl.envs.registry import load_environment
    from hpcrl.orchestrator.remote_env import RemoteEnvironment, server_spec
    from hpcrl.orchestrator.rollout import run_group

    envs = {
        0: load_environment("reverse-text"),
        1: RemoteEnvironment(server_spec("reverse-text", {}, "rt", "train", 1, 60.0, tmp / "step-ipc")),
    }
    model = DelayModel(delay)

    async def one_step(env, k: int) -> float:
        tasks = env.tasks("train")
        t0 = time.perf_counter()
        await asyncio.gather(
            *(run_group(env, tasks[(8 * k + i) % len(tasks)], 4, {}, lambda _: model) for i in range(8))
        )
        return time.perf_counter() - t0

    async def main() -> tuple[dict[int, list[float]], dict[int, float]]:
        times: dict[int, list[float]] = {0: [], 1: []}
        cpu = {0: 0.0, 1: 0.0}  # CPU seconds of this process, the env server and its worker
        for k in range(3):  # warm-up: the worker has loaded and answered
            for env in envs.values():
                await one_step(env, k)
        pids = _family()
        for k in range(3, steps + 3):
            for w, env in envs.items():
                c0, _ = _cpu_snapshot(pids)
                times[w].append(await one_step(env, k))
                cpu[w] += _cpu_snapshot(pids)[0] - c0
        await envs[1].aclose()
        return times, cpu

    times, cpu = asyncio.run(main())
    base, served = statistics.mean(times[0]), statistics.mean(times[1])
    return {
        "model_delay_s": delay,
        "step_s_in_process": base,
        "step_s_env_server": served,
        "overhead_ms_per_step": 1000 * (served - base),
        # every process of ours together (10 ms clock ticks, summed over the steps)
        "cpu_ms_per_step_in_process": 1000 * cpu[0] / steps,
        "cpu_ms_per_step_env_server": 1000 * cpu[1] / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=96)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--e2e-rounds", type=int, default=2, help="runs of each e2e config, alternating")
    p.add_argument("--ipc-steps", type=int, default=30, help="steps of the step_ipc measurement")
    args = p.parse_args(argv)
    out: dict[str, object] = {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs = throughput(args.rollouts, (0, 1, 2), tmp)
        rates = {w: r["rollouts_per_s"] for w, r in runs.items()}
        out["rollouts_per_s"] = {"in_process": rates[0], "workers_1": rates[1], "workers_2": rates[2]}
        out["speedup_2_workers_vs_in_process"] = rates[2] / rates[0]
        out["speedup_1_worker_vs_in_process"] = rates[1] / rates[0]
        # cores_ours: CPU of this process + env server + workers per second of the timed part;
        # cores_idle: what nobody used meanwhile (2 shared cores: the rest went to other processes)
        out["cores"] = {
            name: {
                "ours": runs[w]["cores_ours"],
                "idle": runs[w]["cores_idle"],
                # 20 is the ideal (1 / 50 ms): below it, CPU went to something else than the reward
                "rollouts_per_cpu_s": runs[w]["rollouts_per_s"] / runs[w]["cores_ours"],
            }
            for name, w in (("in_process", 0), ("workers_1", 1), ("workers_2", 2))
        }
        # the same with a reward that costs nothing: what one rollout's trip through the server costs
        trivial = throughput(args.rollouts * 4, (0, 1), tmp, 0.0)
        out["trivial_rollouts_per_s"] = {
            k: trivial[w]["rollouts_per_s"] for k, w in (("in_process", 0), ("workers_1", 1))
        }
        out["ipc_ms_per_rollout"] = 1000 * (
            1 / trivial[1]["rollouts_per_s"] - 1 / trivial[0]["rollouts_per_s"]
        )
        # CPU (all our processes) per rollout through a worker, beyond the in-process path's
        out["ipc_cpu_ms_per_rollout"] = 1000 * (
            trivial[1]["cores_ours"] / trivial[1]["rollouts_per_s"]
            - trivial[0]["cores_ours"] / trivial[0]["rollouts_per_s"]
        )
        ipc = step_ipc(args.ipc_steps, tmp)
        out["step_ipc"] = ipc
        if not args.skip_e2e:
            runs_e2e = e2e(args.steps, tmp, args.e2e_rounds)
            base, served = runs_e2e[0], runs_e2e[1]
            out["e2e_in_process"], out["e2e_env_server"] = base, served
            out["step_overhead_pct"] = 100 * (served["generate_s_mean"] / base["generate_s_mean"] - 1)
            # the same overhead measured without the trainer's and inference's noise (step_ipc),
            # as a share of the real in-process step
            out["step_ipc_overhead_pct"] = 100 * ipc["overhead_ms_per_step"] / 1000 / base["generate_s_mean"]
    out["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
