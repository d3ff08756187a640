"""`hpcrl run`: inference server(s), orchestrator and trainer rank(s) as processes on this machine.

The launcher assigns ports and devices, redirects every process into the log layout of docs/architecture.md §4,
prints one console line per step from metrics.jsonl, and supervises: a dead inference server is
restarted in place (same port and GPUs, up to deployment.max_server_restarts times, with backoff;
the orchestrator loads the current policy into it, see hpcrl.orchestrator.servers); when any other
process dies, or a server runs out of restarts, the others are stopped within seconds and the exit
code and last line name the one that died.

Stopping: Ctrl-C / SIGTERM stop every process within seconds (each role promises to exit within 10 s
of SIGTERM; the trainer checkpoints its last finished step if it can in that time). SIGUSR2 is the
unhurried stop, as on SLURM: the trainer ranks and the orchestrator get it; the trainer finishes its
step, writes a complete checkpoint (the orchestrator writes its part) however long that takes, and
exits; then the rest are stopped and `hpcrl resume --step -1` continues from exactly there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hpcrl.config.loader import Loaded
from hpcrl.config.resolved import secret_env
from hpcrl.config.schema import Config
from hpcrl.config.sections import environ as role_env
from hpcrl.launch import restart
from hpcrl.launch.console import ConsoleReporter
from hpcrl.launch.keepalive import restart_delay
from hpcrl.launch.logrecords import last_error
from hpcrl.launch.placement import Placement, Slot
from hpcrl.net import free_port
from hpcrl.paths import RunPaths
from hpcrl.runtime import GPUS_PER_TASK_ENV, rank_env

GRACE_S = 8.0


FINISHED = "hpcrl: run finished"  # the last line of a run that reached its end (console, job file)


@dataclass
class Child:
    role: str  # "inference[0]", "trainer[0]", "orchestrator"
    kind: str  # "inference" | "trainer" | "orchestrator"
    proc: subprocess.Popen
    log_path: Path  # where its output goes (or, for a child that shares our terminal, its own log file)
    log_fh: IO[bytes] | None = field(repr=False)  # None: the child writes to our stdout/stderr
    args: list[str] = field(default_factory=list, repr=False)  # what `spawn` ran: a restart runs it again
    env: dict[str, str] = field(default_factory=dict, repr=False)
    restarts: int = 0
    restart_at: float | None = None  # time.monotonic() of a scheduled restart
    log_start: int = 0  # the log's size when this process started: older ERROR lines are not its own


def _threads_per_process(placement: Placement) -> int:
    """CPU runs: split the cores between the compute processes (trainer ranks + servers). Torch's
    default of one thread per core in every process oversubscribes and runs several times slower."""
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, placement.trainer_ranks + placement.inference_servers))


def _die_with_parent() -> None:
    """Runs in the child before exec: if the launcher is killed (even SIGKILL), the kernel kills this
    process too, so no orphan keeps writing into a run directory that a resume is about to use."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: supervision still stops children on every non-SIGKILL exit
        pass


# Kinds that checkpoint on SIGUSR2. They start with it blocked (the mask survives exec) and unblock
# it once their handler is in (hpcrl.trainer.core.install_stop_handler): a USR2 that arrives while
# the interpreter is still importing waits instead of killing the process.
CHECKPOINTING_KINDS = ("trainer", "sft", "orchestrator")


def _die_with_parent_usr2_blocked() -> None:
    _die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})


def spawn(
    kind: str, role: str, args: list[str], log_path: Path, env: dict[str, str], capture: bool = True
) -> Child:
    """`hpcrl <kind> <args>` as a child; its output goes to `log_path`, or with ``capture = False``
    to our own stdout/stderr (the child then writes `log_path` itself)."""
    from hpcrl.storage import open_log

    try:
        start = log_path.stat().st_size  # a resumed run appends to the old log
    except OSError:
        start = 0
    fh = open_log(log_path, role) if capture else None  # closed in stop_children; refused: a relay pipe
    if not capture:  # the child writes log_path itself (a refused directory: the child's to say)
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
    cmd = [sys.executable, "-m", "hpcrl.cli", kind, *args]
    # Own session: the whole subtree can be signalled, and a Ctrl-C reaches only the launcher.
    proc = subprocess.Popen(
        cmd,
        stdout=fh,
        stderr=subprocess.STDOUT if capture else None,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent_usr2_blocked if kind in CHECKPOINTING_KINDS else _die_with_parent,
    )
    return Child(role, kind, proc, log_path, fh, args, env, log_start=start)


