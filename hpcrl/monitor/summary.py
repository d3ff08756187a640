"""Did the run learn? A few lines from a run's metrics.jsonl: eval before -> after, train reward over
the first steps -> the last steps, the delta, and where the plots are.

    python -m hpcrl.monitor.summary RUN_DIR [--window N] [--sft-dir DIR] [--wall-s S]

The train reward of one step is a mean over one batch of sampled rollouts, so a single step is noisy;
first and last are averaged over `window` steps (clamped to a third of the run, so a short run still
compares disjoint windows). `summarize()` is pure (records -> numbers) so tests check the arithmetic
without a run; scripts/demo.sh prints `format_summary()` at the end.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.monitor.metrics import read_metrics
from hpcrl.monitor.plots import _EVAL_RE, collect, metrics_of
from hpcrl.paths import RunPaths

TRAIN_KEY = "reward/all/mean"
SFT_LOSS_KEY = "loss/mean"


@dataclass
class Summary:
    steps: int = 0
    window: int = 0
    train_first: float | None = None
    train_last: float | None = None
    # "eval/<env>/avg@k" -> (first step, value), (last step, value); equal steps = one eval only.
    eval_before: dict[str, tuple[int, float]] = field(default_factory=dict)
    eval_after: dict[str, tuple[int, float]] = field(default_factory=dict)
    pass_before: dict[str, float] = field(default_factory=dict)  # "eval/<env>/pass@k" at those steps
    pass_after: dict[str, float] = field(default_factory=dict)
    elapsed_s: float | None = None

    @property
    def delta(self) -> float | None:
        if self.train_first is None or self.train_last is None:
            return None
        return self.train_last - self.train_first


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def effective_window(n_steps: int, window: int) -> int:
    """`window`, but at most a third of the run so first and last never overlap (and >= 1)."""
    return max(1, min(window, n_steps // 3))


def summarize(
    records: list[dict[str, Any]], window: int = 10, key: str = TRAIN_KEY, role: str = "orchestrator"
) -> Summary:
    """Numbers of one run from its metrics.jsonl records (a later record of a step wins, as in plots)."""
    data = collect(records)
    s = Summary()
    points = data.get((role, key), {})
    steps = sorted(points)
    if steps:
        s.steps = len(steps)
        s.window = effective_window(len(steps), window)
        s.train_first = _mean([points[k] for k in steps[: s.window]])
        s.train_last = _mean([points[k] for k in steps[-s.window :]])
    for (_, k), evals in sorted(data.items()):
        if _EVAL_RE.match(k) and evals:
            first, last = min(evals), max(evals)
            s.eval_before[k] = (first, evals[first])
            s.eval_after[k] = (last, evals[last])
            passes = data.get((role, k.replace("/avg@", "/pass@")), {})
            if first in passes and last in passes:
                s.pass_before[k.replace("/avg@", "/pass@")] = passes[first]
                s.pass_after[k.replace("/avg@", "/pass@")] = passes[last]
    times = [r["time"] for r in records if r.get("role") == role and isinstance(r.get("time"), (int, float))]
    if len(times) >= 2:
        s.elapsed_s = max(times) - min(times)
    return s


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_summary(
    rl: Summary, sft: Summary | None = None, wall_s: float | None = None, plots_dir: Path | None = None
) -> str:
    lines = ["== summary =="]
    if sft is not None and sft.steps:
        lines.append(
            f"SFT loss (mean of {sft.window} steps): {_f(sft.train_first)} -> {_f(sft.train_last)} "
            f"over {sft.steps} steps"
        )
    for k, (step0, before) in rl.eval_before.items():
        step1, after = rl.eval_after[k]
        line = (
            f"eval {k[len('eval/') :]}: {before:.3f} (policy {step0}) -> {after:.3f} (policy {step1}), "
            f"delta {after - before:+.3f}"
        )
        # pass@k (share of prompts with a reward-1 sample) says how often the answer is exactly right.
        pk = k.replace("/avg@", "/pass@")
        if pk in rl.pass_before:
            line += f"; pass@{k.rpartition('@')[2]} {rl.pass_before[pk]:.3f} -> {rl.pass_after[pk]:.3f}"
        lines.append(line)
    if not rl.eval_before:
        lines.append("eval: none logged")
    delta = rl.delta
    lines.append(
        f"train {TRAIN_KEY} (mean of {rl.window} steps): first {_f(rl.train_first)} -> last "
        f"{_f(rl.train_last)}, delta {'n/a' if delta is None else f'{delta:+.3f}'} over {rl.steps} RL steps"
    )
    if wall_s is not None:
        lines.append(f"wall time: {wall_s:.0f} s ({wall_s / 60:.1f} min)")
    if plots_dir is not None:
        pngs = sorted(p.name for p in Path(plots_dir).glob("*.png"))
        lines.append(f"plots: {plots_dir}/ ({', '.join(pngs) if pngs else 'none written'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hpcrl.monitor.summary",
        description="Eval before -> after and train reward first -> last steps of a run.",
    )
    ap.add_argument("run_dir", help="RL run directory (holds metrics.jsonl)")
    ap.add_argument("--window", type=int, default=10, help="steps averaged at each end (default 10)")
    ap.add_argument("--sft-dir", help="also report the SFT loss of this `hpcrl sft` run directory")
    ap.add_argument("--wall-s", type=float, help="total wall time to report (seconds)")
    args = ap.parse_args(argv)
    paths = metrics_of(args.run_dir, "summary")
    if paths is None:
        return 2
    rl = summarize(read_metrics(paths.metrics_file), args.window)
    sft = None
    if args.sft_dir:
        sft = summarize(
            read_metrics(RunPaths(args.sft_dir).metrics_file), args.window, SFT_LOSS_KEY, "trainer"
        )
    print(format_summary(rl, sft, args.wall_s, paths.plots_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
