"""The W&B sink: ONE writer follows metrics.jsonl and logs every role's records into one W&B run.

Why not W&B's "shared" mode (every process logs to the same run id)? It needs the network for the
whole run and is incompatible with offline mode, which is how clusters without internet log. Here
every role only appends to metrics.jsonl (shared filesystem: works across SLURM nodes), and one thread
in one designated process (the orchestrator by default; `HPCRL_WANDB_WRITER=trainer` moves it) owns
the only W&B run:

- keys keep their names (`reward/all/mean`, `loss/mean`) so W&B groups them into sections; a name
  without a namespace, and the `progress/` namespace that several roles use, get the role added
  (`trainer/loss_tokens`, `progress/trainer/total_samples`) so roles never overwrite each other;
- the x-axis is the `step` key (`define_metric("*", step_metric="step")`), not W&B's internal step:
  the orchestrator runs ahead of the trainer, so records arrive out of step order and W&B would drop
  any `log(step=N)` below its current step;
- the run id is fixed at the first start in `<run>/wandb/run_id` and the byte offset already logged
  is kept in `<run>/wandb/sink_offset`, so a resume continues the same W&B run (`resume="allow"`)
  without logging a record twice;
- `log_extras` records become a `wandb.Table` (samples) and `wandb.Histogram`s (distributions).

wandb is imported only inside the sink thread, and only when W&B is configured.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from hpcrl.fileio import write_text
from hpcrl.monitor.metrics import EXTRA_KEY, MetricsFollower, parse_lines
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.wandb")

WRITER_ENV = "HPCRL_WANDB_WRITER"
SHARED_NAMESPACES = ("progress/",)
SAMPLE_COLUMNS = ("step", "env", "prompt", "completion", "reward", "advantage")


# -- pure mapping ----------------------------------------------------------------------------------
def wandb_key(role: str, key: str, multi_role: bool = True) -> str:
    """The W&B key of metric `key` logged by `role` (see module docstring)."""
    if "/" not in key:
        return f"{role}/{key}"
    if multi_role and key.startswith(SHARED_NAMESPACES):
        ns, rest = key.split("/", 1)
        return f"{ns}/{role}/{rest}"
    return key


def scalar_payload(rec: dict[str, Any], multi_role: bool = True) -> dict[str, float]:
    """Numeric metrics of one scalar record under their W&B keys (null/NaN and strings dropped)."""
    role = str(rec.get("role", "unknown"))
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k in ("role", "step", "time") or v is None or isinstance(v, str):
            continue
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)):
            out[wandb_key(role, k, multi_role)] = v
    return out


def sample_table(rows: list[dict[str, Any]], step: int) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of a samples table: the usual columns first, then any others, sorted."""
    keys = {k for r in rows for k in r}
    cols = [c for c in SAMPLE_COLUMNS if c in keys or c == "step"] + sorted(keys - set(SAMPLE_COLUMNS))
    data = [[step if c == "step" and "step" not in r else r.get(c) for c in cols] for r in rows]
    return cols, data


def default_run_id(paths: RunPaths, name: str) -> str:
    """`<name>-<hash>`: readable in W&B, unique per run directory and per fresh start in it."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "run"
    digest = hashlib.sha1(f"{paths.root}:{time.time_ns()}:{os.getpid()}".encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def run_id(paths: RunPaths, name: str) -> str:
    """The run directory's W&B id: read from `<run>/wandb/run_id`, created there on the first start."""
    f = paths.wandb_run_id_file
    if f.is_file() and (rid := f.read_text().strip()):
        return rid
    rid = default_run_id(paths, name)
    f.parent.mkdir(parents=True, exist_ok=True)
    write_text(f, rid + "\n")
    return rid


def is_writer(cfg: Any, role: str) -> bool:
    """Whether `role` owns the W&B run: `$HPCRL_WANDB_WRITER`, else the orchestrator when the config
    has one (RL), else whoever asks (SFT is one process)."""
    if not hasattr(cfg, "orchestrator"):
        return True  # SFT: its one process writes whatever $HPCRL_WANDB_WRITER says for RL runs
    return (os.environ.get(WRITER_ENV) or "orchestrator") == role


