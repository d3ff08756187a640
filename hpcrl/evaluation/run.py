"""`hpcrl eval`: score a model on environments before (or without) training.

    envs, tasks  ->  endpoint (given, or a self-started `hpcrl inference`)  ->  k rollouts per task
    (progress bar with ETA)  ->  results.jsonl (one line per rollout) + summary.json + a table

Request seeds use the orchestrator's eval key ("eval", policy 0, env), so with the same seed a
deterministic training run's base-model eval draws the same samples.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from hpcrl.config.schema import EvalRunConfig
from hpcrl.envs.base import Environment, Task
from hpcrl.evaluation import summary as S
from hpcrl.evaluation.args import default_output_dir, slug  # noqa: F401 (default_output_dir: re-exported)
from hpcrl.evaluation.endpoint import Endpoints, load_tokenizer
from hpcrl.evaluation.rollouts import ScoredGroup, make_generator, result_rows, score_all
from hpcrl.fileio import write_atomic
from hpcrl.paths import EvalPaths

log = logging.getLogger("hpcrl.evaluation")


def write_jsonl(path: Any, rows: Sequence[dict[str, Any]]) -> None:
    write_atomic(path, [(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows])


def write_json(path: Any, obj: Any) -> None:
    write_atomic(path, [(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n").encode()])


def plan(
    cfg: EvalRunConfig, paths: EvalPaths | None = None
) -> tuple[dict[str, Environment], list[tuple[str, Environment, Task, int]]]:
    """Load the environments (each in its env server when `paths` is given) and list every
    (env, task, k) to score."""
    from hpcrl.orchestrator.setup import env_name, load_envs

    server_dir = None if paths is None else paths.env_server_dir
    envs = load_envs(cfg.env, "env", kind="eval", server_dir=server_dir)
    jobs = []
    for e in cfg.env:
        name = env_name(e)
        n = e.num_examples if e.num_examples is not None else cfg.num_examples
        tasks = list(envs[name].tasks(cfg.split))
        tasks = tasks if n < 0 else tasks[:n]
        if not tasks:
            raise ValueError(f"env {name!r}: no {cfg.split} tasks to evaluate")
        jobs += [(name, envs[name], t, e.rollouts_per_example or cfg.rollouts_per_example) for t in tasks]
    return envs, jobs


def summarize(cfg: EvalRunConfig, groups: Sequence[ScoredGroup]) -> dict[str, dict[str, Any]]:
    by_env: dict[str, list[ScoredGroup]] = {}
    for g in groups:
        by_env.setdefault(g.env, []).append(g)
    out = {}
    for name, gs in by_env.items():
        k = len(gs[0].records)
        s = S.summarize_env([g.records for g in gs], k, cfg.pass_threshold)
        s["recommendation"] = S.recommendation(s, cfg.no_signal_threshold)
        out[name] = s
    return out


def print_table(summary: dict[str, dict[str, Any]], model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hpcrl eval: {model}")
    for h in S.TABLE_HEADER:
        table.add_column(h, justify="left" if h == "env" else "right", overflow="fold", no_wrap=h != "env")
    for row in S.table_rows(summary):
        table.add_row(*row)
    console = Console(width=max(Console().width, 120))  # a log file or pipe gets the whole table
    console.print(table)
    for name, s in summary.items():
        if s.get("recommendation"):
            console.print(f"[bold yellow]recommendation[/] ({name}): {s['recommendation']}", highlight=False)


class Progress:
    """A rich progress bar over rollouts with elapsed time and ETA (plain log lines when not a TTY)."""

    def __init__(self, total: int, label: str):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rollouts"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        self.task = self.bar.add_task(label, total=total)

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)


def main(cfg: EvalRunConfig) -> int:
    from hpcrl.monitor.logging import setup_logging

    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir("evals", cfg, stamp=True)
    paths = EvalPaths(cfg.output_dir)
    setup_logging("eval", cfg.log.level, log_file=paths.log_file("eval"))
    write_json(paths.config_file, msgspec.to_builtins(cfg))
    from hpcrl.orchestrator.setup import close_envs

    envs, jobs = plan(cfg, paths)
    t0 = time.monotonic()
    try:
        with Endpoints(paths, cfg.client, cfg.inference, cfg.seq_len, cfg.log.level) as ep:
            url = ep.url(cfg.model)
            tokenizer = load_tokenizer(cfg.model, cfg.client, cfg.inference.trust_remote_code)
            groups = asyncio.run(_generate(cfg, url, ep.api_key(), tokenizer, jobs))
    finally:
        close_envs(envs.values())
    rows = [row for g in groups for row in result_rows(g, envs[g.env])]
    write_jsonl(paths.results_file, rows)
    summary = summarize(cfg, groups)
    write_json(
        paths.summary_file,
        {"model": cfg.model, "split": cfg.split, "seconds": time.monotonic() - t0, "envs": summary},
    )
    print_table(summary, cfg.model)
    print(f"hpcrl eval: {len(rows)} rollouts -> {paths.results_file}, {paths.summary_file}", flush=True)
    return 0


async def _generate(
    cfg: EvalRunConfig,
    url: str,
    api_key: str | None,
    tokenizer: Any,
    jobs: list[tuple[str, Environment, Task, int]],
) -> list[ScoredGroup]:
    from hpcrl.orchestrator.chat import openai_sampling

    gen = make_generator(cfg, url, tokenizer, api_key)
    total = sum(k for *_, k in jobs)
    try:
        with Progress(total, "eval") as bar:
            return await score_all(
                gen,
                jobs,
                openai_sampling(cfg.sampling),
                lambda name: ("eval", 0, name),
                on_done=lambda g: bar.advance(len(g.records)),
            )
    finally:
        await gen.pool.aclose()