def respawn(child: Child) -> None:
    """Run a dead child's command again in place (same log, port, GPUs, environment)."""
    _signal_group(child.proc, signal.SIGKILL)  # what the dead one started (vLLM workers) goes with it
    if child.log_fh is not None:
        child.log_fh.close()
    new = spawn(
        child.kind, child.role, child.args, child.log_path, child.env, capture=child.log_fh is not None
    )
    child.proc, child.log_fh, child.restart_at, child.log_start = new.proc, new.log_fh, None, new.log_start
    child.restarts += 1


def _gpu_env(placement: Placement, slot: Slot) -> dict[str, str]:
    """The placement's GPUs for one child (one machine: node-local indices are the machine's)."""
    if not placement.uses_gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slot.gpus)), GPUS_PER_TASK_ENV: str(len(slot.gpus))}


def start_children(cfg: Config, placement: Placement, paths: RunPaths, resume_args: list[str]) -> list[Child]:
    restart.clear_stale_addresses(paths)
    # Literal secrets of the config travel here, in the environment (configs/ holds references).
    base_env = {**os.environ, **secret_env(cfg), "PYTHONUNBUFFERED": "1", "HPCRL_RUN_DIR": str(paths.root)}
    if not placement.uses_gpus or placement.cpu_compute:
        base_env.setdefault("OMP_NUM_THREADS", str(_threads_per_process(placement)))
    children: list[Child] = []
    first_port = cfg.server.port or free_port()
    for i in range(placement.inference_servers):
        port = first_port + i if cfg.server.port else (first_port if i == 0 else free_port())
        log = paths.log_file("inference") if i == 0 else paths.rank_log_file("inference", i)
        env = dict(
            base_env, **role_env.resolved(cfg, "inference"), **_gpu_env(placement, placement.server_slot(i))
        )
        args = [
            "@",
            str(paths.process_config("inference")),
            "--run-dir",
            str(paths.root),
            "--server-index",
            str(i),
            "--server.port",
            str(port),
        ]
        children.append(spawn("inference", f"inference[{i}]", args, log, env))
    master_port = free_port()
    n = placement.trainer_ranks
    for r in range(n):
        # LOCAL_RANK is the rank's index on this machine; its device is whatever its own
        # CUDA_VISIBLE_DEVICES holds (cuda:0), never cuda:LOCAL_RANK of a narrowed list.
        env = {
            **base_env,
            **role_env.resolved(cfg, "trainer"),
            **rank_env(r, n, "127.0.0.1", master_port),
            **_gpu_env(placement, placement.trainer_slot(r)),
        }
        log = paths.log_file("trainer") if r == 0 else paths.rank_log_file("trainer", r)
        children.append(
            spawn(
                "trainer",
                f"trainer[{r}]",
                ["@", str(paths.process_config("trainer")), *resume_args],
                log,
                env,
            )
        )
    orch_env = dict(base_env, **role_env.resolved(cfg, "orchestrator"))  # env_vars + orchestrator.env_vars
    if placement.uses_gpus:
        orch_env.update({"CUDA_VISIBLE_DEVICES": "", GPUS_PER_TASK_ENV: "0"})
    children.append(
        spawn(
            "orchestrator",
            "orchestrator",
            ["@", str(paths.process_config("orchestrator")), *resume_args],
            paths.log_file("orchestrator"),
            dict(orch_env),
        )
    )
    return children