# -- the sink ----------------------------------------------------------------------------------------
class WandbSink:
    """A daemon thread: follow metrics.jsonl every `poll_s` seconds, log new records to W&B."""

    def __init__(
        self,
        wandb_cfg: Any,
        paths: RunPaths,
        name: str,
        multi_role: bool = True,
        poll_s: float = 2.0,
        mode: str | None = None,
        role: str = "orchestrator",
    ):
        self.cfg = wandb_cfg
        self.role = role  # the process this sink runs in
        self.paths = paths
        self.name = name
        self.multi_role = multi_role
        self.poll_s = poll_s
        self.mode = mode or ("offline" if wandb_cfg.offline else os.environ.get("WANDB_MODE") or "online")
        self.follower = MetricsFollower(paths.metrics_file, self._load_offset())
        self.run: Any = None
        self.error: BaseException | None = None
        self.logged = 0
        self.last_step: dict[str, int] = {}
        self.finished: set[str] = set()  # roles that logged their "finished" record
        self._stop = threading.Event()
        self._wait_for: int | None = None
        self._deadline = 0.0
        self._thread = threading.Thread(target=self._main, name="wandb-sink", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> WandbSink:
        self._thread.start()
        return self

    def close(self, wait_for_step: int | None = None, timeout: float = 60.0) -> None:
        """Stop after logging what metrics.jsonl holds. With `wait_for_step` (the final step, after a
        normal finish), first keep following until every role seen has logged that step or `timeout`
        passes: the trainer writes its last record after the orchestrator is done."""
        self._wait_for = wait_for_step
        self._deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout + 30.0)
        if self._thread.is_alive():
            log.warning("W&B sink did not finish in time; the run may lack its last records")

    def _main(self) -> None:
        try:
            self.run = self._init()
            while not self._stop.wait(self.poll_s):
                self._drain()
            self._drain()
            while (
                self._wait_for is not None
                and not self._done(self._wait_for)
                and time.monotonic() < self._deadline
            ):
                time.sleep(min(self.poll_s, 0.5))
                self._drain()
        except BaseException as e:  # never take the orchestrator down: W&B is a mirror of metrics.jsonl
            self.error = e
            log.exception("W&B sink failed; metrics.jsonl is complete, the W&B run may not be")
        finally:
            if self.run is not None:
                self._finish()

    def _finish(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb's service has written the run's last records (seen with
        # offline runs); teardown waits for it, so the run is complete when close() returns and the
        # process may exit (or SLURM may kill the node) right after.
        wandb.teardown()

    def _done(self, step: int) -> bool:
        """Every role seen has logged `step`, and the orchestrator (its final eval follows its last
        training record) has said it is finished when another process writes W&B."""
        waits = "orchestrator" in self.last_step and self.role != "orchestrator"
        return (
            bool(self.last_step)
            and all(s >= step for s in self.last_step.values())
            and (not waits or "orchestrator" in self.finished)
        )

    # -- W&B -------------------------------------------------------------------------------------
    def _init(self) -> Any:
        import wandb

        self.paths.wandb_dir.mkdir(parents=True, exist_ok=True)
        kwargs = dict(
            project=self.cfg.project,
            entity=self.cfg.entity,
            group=getattr(self.cfg, "group", None),
            tags=getattr(self.cfg, "tags", None),
            name=self.cfg.name or self.name,
            id=run_id(self.paths, self.name),
            resume="allow",
            config=self._config(),
            dir=os.environ.get("WANDB_DIR") or str(self.paths.wandb_dir),
            settings=wandb.Settings(console="off", silent=True),
        )
        try:
            run = wandb.init(mode=self.mode, **kwargs)
        except Exception as e:
            if self.mode == "offline":
                raise
            # No credentials or no network: keep the data in an offline run for `wandb sync`.
            log.warning("W&B online init failed (%s); logging offline under %s", e, kwargs["dir"])
            self.mode = "offline"
            run = wandb.init(mode="offline", **kwargs)
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        where = kwargs["dir"] if self.mode == "offline" else run.url
        log.info("W&B run %s (%s): %s", run.id, self.mode, where)
        return run

    def _config(self) -> dict[str, Any] | None:
        """The resolved config as written by the launcher (literal secrets are already references;
        redacted once more because W&B is read by people)."""
        f = self.paths.resolved_config
        if not f.is_file():
            return None
        import tomllib

        try:
            from hpcrl.config.resolved import redact

            return redact(tomllib.loads(f.read_text()))
        except (tomllib.TOMLDecodeError, OSError):
            return None

    def _drain(self) -> None:
        recs = self.follower.poll()
        for rec in recs:
            self._log(rec)
        if recs:
            self._save_offset()

    def _log(self, rec: dict[str, Any]) -> None:
        import wandb

        step, role = rec.get("step"), str(rec.get("role", "unknown"))
        if not isinstance(step, int):
            return
        self.last_step[role] = max(step, self.last_step.get(role, step))
        kind = rec.get(EXTRA_KEY)
        if kind == "finished":
            self.finished.add(role)
            return
        if kind is None:
            payload: dict[str, Any] = scalar_payload(rec, self.multi_role)
        elif kind == "distribution" and rec.get("counts") and rec.get("edges"):
            hist = wandb.Histogram(np_histogram=(rec["counts"], rec["edges"]))
            payload = {f"distributions/{rec.get('name', 'values')}": hist}
        elif kind == "samples":
            rows = self._read_rows(rec.get("file"))
            if not rows:
                return
            cols, data = sample_table(rows, step)
            payload = {f"samples/{role}": wandb.Table(columns=cols, data=data)}
        else:
            return
        if payload:
            self.run.log({**payload, "step": step})
            self.logged += 1

    def _read_rows(self, rel: Any) -> list[dict[str, Any]]:
        if not isinstance(rel, str):
            return []
        try:
            return parse_lines((self.paths.root / rel).read_bytes())
        except OSError:
            return []

    # -- offset --------------------------------------------------------------------------------------
    def _load_offset(self) -> int:
        try:
            return int(self.paths.wandb_sink_offset.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _save_offset(self) -> None:
        # Not fsynced: a lost offset after a node crash only re-sends rows W&B deduplicates by step.
        write_text(self.paths.wandb_sink_offset, f"{self.follower.offset}\n", durable=False)


class _NoSink:
    """What non-writers and runs without W&B get: the same calls, nothing happens."""

    run = None
    error = None
    logged = 0

    def close(self, wait_for_step: int | None = None, timeout: float = 60.0) -> None:
        pass


def start_wandb_sink(
    cfg: Any, paths: RunPaths, role: str = "orchestrator", poll_s: float = 2.0
) -> WandbSink | _NoSink:
    """Start the W&B sink when `cfg.wandb` is set and `role` is the designated writer; otherwise a
    handle whose `close()` does nothing. Every role may call this; exactly one gets a real sink."""
    wandb_cfg = getattr(cfg, "wandb", None)
    if wandb_cfg is None or not is_writer(cfg, role):
        return _NoSink()
    name = getattr(cfg, "name", None) or Path(paths.root).name
    return WandbSink(
        wandb_cfg, paths, name, multi_role=hasattr(cfg, "orchestrator"), poll_s=poll_s, role=role
    ).start()
