"""Resume: pick the newest complete checkpoint (or the one asked for), move newer bus files aside,
and restart every role at N+1. `hpcrl resume` re-reads the run's resolved config; `--ckpt.resume-step`
on `hpcrl run` goes through the same code.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpcrl import checkpoint
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.resume")


class AlreadyComplete(Exception):
    """The checkpoint to resume from is the final step: there is nothing left to train."""


def prepare_resume(cfg: Config, paths: RunPaths) -> list[str]:
    """If the config asks to resume, validate the checkpoint, move newer bus files aside and return
    the flags that pin every role to that exact step; else []."""
    if cfg.ckpt is None or cfg.ckpt.resume_step is None:
        return []
    try:
        step = checkpoint.resolve_resume_step(paths, cfg.ckpt.resume_step)
    except checkpoint.CheckpointError as e:
        raise ConfigError("ckpt.resume_step", str(e)) from None
    if step == cfg.max_steps:
        raise AlreadyComplete(f"hpcrl: {paths.root} is complete at step {step} (max_steps); "
                              "pass --max-steps M to train further")
    if step > cfg.max_steps:
        raise ConfigError("max_steps", f"{cfg.max_steps} is below the resumed step {step} (max_steps is the final step)")
    from hpcrl.bus import Bus

    bus = Bus(paths, role="launcher", listen=False)
    moved = bus.move_aside_after(step, tag=f"resume_{step}_{int(time.time())}")
    bus.close()
    # Policy files up to N stay, but the trainer re-publishes N; weights/broadcasts newer than N are stale.
    print(f"hpcrl: resuming from {paths.checkpoint_dir(step)} (moved {len(moved)} newer bus file(s) aside)",
          flush=True)
    return ["--ckpt.resume-step", str(step)]


def resume(output_dir: Path, step: int, argv: list[str]) -> int:
    """`hpcrl resume --step -1|N --output-dir DIR [flags]`: rerun the recorded config from a checkpoint."""
    paths = RunPaths(output_dir)
    if not paths.resolved_config.is_file():
        raise ConfigError("--output-dir", f"{output_dir} has no configs/resolved.toml: not an hpcrl run directory")
    if step < -1:
        raise ConfigError("--step", f"{step}: expected -1 (newest complete) or a step number")
    from hpcrl.config import load

    argv = ["@", str(paths.resolved_config), *argv, "--output-dir", str(output_dir), "--ckpt.resume-step", str(step)]
    loaded = load(argv)
    loaded.config.clean_output_dir = False
    job = _read_job(paths)
    from hpcrl.launch import prepare

    if job.get("target") == "slurm":
        from hpcrl.launch.submit import submit

        cfg = loaded.config
        newest = checkpoint.latest_complete(paths) if step == -1 else step
        if newest is not None and newest >= cfg.max_steps:
            print(f"hpcrl: {paths.root} is complete at step {newest} (max_steps); pass --max-steps M to train further")
            return 0
        # The batch script's prepare-resume pins the roles to the checkpoint on the nodes.
        return submit(loaded, nodes=job.get("nodes"), dry_run=False, resume_step=step)
    from hpcrl.launch.local import run_local

    placement = prepare.local_plan(loaded)
    prepare.apply_placement(loaded.config, placement)
    prepare.prepare_output_dir(loaded.config)
    return run_local(loaded, placement)


def _read_job(paths: RunPaths) -> dict:
    import json

    try:
        return json.loads(paths.job_file.read_text())
    except (FileNotFoundError, ValueError):
        return {}
