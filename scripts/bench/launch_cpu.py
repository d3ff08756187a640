"""CPU-seconds of a tiny `hpcrl run`, per process, for this checkout and a baseline side by side.

    python scripts/bench/launch_cpu.py --base /tmp/base        # a worktree: git worktree add /tmp/base REV
    python scripts/bench/launch_cpu.py --base /tmp/base --runs 5 --new-args "--log.plots false"

Each run starts `python -m hpcrl.cli run` on the built-in tiny model (reverse-text, 2 steps by default)
with the checkout on PYTHONPATH, so the launcher and every role it starts import that checkout's code.
Runs alternate between the checkouts (the machine's noise hits both alike). The total is exact (the
launcher's reaped children, getrusage); the per-process split samples /proc every 50 ms, so a process
loses the CPU of its last few milliseconds. Start-up dominates a tiny run: this is what the test suite
pays per `hpcrl run` (docs/architecture.md section 8). `--args` go to both checkouts' runs,
`--new-args` to this checkout's only (a flag the baseline does not know).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = """max_steps = {steps}
seq_len = 128
[model]
name = "hpcrl/tiny-qwen3"
[orchestrator]
batch_size = 16
rollouts_per_example = 4
[orchestrator.train.sampling]
max_tokens = 16
[[orchestrator.train.env]]
id = "reverse-text"
"""
ROLES = ("launcher", "inference", "trainer", "orchestrator", "env server", "env worker", "other")
_TICK = os.sysconf("SC_CLK_TCK")


def role_of(cmdline: str, is_launcher: bool) -> str:
    """Which part of a run a process is, from its command line."""
    if is_launcher:
        return "launcher"
    for marker, role in (
        ("envs.runtime.server", "env server"),
        ("envs.runtime.worker", "env worker"),
        ("cli inference", "inference"),
        ("cli trainer", "trainer"),
        ("cli orchestrator", "orchestrator"),
    ):
        if marker in cmdline:
            return role
    return "other"


def by_role(samples: dict[int, tuple[str, float]]) -> dict[str, float]:
    """{role: CPU-s} from {pid: (role, last CPU-s seen)}."""
    out = dict.fromkeys(ROLES, 0.0)
    for role, cpu in samples.values():
        out[role] += cpu
    return out


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """{pid: (ppid, CPU-s, cmdline)} of every readable process."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, cmd)
    return table


def one_run(
    checkout: Path, steps: int, extra: list[str], cache: Path
) -> tuple[float, float, dict[str, float]]:
    """(wall s, exact total CPU-s, per-role sampled CPU-s) of one tiny run of `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "rl.toml"
        cfg.write_text(CONFIG.format(steps=steps))
        env = {**os.environ, "PYTHONPATH": str(checkout), "HPCRL_CACHE": str(cache)}
        cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", f"{tmp}/run", *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seen: dict[int, tuple[str, float]] = {}
        while proc.poll() is None:
            table = _proc_table()
            for pid, (_, cpu, cmdline) in table.items():
                p, hops = pid, 0
                while p not in (proc.pid, 0, 1) and p in table and hops < 16:
                    p, hops = table[p][0], hops + 1
                if p == proc.pid:  # a role keeps its name once seen (an exited one's cmdline is empty)
                    known = seen.get(pid, ("other", 0.0))[0]
                    role = known if known != "other" else role_of(cmdline, pid == proc.pid)
                    seen[pid] = (role, cpu)
            time.sleep(0.05)
        wall = time.monotonic() - t0
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.returncode != 0:
            raise SystemExit(f"run of {checkout} failed (exit {proc.returncode}):\n{err[-2000:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, total, by_role(seen)


def table(results: dict[str, list[tuple[float, float, dict[str, float]]]]) -> str:
    """Medians per checkout and role, and new/base ratios when there is a baseline."""
    names = list(results)
    rows = [("", *names, *(["new/base"] if len(names) == 2 else []))]

    def med(name: str, pick) -> float:
        return statistics.median(pick(r) for r in results[name])

    picks = [("wall s", lambda r: r[0]), ("CPU-s, total (exact)", lambda r: r[1])]
    picks += [(f"  {role}", lambda r, role=role: r[2][role]) for role in ROLES]
    for label, pick in picks:
        vals = [med(n, pick) for n in names]
        ratio = [f"{vals[1] / vals[0]:.2f}" if vals[0] > 0.05 else "-"] if len(names) == 2 else []
        rows.append((label, *(f"{v:.2f}" for v in vals), *ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, help="a baseline checkout (e.g. a git worktree) to run side by side")
    ap.add_argument("--runs", type=int, default=3, help="runs per checkout (default 3)")
    ap.add_argument("--steps", type=int, default=2, help="max_steps of each run (default 2)")
    ap.add_argument("--args", default="", help="arguments for every run, e.g. '--max-steps 4'")
    ap.add_argument("--new-args", default="", help="arguments for this checkout's runs only")
    a = ap.parse_args(argv)
    checkouts = {"base": (a.base.resolve(), shlex.split(a.args))} if a.base else {}
    checkouts["new"] = (REPO, shlex.split(a.args) + shlex.split(a.new_args))
    results: dict[str, list] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as cache:  # the tiny model is built once, by a warm-up run
        one_run(REPO, 1, checkouts["new"][1], Path(cache))
        for i in range(a.runs):
            for name, (path, extra) in checkouts.items():
                results[name].append(one_run(path, a.steps, extra, Path(cache)))
                print(f"run {i + 1}/{a.runs} {name}: {results[name][-1][1]:.2f} CPU-s", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