def stop_children(children: list[Child], grace: float = GRACE_S) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        _signal_group(c.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in live:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()
    for c in children:
        if c.log_fh is not None:
            c.log_fh.close()


def signal_children(children: list[Child], sig: int) -> None:
    """Pass a signal on to every live child's process group (e.g. SLURM's pre-timeout SIGUSR2)."""
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c.proc, sig)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(
    children: list[Child],
    console: ConsoleReporter | None,
    poll: float = 0.5,
    max_restarts: int = 0,
    paths: RunPaths | None = None,
    stopped: Callable[[], tuple[int, str] | None] = lambda: None,
) -> tuple[int, str]:
    """Block until the run finishes, a process dies for good, or `stopped()` returns (exit code, last
    line): a requested stop is over, whatever the others do meanwhile. Returns (exit code, last line).
    A dead inference server is restarted up to `max_restarts` times (see the module doc)."""
    workers = [c for c in children if c.kind != "inference"]
    while True:
        if console is not None:
            console.update()
        if (done := stopped()) is not None:
            return done
        for c in children:
            rc = c.proc.poll()
            if rc is None:
                continue
            if rc == 0 and c.kind != "inference":
                continue
            why = f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}"
            if c.kind != "inference" or c.restarts >= max_restarts:
                more = f" ({c.restarts} restart(s) used)" if c.kind == "inference" else ""
                error = last_error(c.log_path, since=c.log_start)
                return 1, f"hpcrl: {c.role} {why}{more}{': ' + error if error else ''}; see {c.log_path}"
            if c.restart_at is None:
                c.restart_at = time.monotonic() + restart_delay(c.restarts)
                print(
                    f"hpcrl: {c.role} {why}; restarting it ({c.restarts + 1}/{max_restarts}) in "
                    f"{restart_delay(c.restarts):.0f}s",
                    flush=True,
                )
            elif time.monotonic() >= c.restart_at:
                if paths is not None:  # its address is dead: nobody may dial it until the new one is ready
                    paths.server_file(_server_index(c)).unlink(missing_ok=True)
                respawn(c)
        if all(c.proc.poll() == 0 for c in workers):
            if console is not None:
                console.update()
            return 0, FINISHED
        time.sleep(poll)


def supervise_then_stop(
    children: list[Child],
    handlers: dict[int, Callable[[int, Any], None]],
    console: ConsoleReporter | None,
    **kw: Any,
) -> tuple[int, str, Child | None]:
    """`supervise` with `handlers` installed for signals while it runs (Ctrl-C: exit code 130), then
    stop every child that is left. Returns (exit code, last line, the child that failed first)."""
    old = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        code, line = supervise(children, console, **kw)
        failed = next((c for c in children if c.proc.returncode not in (None, 0)), None) if code else None
        return code, line, failed
    except KeyboardInterrupt:
        return 130, "hpcrl: interrupted; stopping every process", None
    finally:
        for s in handlers:  # already stopping: a second Ctrl-C or a USR2 must not interrupt it
            signal.signal(s, signal.SIG_IGN)
        stop_children(children)
        for s, h in old.items():
            signal.signal(s, h)


