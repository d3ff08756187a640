"""prime-rl's online evaluation during SFT ([eval], hpcrl.config.sections.sft_eval).

At step 0 (unless skip_first_step; on a resume only with retrigger_on_resume), every `interval`
steps and at the last step, every rank writes the policy's HF weights to evals/step_N/weights/ (one
collective export, as a checkpoint's), and rank 0 starts `hpcrl eval` on them in the background (its
own inference server, the configured envs). Training goes on meanwhile; each finished evaluation's
eval/<env>/{avg@k,pass@k,errored} go to metrics.jsonl at the step it scored (role "eval"). The run
waits for the evaluations still going before it exits; on a stop request they are ended instead.

A failed evaluation (`hpcrl eval` exits non-zero or writes no summary) ends the run, as in prime-rl,
whose launcher ends the trainer when its evals process dies: rank 0 logs one ERROR line naming the
eval env(s) and the cause (the eval's own error line from evals/step_N/eval.out), logs eval/failed
and eval/<env>/failed = 1 at that step, and asks every rank to stop as a stop request does: the
step in progress finishes, a checkpoint is written when [ckpt] is set, and `hpcrl sft` exits 1 with
that line last. A rollout that errors is no failure: it counts in eval/<env>/errored.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config.schema import SFTConfig
from hpcrl.monitor.metrics import Metrics
from hpcrl.paths import EvalPaths, RunPaths

log = logging.getLogger("hpcrl.trainer")


def due_steps(interval: int, max_steps: int, start: int, first: bool, retrigger: bool) -> set[int]:
    """The steps a run from `start` (0 = fresh) to max_steps evaluates: the starting weights (a fresh
    run unless skip_first_step, i.e. `first` False; a resume only with retrigger_on_resume), every
    multiple of `interval` after `start`, and the last step."""
    out = {s for s in range(start + 1, max_steps + 1) if s % interval == 0}
    if max_steps > start:
        out.add(max_steps)
    if (start == 0 and first) or (start > 0 and retrigger):
        out.add(start)
    return out


def eval_run_dict(cfg: SFTConfig, paths: RunPaths, step: int) -> dict[str, Any]:
    """The `hpcrl eval` config that scores step `step`'s weights (EvalRunConfig's fields)."""
    ev = cfg.eval
    assert ev is not None
    d = msgspec.to_builtins(
        {
            "model": str(paths.online_eval_dir(step) / "weights"),
            "env": ev.env,
            "num_examples": ev.num_examples,
            "rollouts_per_example": ev.rollouts_per_example,
            "sampling": ev.sampling,
            "inference": ev.inference,
            "seq_len": ev.seq_len or cfg.data.seq_len or cfg.seq_len,
            "output_dir": str(paths.online_eval_dir(step)),
            "seed": cfg.seed,
            "log": {"level": cfg.log.level},
        }
    )
    return _no_none(d)


def check_eval_config(cfg: SFTConfig) -> None:
    """The `hpcrl eval` config each evaluation gets parses as one (ConfigError naming `eval`): at load,
    not at the first evaluation."""
    from hpcrl.config.schema import EvalRunConfig
    from hpcrl.errors import ConfigError

    try:
        msgspec.convert(eval_run_dict(cfg, RunPaths(cfg.output_dir), 0), EvalRunConfig)
    except msgspec.ValidationError as e:
        raise ConfigError("eval", f"does not make an `hpcrl eval` config: {e}") from None


def _no_none(x: Any) -> Any:
    """TOML has no null: an unset field is left out (its default is the same None)."""
    if isinstance(x, dict):
        return {k: _no_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_no_none(v) for v in x]
    return x


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """summary.json of `hpcrl eval` -> eval/<env>/{avg@k,pass@k,errored} (the orchestrator's names)."""
    out: dict[str, float] = {}
    for env, s in summary.get("envs", {}).items():
        k = s["rollouts_per_example"]
        out[f"eval/{env}/avg@{k}"] = float(s[f"avg@{k}"])
        out[f"eval/{env}/pass@{k}"] = float(s[f"pass@{k}"])
        out[f"eval/{env}/errored"] = float(s["errored"])
    return out


# The line of an eval's output that says why it failed, newest first: a user error's one line, an
# exception's last traceback line, an ERROR log line.
CAUSE = re.compile(r"^(config error|hpcrl: error|[\w.]*(Error|Exception|Exit)\b)[^:]*: |\bERROR\b")
ENV_INDEX = re.compile(r"\benv\[(\d+)\]")


def failure_cause(text: str, envs: list[str]) -> str:
    """One line: why an `hpcrl eval` failed, from its output `text`; its env[i] become eval.env[i]
    (name), the field and env of the SFT config."""
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if CAUSE.search(x)), lines[-1] if lines else "no output")

    def named(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return f"eval.env[{i}] ({envs[i]})" if i < len(envs) else f"eval.env[{i}]"

    line = ENV_INDEX.sub(named, line)
    return line if len(line) <= 400 else line[:397] + "..."


def tail(path: Path, size: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def eval_devices(visible: list[str], train_ranks: int, num_infer_gpus: int | None) -> list[str] | None:
    """The GPUs of the evaluations' inference server: the num_infer_gpus (default 1) visible after the
    trainer ranks' (prime-rl's deployment.num_infer_gpus beside num_train_gpus). None: no GPU, or none
    left (the server then shares the trainer's)."""
    free = visible[train_ranks:]
    want = num_infer_gpus or 1
    return free[:want] if visible and len(free) >= want else None


def visible_devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d for d in env.split(",") if d] if env else [str(i) for i in range(torch.cuda.device_count())]


@dataclass
class Running:
    step: int
    proc: subprocess.Popen
    t0: float


class OnlineEvals:
    """One run's online evaluations (every rank holds one; rank 0 starts and collects them)."""

    def __init__(self, cfg: SFTConfig, paths: RunPaths, rank: int, start: int):
        ev = cfg.eval
        assert ev is not None
        self.cfg, self.paths, self.rank = cfg, paths, rank
        self.steps = due_steps(
            ev.interval, cfg.max_steps, start, not ev.skip_first_step, ev.retrigger_on_resume
        )
        self.running: list[Running] = []
        self.metrics = Metrics(paths, "eval", enabled=rank == 0)
        self.failed: list[int] = []
        self.error: str | None = None  # the first failure's line (rank 0): the run ends with it
        self.ending = False  # we end the running evals (a stop): their exits are no failures
        self.envs = [e.name or e.id.rsplit("/", 1)[-1] for e in ev.env]  # orchestrator.setup.env_name
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        visible = visible_devices() if rank == 0 else []
        world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))  # this node's
        gpus = eval_devices(visible, world, cfg.deployment.num_infer_gpus)
        if gpus is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        elif visible:
            log.warning(
                "online evals: no GPU left beside the %d trainer rank(s): they share the trainer's", world
            )

    def maybe_start(self, tr: Any, step: int) -> float:
        """Collective at a due step (the weights export); seconds spent. Then collects finished ones."""
        t0 = time.perf_counter()
        if step in self.steps:
            self._start(tr, step)
        self.collect()
        return time.perf_counter() - t0

    def _start(self, tr: Any, step: int) -> None:
        from hpcrl.config.resolved import dumps
        from hpcrl.config.secrets import externalize
        from hpcrl.trainer.stream import export_hf_streamed

        out = self.paths.online_eval_dir(step)
        export_hf_streamed(
            tr.model, tr.tokenizer, str(out / "weights"), rank=self.rank, dtype=tr.precision.compute
        )
        if self.rank != 0:
            return
        cfg_file = out / "eval.toml"
        safe, secret_env = externalize(eval_run_dict(self.cfg, self.paths, step))  # no secret in a file
        cfg_file.write_text(dumps(safe))
        log_file = open(out / "eval.out", "ab")  # noqa: SIM115 - the child's, closed by the OS at its exit
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpcrl.cli", "eval", "@", str(cfg_file)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its inference server too: one process group to end on a stop
            env={**self.env, **secret_env},
        )
        log_file.close()
        self.running.append(Running(step, proc, time.monotonic()))
        log.info("online eval of step %d started (pid %d): %s", step, proc.pid, out)

    def collect(self, wait: bool = False) -> None:
        """Log every finished evaluation (all of them with `wait`)."""
        still: list[Running] = []
        for r in self.running:
            rc = r.proc.wait() if wait else r.proc.poll()
            if rc is None:
                still.append(r)
            else:
                self._finished(r, rc)
        self.running = still

    def check_failed(self) -> bool:
        """Whether an evaluation has failed (rank 0's answer; collects the finished ones first)."""
        self.collect()
        return self.error is not None

    def _finished(self, r: Running, rc: int) -> None:
        out = self.paths.online_eval_dir(r.step)
        summary = EvalPaths(out).summary_file
        if self.ending and rc != 0:
            log.info("online eval of step %d ended (the run is stopping)", r.step)
            return
        if rc != 0 or not summary.exists():
            self.failed.append(r.step)
            self.metrics.log(r.step, {"eval/failed": 1.0} | {f"eval/{e}/failed": 1.0 for e in self.envs})
            cause = failure_cause(tail(out / "eval.out"), self.envs)
            line = (
                f"online eval of step {r.step} ({', '.join(self.envs)}) failed (exit {rc}): {cause}; "
                f"see {out / 'eval.out'}"
            )
            log.error("%s", line)
            self.error = self.error or line
            return
        m = summary_metrics(json.loads(summary.read_text()))
        self.metrics.log(r.step, m | {"time/eval": time.monotonic() - r.t0})
        log.info("online eval of step %d: %s", r.step, ", ".join(f"{k} {v:.4g}" for k, v in m.items()))

    def close(self, stopping: bool) -> None:
        """Wait for the evaluations still going (a stop request ends them: their process groups)."""
        if stopping:
            self.ending = True
            for r in self.running:
                try:
                    os.killpg(r.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        elif self.running:
            log.info("waiting for %d online eval(s) to finish", len(self.running))
        self.collect(wait=True)
        self.metrics.close()
