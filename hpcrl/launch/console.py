"""The launcher's console: one line per training step, read from metrics.jsonl as the roles write it,
under a progress bar towards max_steps with an ETA.

On a terminal the bar is a rich live display and the step lines scroll above it. When stdout is not a
terminal (a log file, CI, SLURM output), there is no bar: each step line ends with the ETA instead,
so the file stays plain text.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.launch.alerts import ConsoleAlerts
from hpcrl.launch.dashboard_hint import dashboard_lines
from hpcrl.launch.placement import Placement
from hpcrl.monitor.metrics import MetricsFollower
from hpcrl.paths import RunPaths


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def step_line(step: int, max_steps: int, orch: dict[str, Any], trainer: dict[str, Any]) -> str:
    """Pure: the console line of one step from the orchestrator's and trainer's records."""
    return (
        f"step {step:>4}/{max_steps} | reward {_fmt(orch.get('reward/all/mean'), '.3f')}"
        f" | loss {_fmt(trainer.get('loss/mean'), '.4f')}"
        f" | {_fmt(trainer.get('perf/throughput'), ',.0f')} tok/s"
        f" | lag {_fmt(orch.get('off_policy/mean'), '.1f')}"
        f" | {_fmt(trainer.get('time/step'), '.2f')}s"
    )


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Eta:
    """Time left from the pace since the first step this launcher saw (a resume starts mid-run, so
    the steps before it say nothing about this session's speed)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    def update(self, step: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = (step, now)
        if self.last is None or step > self.last[0]:
            self.last = (step, now)

    def seconds_left(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        per_step = (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
        return max(0, self.max_steps - self.last[0]) * per_step

    def text(self) -> str:
        left = self.seconds_left()
        return "eta -" if left is None else f"eta {fmt_duration(left)}"


class _Bar:
    """The rich progress bar (terminal only); step lines are printed through its console."""

    def __init__(self, max_steps: int, console: Any = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            console=console,
        )
        self.task = self.progress.add_task("train", total=max_steps or None, eta="eta -")
        self.progress.start()

    def print(self, line: str) -> None:
        self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def update(self, step: int, eta: str) -> None:
        self.progress.update(self.task, completed=step, eta=eta)

    def stop(self) -> None:
        self.progress.stop()


class ConsoleReporter:
    def __init__(
        self, paths: RunPaths, max_steps: int, interval: int = 1, bar: bool | None = None, alerts: bool = True
    ):
        self.path = paths.metrics_file
        self.max_steps = max_steps
        self.interval = interval
        # Start at the current end: a resumed run's old records were printed by the old launcher.
        self.follower = MetricsFollower(self.path, self.path.stat().st_size if self.path.exists() else 0)
        self.orch: dict[int, dict[str, Any]] = {}
        self.printed: set[int] = set()
        self.eta = Eta(max_steps)
        self.t0 = time.monotonic()
        self.want_bar = sys.stdout.isatty() if bar is None else bar
        self.bar: _Bar | None = None
        # The roles' WARNING/ERROR lines, between the step lines (hpcrl.launch.alerts)
        self.alerts = ConsoleAlerts(paths) if alerts else None

    @property
    def offset(self) -> int:
        return self.follower.offset

    def banner(self, cfg: Config, placement: Placement, notes: Sequence[str] = ()) -> None:
        """Print the run summary and start the progress display."""
        print(f"hpcrl run: {cfg.model.name} -> {cfg.output_dir} (steps up to {cfg.max_steps})")
        for line in placement.summary():
            print("  " + line)
        print(f"  logs:         {RunPaths(cfg.output_dir).logs_dir}/", flush=True)
        first, tunnel = dashboard_lines(RunPaths(cfg.output_dir).root)
        print(f"  dashboard:    {first}\n                ({tunnel})", flush=True)
        for note in notes:
            print(f"  note:         {note}", flush=True)
        self.interval = cfg.log.console_interval
        if self.want_bar and self.bar is None:
            try:
                self.bar = _Bar(self.max_steps)
            except Exception:  # noqa: BLE001 - no bar is better than no run
                self.bar = None

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.print(line)
        else:
            print(line, flush=True)

    def update(self) -> None:
        for rec in self.follower.poll():
            self._handle(rec)
        for line in self.alerts.poll() if self.alerts is not None else ():
            self._print(line)

    def _handle(self, rec: dict[str, Any]) -> None:
        step = rec.get("step")
        if not isinstance(step, int) or "extra" in rec:
            return
        if rec.get("role") == "orchestrator" and "reward/all/mean" in rec:
            self.orch[step] = rec
        elif rec.get("role") == "trainer" and "loss/mean" in rec and step not in self.printed:
            self.printed.add(step)
            self.eta.update(step)
            if step % self.interval == 0 or step == self.max_steps:
                line = step_line(step, self.max_steps, self.orch.pop(step, {}), rec)
                self._print(line if self.bar is not None else f"{line} | {self.eta.text()}")
            self.orch.pop(step, None)
            if self.bar is not None:
                self.bar.update(step, self.eta.text())
        elif rec.get("role") == "orchestrator" and any(k.startswith("eval/") for k in rec):
            evals = " ".join(
                f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("eval/") and isinstance(v, float)
            )
            self._print(f"eval @ step {step}: {evals}")

    def finish(self) -> None:
        self.update()
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        print(f"elapsed {fmt_duration(time.monotonic() - self.t0)}", flush=True)
