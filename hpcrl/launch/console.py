"""The launcher's console: one line per training step, read from metrics.jsonl as the roles write it."""

from __future__ import annotations

import json
import time
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.launch.layout import Layout
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


class ConsoleReporter:
    def __init__(self, paths: RunPaths, max_steps: int):
        self.path = paths.metrics_file
        self.max_steps = max_steps
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.orch: dict[int, dict[str, Any]] = {}
        self.printed: set[int] = set()
        self.t0 = time.monotonic()

    def banner(self, cfg: Config, layout: Layout) -> None:
        print(f"hpcrl run: {cfg.model.name} -> {cfg.output_dir} (steps up to {cfg.max_steps})")
        for line in layout.summary():
            print("  " + line)
        print(f"  logs:         {RunPaths(cfg.output_dir).logs_dir}/", flush=True)

    def update(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for raw in data[: end + 1].splitlines():
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                continue
            self._handle(rec)

    def _handle(self, rec: dict[str, Any]) -> None:
        step = rec.get("step")
        if not isinstance(step, int):
            return
        if rec.get("role") == "orchestrator" and "reward/all/mean" in rec:
            self.orch[step] = rec
        elif rec.get("role") == "trainer" and "loss/mean" in rec and step not in self.printed:
            self.printed.add(step)
            print(step_line(step, self.max_steps, self.orch.get(step, {}), rec), flush=True)
        elif rec.get("role") == "orchestrator" and any(k.startswith("eval/") for k in rec):
            evals = " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("eval/") and isinstance(v, float))
            print(f"eval @ step {step}: {evals}", flush=True)

    def finish(self) -> None:
        self.update()
        print(f"elapsed {time.monotonic() - self.t0:.1f}s", flush=True)
