"""`hpcrl plot OUTPUT_DIR`: PNG plots of a run's metrics.jsonl, one file per panel, in `<run>/plots/`.

Panels (against the training step): reward (train and eval), loss, entropy, mismatch_kl, throughput
(trainer tokens/s and orchestrator samples/s on two axes), policy lag. `panels()` is pure (records ->
what to draw) so tests check the data; `render()` draws it. A metric the run never logged gives a
panel that says "no data", never an error. matplotlib (Agg) is imported only when drawing, so
`hpcrl plot --help` stays fast.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.fileio import write_atomic
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths

_EVAL_RE = re.compile(r"^eval/([^/]+)/avg@(\d+)$")
_ENV_REWARD_RE = re.compile(r"^reward/([^/]+)/mean$")


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]
    axis: int = 0  # 1 = the right-hand axis (a second unit in the same panel)
    style: str = "-"


@dataclass
class Panel:
    name: str  # file stem: plots/<name>.png
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    ylabel2: str = ""

    @property
    def has_data(self) -> bool:
        return any(s.steps for s in self.series)


def collect(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[int, float]]:
    """(role, key) -> {step: value}. A later record of the same step wins: a resumed run redoes the
    steps after its checkpoint and the redone values are the ones training continued from."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in records:
        step, role = r.get("step"), r.get("role", "")
        if not isinstance(step, int):
            continue
        for k, v in r.items():
            if k in ("role", "step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out.setdefault((role, k), {})[step] = float(v)
    return out


def _series(
    data: dict[tuple[str, str], dict[int, float]],
    key: str,
    label: str | None = None,
    role: str | None = None,
    **kw: Any,
) -> list[Series]:
    """The series of `key` (from `role`, or from whichever role logged it); [] if never logged."""
    for (r, k), points in sorted(data.items()):
        if k == key and (role is None or r == role) and points:
            steps = sorted(points)
            return [Series(label or key, steps, [points[s] for s in steps], **kw)]
    return []


def panels(records: list[dict[str, Any]]) -> list[Panel]:
    """What to draw for these metrics.jsonl records."""
    d = collect(records)
    keys = {k for _, k in d}
    reward = Panel("reward", "Reward", "reward", _series(d, "reward/all/mean", "train reward/all/mean"))
    for env in sorted({m.group(1) for k in keys if (m := _ENV_REWARD_RE.match(k)) and m.group(1) != "all"}):
        reward.series += _series(d, f"reward/{env}/mean", style="--")
    for k in sorted(k for k in keys if _EVAL_RE.match(k)):
        reward.series += _series(d, k, f"eval {k[len('eval/') :]}", style="o-")
    throughput = Panel(
        "throughput",
        "Throughput",
        "trainer tokens/s",
        _series(d, "perf/throughput", "trainer perf/throughput (tok/s)")
        + _series(d, "perf/samples_per_s", "orchestrator perf/samples_per_s", axis=1),
        ylabel2="orchestrator samples/s",
    )
    return [
        reward,
        Panel("loss", "Loss", "loss", _series(d, "loss/mean")),
        Panel("entropy", "Entropy", "nats/token", _series(d, "entropy/mean")),
        Panel("mismatch_kl", "Trainer/inference mismatch KL", "KL", _series(d, "mismatch_kl/mean")),
        throughput,
        Panel("policy_lag", "Policy lag (off-policy steps)", "steps", _series(d, "off_policy/mean")),
    ]


def render(panel: Panel, path: Path) -> Path:
    """Draw one panel into a PNG at `path`. Matplotlib's object API on the Agg canvas: no pyplot (its
    import and figure manager cost a short run's launcher about a CPU-second), fixed margins instead
    of tight_layout."""
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.11, right=0.87 if panel.ylabel2 else 0.96, top=0.91, bottom=0.13)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    if not panel.has_data:
        ax.text(
            0.5, 0.5, "no data", ha="center", va="center", fontsize=16, color="gray", transform=ax.transAxes
        )
    axes = {0: ax}
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(s for s in panel.series if s.steps):
        if s.axis not in axes:
            axes[s.axis] = ax.twinx()
            axes[s.axis].set_ylabel(panel.ylabel2)
        axes[s.axis].plot(
            s.steps, s.values, s.style, label=s.label, color=colors[i % len(colors)], markersize=3
        )
    handles = [h for a in axes.values() for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, [png.getbuffer()], durable=False)  # a viewer refreshing never sees half a PNG
    return path


def write_plots(paths: RunPaths, out_dir: Path | None = None) -> list[Path]:
    """Write every panel of the run's metrics.jsonl as `<out_dir or run/plots>/<panel>.png`."""
    out = Path(out_dir) if out_dir is not None else paths.plots_dir
    records = read_metrics(paths.metrics_file)
    return [render(p, out / f"{p.name}.png") for p in panels(records)]


def metrics_of(run_dir: str, prog: str) -> RunPaths | None:
    """The paths of a run directory that holds metrics.jsonl; else None, after one line on stderr
    (the caller exits 2)."""
    paths = RunPaths(run_dir)
    if not paths.metrics_file.is_file():
        print(f"{prog}: {paths.metrics_file} does not exist (is {run_dir} a run directory?)", file=sys.stderr)
        return None
    return paths


def report_plots(paths: RunPaths) -> list[Path]:
    """The launcher's end-of-run call: write the plots and print where they are. Plotting is a
    convenience, so any failure is one printed line, never a failed run."""
    if not paths.metrics_file.is_file():
        return []
    try:
        files = write_plots(paths)
    except Exception as e:  # noqa: BLE001 - e.g. a broken matplotlib install must not fail the run
        print(f"plots: not written ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return []
    print(f"plots: {paths.plots_dir}/ ({', '.join(f.name for f in files)})", flush=True)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpcrl plot",
        description="Write PNG plots of a run's metrics.jsonl "
        "(reward, loss, entropy, mismatch_kl, throughput, policy lag) into <run>/plots/.",
    )
    ap.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run directory (holds metrics.jsonl)")
    ap.add_argument("--out", metavar="DIR", help="write the PNGs here instead of OUTPUT_DIR/plots")
    args = ap.parse_args(argv)
    paths = metrics_of(args.output_dir, "hpcrl plot")
    if paths is None:
        return 2
    files = write_plots(paths, Path(args.out) if args.out else None)
    print(f"plots: {files[0].parent}/")
    for f in files:
        print(f"  {f.name}")
    return 0
