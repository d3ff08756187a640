"""`hpcrl sft` over several ranks on one machine: spawn one `hpcrl sft` child per rank on the
resolved config and supervise them with the local launcher's machinery (hpcrl.launch.local).

Started under torchrun/srun (RANK/WORLD_SIZE or SLURM_* set) every process already is one rank and
nothing is spawned. The ranks share this terminal (each also writes its own log file); when one
fails the others are stopped; SIGTERM / SIGUSR2 (SLURM's pre-timeout signal) are passed on, so every
rank checkpoints and stops on its own.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from hpcrl.config.schema import SFTConfig
from hpcrl.launch.local import Child, ended, free_port, signal_children, spawn, supervise_then_stop
from hpcrl.paths import RunPaths
from hpcrl.runtime import rank_env

log = logging.getLogger("hpcrl.launch")

CHILD_ENV = "HPCRL_SFT_CHILD"  # set on ranks this process spawned: they skip output-dir preparation
USER_ERROR_EXIT = 2  # the rank printed its one-line error itself (hpcrl.launch.sft.main)


def requested_ranks(cfg: SFTConfig) -> int:
    from hpcrl.launch.prepare import visible_gpus

    d = cfg.deployment
    return d.num_trainer_ranks or d.num_train_gpus or max(1, visible_gpus())


def launched_as_rank() -> bool:
    """torchrun, srun with several tasks, or our own spawner already set up the ranks."""
    return "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def shared_env(n: int, cpu: bool) -> dict[str, str]:
    """Environment every one of the n ranks gets (each adds its own runtime.rank_env)."""
    env = {**os.environ, CHILD_ENV: "1", "PYTHONUNBUFFERED": "1"}
    if cpu:  # one thread per core in every rank oversubscribes the machine
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    return env


def spawn_ranks(paths: RunPaths, n: int) -> list[Child]:
    from hpcrl.launch.prepare import visible_gpus

    base = shared_env(n, cpu=visible_gpus() == 0)
    port = free_port()
    args = ["@", str(paths.configs_dir / "sft.toml")]
    return [
        spawn(
            "sft",
            f"sft[{r}]",
            args,
            paths.log_file("trainer") if r == 0 else paths.rank_log_file("trainer", r),
            {**base, **rank_env(r, n, "127.0.0.1", port)},
            capture=False,
        )
        for r in range(n)
    ]


def launch_ranks(paths: RunPaths, n: int, record: bool = True) -> int:
    """Start n ranks of `hpcrl sft` on the resolved config and wait; when one fails, stop the rest.
    Returns the failed rank's exit code (0 when every rank finished). With `record` (this process is
    the run's job, not a SLURM job's task) the last line (which rank ended the run and why, that a
    signal stopped it, or that it finished) goes to the job file for `hpcrl status`, as `hpcrl run`'s."""
    children = spawn_ranks(paths, n)
    stops: list[str] = []

    def forward(signum: int, _frame: object) -> None:
        stops.append(signal.Signals(signum).name)
        signal_children(children, signum)

    code, line, failed = supervise_then_stop(
        children, {signal.SIGTERM: forward, signal.SIGUSR2: forward}, None, poll=0.2
    )
    if failed is not None:
        code = failed.proc.returncode  # the rank's own code (2: a user error it reported itself)
    elif code == 0 and stops:  # the ranks checkpointed and stopped: not the run's end
        line = f"hpcrl sft: stopped on {stops[0]}; continue with --ckpt.resume-step -1"
    if record:
        ended(paths, code, line)
    if code not in (0, USER_ERROR_EXIT):
        print(line, file=sys.stderr, flush=True)
    return code
