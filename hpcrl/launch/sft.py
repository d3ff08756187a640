"""`hpcrl sft`'s launcher: check the ranks the run gets, prepare the run directory, then either
spawn and supervise one rank per process on this machine (hpcrl.launch.sft_ranks) or be the rank
(started under torchrun / srun / our own spawner) and run the loop (hpcrl.trainer.sft.train)."""

from __future__ import annotations

import os

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
        return sft_ranks.launch_ranks(_local_job(prepare_output_dir(cfg)), ranks)
    # A rank we spawned finds the run directory prepared; a lone or torchrun/srun rank prepares it.
    if os.environ.get(sft_ranks.CHILD_ENV):
        paths = RunPaths(cfg.output_dir)
    else:
        paths = prepare_output_dir(cfg)
        if not as_rank:
            _local_job(paths)
    if not as_rank and "MASTER_PORT" not in os.environ:
        # A lone rank still opens a (gloo/nccl) group: take a free port, not the fixed default that
        # another job on this machine may hold.
        from hpcrl.net import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    from hpcrl.trainer.sft import train

    return train(cfg, paths)


def _local_job(paths: RunPaths) -> RunPaths:
    """This process as the run's job (`hpcrl status`: running while it lives, so a rank whose progress
    report stops being refreshed is named unresponsive, not exited). A SLURM job writes its own."""
    import time

    from hpcrl.launch.manage import write_job

    if os.environ.get("SLURM_JOB_ID"):  # `hpcrl submit` wrote the job file: the SLURM job
        return paths
    write_job(paths, {"target": "local", "pid": os.getpid(), "started_at": time.time()})
    return paths
