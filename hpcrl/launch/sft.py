"""`hpcrl sft`'s launcher: check the ranks the run gets, prepare the run directory, then either
spawn and supervise one rank per process on this machine (hpcrl.launch.sft_ranks) or be the rank
(started under torchrun / srun / our own spawner) and run the loop (hpcrl.trainer.sft.train).

Whatever ends a run this process is the job of (hpcrl.launch.manage), its last line goes to the job
file as `hpcrl run`'s does (hpcrl.launch.local.ended), so `hpcrl status` says what ended it: a rank that
failed, the watchdog, a write refused past storage_timeout_s, Ctrl-C, or a clean finish."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from hpcrl.config.schema import SFTConfig
from hpcrl.config.sections import environ
from hpcrl.launch import sft_ranks
from hpcrl.launch.checks import context_parallel
from hpcrl.launch.prepare import prepare_output_dir
from hpcrl.paths import RunPaths


def main(cfg: SFTConfig) -> int:
    # User errors (data, template, resume step) are UserErrors: the CLI prints them in one line.
    from hpcrl.monitor.logging import setup_logging
    from hpcrl.runtime import use_cuda
    from hpcrl.trainer import parallel

    # env_vars: this process's own, before torch starts its threads or devices; ranks we spawn inherit
    # them, and on SLURM the rendered script gives them to every rank's process as well.
    os.environ.update(environ.resolved(cfg, "sft"))
    ranks = sft_ranks.requested_ranks(cfg)
    as_rank = sft_ranks.launched_as_rank()
    context_parallel(cfg, parallel.dist_env().world_size if as_rank else ranks, use_cuda())
    if ranks > 1 and not as_rank:
        setup_logging("sft", cfg.log.level)
        paths = prepare_output_dir(cfg)
        return sft_ranks.launch_ranks(paths, ranks, record=_local_job(paths))
    # A rank we spawned finds the run directory prepared; a lone or torchrun/srun rank prepares it.
    job = False  # whether this process is the run's job: then it records what ended it
    if os.environ.get(sft_ranks.CHILD_ENV):
        paths = RunPaths(cfg.output_dir)
    else:
        paths = prepare_output_dir(cfg)
        job = not as_rank and _local_job(paths)
    if not as_rank and "MASTER_PORT" not in os.environ:
        # A lone rank still opens a (gloo/nccl) group: take a free port, not the fixed default that
        # another job on this machine may hold.
        from hpcrl.net import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    from hpcrl.trainer.sft import train

    if not job:
        return train(cfg, paths)
    return recorded(paths, lambda: train(cfg, paths))


def _local_job(paths: RunPaths) -> bool:
    """This process as the run's job (`hpcrl status`: running while it lives, so a rank whose progress
    report stops being refreshed is named unresponsive, not exited). A SLURM job writes its own: False."""
    import time

    from hpcrl.launch.manage import write_job

    if os.environ.get("SLURM_JOB_ID"):  # `hpcrl submit` wrote the job file: the SLURM job
        return False
    write_job(paths, {"target": "local", "pid": os.getpid(), "started_at": time.time()})
    return True


INTERRUPTED = "hpcrl: interrupted"
STOPPED = "stop requested: "  # hpcrl.trainer.sft's WARNING when a SIGTERM / SIGUSR2 stopped the loop


class LastError(logging.Handler):
    """The last ERROR line hpcrl's loggers printed (its message: the console's line past the time,
    level and role), the line a rank in this process ends with (`sft trainer failed: ...`), and the
    stop line if a signal stopped it (`stop requested: checkpointed step 6, exiting`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.line = ""
        self.stopped = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = record.getMessage().strip().splitlines()
        except Exception:  # noqa: BLE001 - a bad log call is not the run's end
            return
        first = lines[0] if lines else ""
        if record.levelno >= logging.ERROR:
            self.line = first
        elif first.startswith(STOPPED):
            self.stopped = first


def last_line(code: int, error: str, stopped: str = "") -> str:
    """What ended a run this process ran (exit `code`, `error` its last ERROR line, `stopped` its
    stop line when a signal ended the loop early)."""
    from hpcrl.launch.local import FINISHED

    if code == 0:
        return f"hpcrl sft: {stopped}" if stopped else FINISHED
    return error or f"hpcrl sft: exited with code {code}"


def recorded(paths: RunPaths, run: Callable[[], int]) -> int:
    """run() (the rank, in this process), its end recorded in the job file (hpcrl.launch.local.ended):
    returned, raised, Ctrl-C, or the watchdog's os._exit (its on_exit hook). A job file that cannot
    be written is only the status's loss: the run's own end and error stand."""
    from hpcrl.errors import UserError, one_line
    from hpcrl.launch.local import ended
    from hpcrl.monitor import watchdog

    last = LastError()
    hpcrl_log = logging.getLogger("hpcrl")  # not the root logger: setup_logging replaces its handlers
    hpcrl_log.addHandler(last)
    once = threading.Lock()  # the watchdog's hook (another thread, then os._exit) or the end below

    def record(code: int, line: str) -> None:
        if once.acquire(blocking=False):
            ended(paths, code, line)

    watchdog.on_exit(record)
    code, line = 1, ""
    try:
        code = run()
        line = last_line(code, last.line, last.stopped)
        return code
    except KeyboardInterrupt:
        code, line = 130, INTERRUPTED
        raise
    except UserError as e:
        code, line = 2, e.one_line()
        raise
    except Exception as e:  # the traceback's last line
        line = one_line(f"sft trainer failed: {type(e).__name__}: {e}", 500)
        raise
    finally:
        hpcrl_log.removeHandler(last)
        if line:  # not for a SystemExit: whoever raised it says why
            record(code, line)
