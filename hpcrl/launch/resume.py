"""`hpcrl resume`: re-read a run's resolved config and restart every role at N+1 from the newest
complete checkpoint (or the one asked for), locally or by resubmitting to SLURM. Choosing, validating
and preparing the checkpoint is hpcrl/launch/restart.py, which `--ckpt.resume-step` on `hpcrl run`
goes through too.
"""

from __future__ import annotations

from pathlib import Path

from hpcrl import checkpoint
from hpcrl.config.loader import Loaded
from hpcrl.errors import ConfigError
from hpcrl.paths import RunPaths


def resume(output_dir: Path, step: int, argv: list[str], dry_run: bool = False) -> int:
    """`hpcrl resume --step -1|N --output-dir DIR [flags]`: rerun the recorded config from a checkpoint.
    ``dry_run``: validate all of it (config and flags, the checkpoint, the placement, the memory plan)
    and print the plan; nothing in the run directory is written."""
    paths = RunPaths(output_dir)
    if not paths.resolved_config.is_file():
        raise ConfigError(
            "--output-dir", f"{output_dir} has no configs/resolved.toml: not an hpcrl run directory"
        )
    if step < -1:
        raise ConfigError("--step", f"{step}: expected -1 (newest complete) or a step number")
    from hpcrl.launch.checks import load

    argv = [
        "@",
        str(paths.resolved_config),
        *argv,
        "--output-dir",
        str(output_dir),
        "--ckpt.resume-step",
        str(step),
    ]
    loaded = load(argv)
    loaded.config.clean_output_dir = False
    from hpcrl.launch.manage import read_job

    job = read_job(paths)
    from hpcrl.launch import prepare

    if dry_run:
        return _dry_run(loaded, paths, step, job)
    if job.get("target") == "slurm":
        from hpcrl.launch.submit import submit

        cfg = loaded.config
        newest = checkpoint.latest_complete(paths) if step == -1 else step
        if newest is not None and newest >= cfg.max_steps:
            print(
                f"hpcrl: {paths.root} is complete at step {newest} (max_steps); pass --max-steps M to train further"
            )
            return 0
        # The batch script's prepare-resume pins the roles to the checkpoint on the nodes.
        return submit(loaded, nodes=job.get("nodes"), dry_run=False, resume_step=step)
    from hpcrl.launch.local import run_local

    placement = prepare.local_plan(loaded)
    prepare.apply_placement(loaded.config, placement)
    prepare.prepare_output_dir(loaded.config)
    return run_local(loaded, placement)


def _dry_run(loaded: Loaded, paths: RunPaths, step: int, job: dict) -> int:
    """What `resume` would do, checked without writing: the checkpoint (verified, or the run already
    complete), then the placement and memory plan of the target the run was launched on."""
    from hpcrl.launch import prepare

    cfg = loaded.config
    newest = checkpoint.resolve_resume_step(paths, step)  # CheckpointError: one line naming what is wrong
    if newest >= cfg.max_steps:
        print(
            f"hpcrl: {paths.root} is complete at step {newest} (max_steps); pass --max-steps M to train further"
        )
        return 0
    memory: list[str] = []
    if job.get("target") == "slurm":
        from hpcrl.launch.submit import slurm_plan

        placement, memory = slurm_plan(cfg, job.get("nodes"))
        target = "resume (SLURM hetjob)"
    else:
        placement = prepare.local_plan(loaded)
        if placement.uses_gpus:
            from hpcrl.launch.memory_plan import dry_run_lines

            memory = dry_run_lines(cfg, placement)
        target = "resume (this machine)"
    prepare.apply_placement(cfg, placement)
    line = f"resume:       from checkpoint step_{newest} (verified), steps {newest + 1}..{cfg.max_steps}"
    prepare.print_summary(loaded, placement, target, [line, *memory])
    return 0