class CheckpointStop:
    """SIGUSR2 to `hpcrl run` (`hpcrl cancel --checkpoint`): the trainer ranks checkpoint after their
    current step and exit (no deadline: a big model's checkpoint takes what it takes); once they have,
    the run is over. Installed before the children start; a request before then starts nothing."""

    def __init__(self, paths: RunPaths, checkpoints: bool) -> None:
        self.paths = paths
        self.checkpoints = checkpoints  # False: [ckpt] unset or weights_only, nothing to resume from
        self.trainers: list[Child] | None = None  # set by attach() once they are spawned
        self.signalled: list[Child] = []
        self.requested = False
        self.told = False

    def attach(self, children: list[Child]) -> None:
        self.trainers = [c for c in children if c.kind == "trainer"]
        # The orchestrator too (as on SLURM): it writes its part of the trainer's checkpoint, which
        # the trainer waits for; left alone it would sit waiting for a policy that never comes.
        self.signalled = [c for c in children if c.kind in ("trainer", "orchestrator")]
        if self.requested:
            signal_children(self.signalled, signal.SIGUSR2)  # blocked until their handler is in

    def request(self, _signum: int, _frame: object) -> None:
        if not self.checkpoints:
            self._say(
                "SIGUSR2 ignored: this run writes no resumable checkpoints ([ckpt] unset or "
                "ckpt.weights_only); Ctrl-C stops it"
            )
            return
        if self.trainers is not None and all(c.proc.poll() is not None for c in self.trainers):
            self._say("SIGUSR2 ignored: training is over, the run is finishing")
            return
        self._say(
            "SIGUSR2: the trainer checkpoints after its current step, then the run stops (Ctrl-C stops now)"
        )
        self.requested = True
        if self.trainers is not None:
            signal_children(self.signalled, signal.SIGUSR2)

    def _say(self, what: str) -> None:
        if not self.told:
            print(f"hpcrl: {what}", flush=True)
        self.told = True

    def over(self) -> tuple[int, str] | None:
        """(exit code, last line) once every trainer rank has exited after the request, else None."""
        if not self.requested or self.trainers is None or any(c.proc.poll() is None for c in self.trainers):
            return None
        from hpcrl import checkpoint
        from hpcrl.bus.api import publish_control
        from hpcrl.bus.messages import Shutdown

        if any(c.proc.returncode != 0 for c in self.trainers):
            return None  # supervise reports the rank that failed
        # The orchestrator may be waiting for a policy that will never come: tell it (a bus ring).
        publish_control(
            self.paths, Shutdown(reason="the trainer stopped after its checkpoint", origin="launcher")
        )
        c = checkpoint.newest_intact(self.paths)  # sizes, not hashes: resume checks those
        if c is None:  # the trainer exited cleanly without one: no step had finished
            return (
                0,
                "hpcrl: stopped on SIGUSR2 before the first step finished: nothing to resume, start it again",
            )
        return 0, (
            f"hpcrl: stopped on SIGUSR2 at checkpoint {c}; continue with "
            f"`hpcrl resume --step -1 --output-dir {self.paths.root}`"
        )


def _server_index(child: Child) -> int:
    return int(child.args[child.args.index("--server-index") + 1])


def run_local(loaded: Loaded, placement: Placement) -> int:
    cfg: Config = loaded.config
    paths = RunPaths(cfg.output_dir)
    try:
        resume_args = restart.prepare_resume(cfg, paths)
    except restart.AlreadyComplete as done:
        print(done, flush=True)
        return 0
    from hpcrl.models.resolve import resolve_model

    # Build a built-in tiny model once here, not in three processes at once.
    resolve_model(cfg.model.name or "")
    from hpcrl.launch.manage import write_job

    # From the moment the job file names this pid, `hpcrl cancel --checkpoint` may signal it.
    stop = CheckpointStop(paths, checkpoints=cfg.ckpt is not None and not cfg.ckpt.weights_only)
    signal.signal(signal.SIGUSR2, stop.request)
    write_job(paths, {"target": "local", "pid": os.getpid(), "started_at": time.time()})
    from hpcrl.inference.guard import export_run_api_key

    export_run_api_key(
        cfg.server.api_key
    )  # children inherit it: servers require it, the orchestrator sends it
    console = ConsoleReporter(paths, cfg.max_steps)
    console.banner(cfg, placement, loaded.notes)
    if stop.requested:
        print("hpcrl: stopped on SIGUSR2 before any process started", flush=True)
        return 0
    children = start_children(cfg, placement, paths, resume_args)
    stop.attach(children)

    def on_signal(_signum, _frame):
        raise KeyboardInterrupt

    code, line, _ = supervise_then_stop(
        children,
        {signal.SIGTERM: on_signal, signal.SIGINT: on_signal, signal.SIGUSR2: stop.request},
        console,
        max_restarts=cfg.deployment.max_server_restarts,
        paths=paths,
        stopped=stop.over,
    )
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the run is over: nothing left to checkpoint
    console.finish()
    from hpcrl.monitor.plots import report_plots

    if cfg.log.plots:
        report_plots(paths)  # also after a failure: the plots show how far it got
    ended(paths, code, line)
    print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


def ended(paths: RunPaths, code: int, line: str) -> None:
    """The run's last line in its job file: `hpcrl status` names what ended it (a role killed, its
    cause) after the console is gone. A job file that cannot be written is only the status's loss."""
    from hpcrl.launch.manage import read_job, write_job

    try:
        write_job(paths, {**read_job(paths), "ended": line, "exit_code": code})
    except Exception:  # noqa: BLE001 - refused, or a job file that does not parse: never the run's error
        pass
