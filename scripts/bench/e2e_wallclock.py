"""Reward per wall-clock (`python scripts/bench/e2e.py --mode wallclock`): hpcrl vs TRL GRPOTrainer
from the same SFT-warmed tiny model, for the same wall-clock budget each, over a learning-rate sweep.

    python scripts/bench/e2e.py --mode wallclock                          # demo lr 2e-3, 120 s each
    python scripts/bench/e2e.py --mode wallclock --lr 2e-3,5e-4,2.5e-4 --repeats 2

Both systems start from the demo's warm-up (configs/demo/sft.toml, run once and cached under --out),
on the workload of configs/bench/e2e_wallclock.toml (the demo's task, batch and sampling; the TRL
runner reads the same file and the same overrides, so the two sides cannot drift). Each run is
stopped --budget-s seconds after its launch (start-up included: a user waits for it). The two
systems run one after the other, in alternating order from one run to the next so that slow drift of
the machine's load does not always hit the same side.

Why a sweep: with the demo's lr (2e-3) both systems reach the task's ceiling (~0.75-0.88 for this
0.34 M-parameter model at temperature 1) well inside 120 s, so the reward at 120 s compares two
plateaus, not two speeds. A smaller lr stretches the climb over the budget, which is the regime real
models are in; the sweep shows both regimes side by side, every cell measured, none dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import e2e

REPO = e2e.REPO
WALLCLOCK_CONFIG = "configs/bench/e2e_wallclock.toml"
REWARD_MARGIN = 0.2
PLOT_NAME = "e2e_wallclock.png"  # under --out; --update-docs copies it to DOCS_PLOT
DOCS_PLOT = REPO / "docs/img" / PLOT_NAME
SYSTEMS = ("hpcrl", "trl")
REACH = (0.6, 0.7)


# ---------------------------------------------------------------------------------------------
# Pure part (unit-tested in tests/unit/test_bench_e2e.py)
# ---------------------------------------------------------------------------------------------
def run_order(index: int) -> tuple[str, str]:
    """hpcrl first on even runs, TRL first on odd ones."""
    return SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]


def cell(records: Sequence[dict[str, Any]], launched: float, budget_s: float) -> dict[str, Any]:
    """One run's figures: reward in the last 20 s window before the budget, steps by then, and the
    seconds until 10 consecutive batches average each of REACH."""
    curve = e2e.reward_by_clock(records, launched, budget_s)
    t, reward, steps = curve[-1] if curve else (budget_s, None, 0)
    return {
        "reward": reward,
        "steps": steps,
        "reach": {str(x): e2e.time_to_reward(records, launched, x) for x in REACH},
        "curve": curve,
    }


def ended_early(
    records: Sequence[dict[str, Any]], launched: float, budget_s: float, slack: float = 20.0
) -> float | None:
    """Seconds after launch of the last trainer record if the run stopped more than `slack` seconds
    before the budget (a step cap or a crash), else None: its reward at the budget would be missing."""
    times = [r["time"] for r in e2e.by_step(records, "trainer", "time/step").values()]
    if not times:
        return 0.0
    last = max(times) - launched
    return last if last < budget_s - slack else None


def median_of(cells: Sequence[dict[str, Any]], key: str) -> float | None:
    return e2e.median(c[key] for c in cells)


def sweep_rows(results: dict[str, list[dict[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """``results[lr] = [{system: cell}, ...]`` (one dict per repeat) -> one row per lr with the
    medians over repeats and the difference of the medians."""
    rows = []
    for lr, runs in results.items():
        row: dict[str, Any] = {"lr": lr, "runs": len(runs)}
        for name in SYSTEMS:
            cells = [r[name] for r in runs if name in r]
            row[name] = median_of(cells, "reward")
            row[f"{name} steps"] = median_of(cells, "steps")
            for x in REACH:
                row[f"{name} reach {x}"] = e2e.median(c["reach"][str(x)] for c in cells)
        h, t = row["hpcrl"], row["trl"]
        row["delta"] = None if h is None or t is None else h - t
        rows.append(row)
    return rows


def format_sweep(rows: Sequence[dict[str, Any]], budget_s: float) -> str:
    f = e2e._f
    head = [
        "lr",
        "runs",
        f"hpcrl @{budget_s:.0f}s",
        f"TRL @{budget_s:.0f}s",
        "hpcrl - TRL",
        "steps hpcrl / TRL",
        *(f"s to {x} hpcrl / TRL" for x in REACH),
    ]
    table = [head]
    for r in rows:
        table.append(
            [
                r["lr"],
                str(r["runs"]),
                f(r["hpcrl"], ".3f"),
                f(r["trl"], ".3f"),
                f(r["delta"], "+.3f"),
                f"{f(r['hpcrl steps'], '.0f')} / {f(r['trl steps'], '.0f')}",
                *(f"{f(r[f'hpcrl reach {x}'], '.0f')} / {f(r[f'trl reach {x}'], '.0f')}" for x in REACH),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict_lines(rows: Sequence[dict[str, Any]], budget_s: float) -> list[str]:
    out = []
    for r in rows:
        if r["delta"] is None:
            out.append(f"lr {r['lr']}: a side has no reward at {budget_s:.0f} s (see FAILED lines)")
            continue
        ok = "meets target" if r["delta"] >= REWARD_MARGIN else "below target"
        out.append(
            f"lr {r['lr']}: reward at {budget_s:.0f} s (median of {r['runs']}): hpcrl {r['hpcrl']:.3f}, "
            f"TRL {r['trl']:.3f}, difference {r['delta']:+.3f} (target >= +{REWARD_MARGIN}): {ok}"
        )
    tuned = [r for r in rows if r["hpcrl"] is not None and r["trl"] is not None]
    if len(tuned) > 1:
        bh = max(tuned, key=lambda r: r["hpcrl"])
        bt = max(tuned, key=lambda r: r["trl"])
        out.append(
            f"each side at its own best lr: hpcrl {bh['hpcrl']:.3f} (lr {bh['lr']}) vs TRL {bt['trl']:.3f} "
            f"(lr {bt['lr']}): {bh['hpcrl'] - bt['trl']:+.3f}"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def sft_warmup(out_root: Path, threads: int) -> Path:
    """The demo's warm-up (scripts/demo.sh steps 1-2), run once: its final weights dir, cached."""
    sft = out_root / "sft"
    found = sorted(sft.glob("weights/step_*/config.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    if found:
        print(f"reusing the SFT warm-up {found[-1].parent}", flush=True)
        return found[-1].parent
    data = out_root / "sft-data" / "train.jsonl"
    print(f"SFT warm-up (configs/demo/sft.toml) -> {sft}", flush=True)
    make = [sys.executable, "-m", "hpcrl.trainer.sft_data", "make-demo", str(data)]
    make += ["--task", "reverse-text-demo", "--n", "2000", "--seed", "0"]
    sft_cmd = [
        sys.executable,
        "-m",
        "hpcrl.cli",
        "sft",
        "configs/demo/sft.toml",
        "--clean-output-dir",
        "true",
    ]
    sft_cmd += ["--output-dir", str(sft), "--data.name", str(data)]
    for cmd in (make, sft_cmd):
        with open(out_root / "sft.log", "ab") as fh:
            subprocess.run(
                cmd, cwd=REPO, env=e2e.child_env(threads), stdout=fh, stderr=subprocess.STDOUT, check=True
            )
    return sft_warmup(out_root, threads)


def command(name: str, out: Path, weights: Path, args: argparse.Namespace, lr: str) -> list[str]:
    """The same workload overrides for both sides: the warm-up's weights and the lr."""
    overrides = ["--model.name", str(weights), "--trainer.optim.lr", lr]
    if name == "hpcrl":
        return [sys.executable, "-m", "hpcrl.cli", "run", WALLCLOCK_CONFIG, "--output-dir", str(out)] + [
            "--max-steps",
            str(args.steps),
            *overrides,
        ]
    runner = [sys.executable, str(REPO / "scripts/bench/_trl_runner.py"), WALLCLOCK_CONFIG, "--out", str(out)]
    return runner + ["--steps", str(args.steps), "--threads", str(args.threads), *overrides]


def run_one(name: str, out: Path, cmd: list[str], args: argparse.Namespace) -> tuple[list[dict], float, int]:
    if out.exists():
        shutil.rmtree(out)
    launched, code = e2e.run_until_budget(
        cmd, out / "metrics.jsonl", out.parent / f"{name}.log", args.budget_s, args.threads, from_launch=True
    )
    return e2e.read_records(out / "metrics.jsonl"), launched, code


def run_wallclock(args: argparse.Namespace, out_root: Path) -> int:
    weights = sft_warmup(out_root, max(args.threads, os.cpu_count() or 1))
    lrs = [x.strip() for x in args.lr.split(",")]  # checked by e2e.parse_args
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict[str, dict[str, Any]]]] = {lr: [] for lr in lrs}
    failed: list[str] = []
    first: dict[str, tuple[list[dict], float]] = {}
    index = 0
    for rep in range(args.repeats):
        for lr in lrs:
            cells: dict[str, dict[str, Any]] = {}
            for name in run_order(index):
                out = out_root / f"lr{lr}-r{rep}" / name
                print(
                    f"[lr {lr}, run {rep + 1}/{args.repeats}] {name}: {args.budget_s:.0f} s from launch",
                    flush=True,
                )
                records, launched, code = run_one(name, out, command(name, out, weights, args, lr), args)
                cells[name] = cell(records, launched, args.budget_s)
                log = out.parent / f"{name}.log"
                early = ended_early(records, launched, args.budget_s)
                if code != 0 or early is not None:
                    why = (
                        f"exit code {code}"
                        if code != 0
                        else f"stopped {early:.0f} s after launch, before the budget"
                    )
                    failed.append(f"lr {lr} run {rep + 1} {name}: {why} (--steps {args.steps}); see {log}")
                if rep == 0:
                    first[f"{name} lr {lr}"] = (records, launched)
            results[lr].append(cells)
            index += 1
    load_after = os.getloadavg()[0]
    rows = sweep_rows(results)
    print()
    for lr in lrs:  # the 20 s curve of each lr's first run
        print(f"lr {lr}, first run:")
        print(e2e.format_clock_table({n: results[lr][0][n]["curve"] for n in SYSTEMS}))
        print()
    print(format_sweep(rows, args.budget_s))
    print()
    for line in verdict_lines(rows, args.budget_s) + [f"FAILED {x}" for x in failed]:
        print(line)
    print(
        f"threads per process: {args.threads}; 1-min load average {load_before:.1f} before, {load_after:.1f} after "
        f"on {os.cpu_count()} cores (runs one after the other; other work on the machine = noisy numbers)"
    )
    plot, *copies = plot_paths(out_root, args.update_docs)
    plot_wallclock(first, lrs, plot, args.budget_s)
    print(f"plot: {plot}")
    for copy in copies:
        shutil.copyfile(plot, copy)
        print(f"docs updated: {copy}")
    summary = {"args": vars(args), "weights": str(weights), "rows": rows, "runs": results, "failed": failed}
    summary["load"] = [load_before, load_after]
    (out_root / "summary_wallclock.json").write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


def plot_paths(out_root: Path, update_docs: bool) -> list[Path]:
    """Where the plot goes: under the run's output dir, and the tracked docs copy only when asked
    (running a benchmark must not dirty the checkout)."""
    return [out_root / PLOT_NAME] + ([DOCS_PLOT] if update_docs else [])


def plot_wallclock(
    runs: dict[str, tuple[list[dict], float]], lrs: Sequence[str], path: Path, budget_s: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lrs), figsize=(5.5 * len(lrs), 4), squeeze=False, sharey=True)
    for ax, lr in zip(axes[0], lrs):
        for name in SYSTEMS:
            records, launched = runs.get(f"{name} lr {lr}", ([], 0.0))
            orch = e2e.by_step(records, "orchestrator", "reward/all/mean")
            pts = sorted(
                (r["time"] - launched, r["reward/all/mean"])
                for r in orch.values()
                if r["time"] - launched <= budget_s
            )
            if not pts:
                continue
            xs, ys = zip(*pts)
            smooth = [e2e._mean(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))]
            (line,) = ax.plot(xs, smooth, label=f"{name} ({len(pts)} batches; mean of last 10)")
            ax.scatter(xs, ys, s=5, alpha=0.25, color=line.get_color())
        ax.set_title(f"lr {lr}")
        ax.set_xlabel("seconds since launch")
        ax.set_xlim(0, budget_s)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("train reward (batch mean)")
    fig.suptitle("reverse-text-demo from the same SFT warm-up: reward vs wall clock (first run per lr)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
