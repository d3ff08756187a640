"""`hpcrl submit`: one heterogeneous SLURM job (trainer nodes + inference nodes) for a resolved config.

Resume without a manual step: the batch script runs `hpcrl prepare-resume` before the roles start
whenever the job is a requeue (SLURM_RESTART_COUNT > 0) or the submission asked for a resume. It
pins every role's config to the newest complete checkpoint and moves newer bus files aside.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from hpcrl.config import secrets
from hpcrl.config.loader import Loaded
from hpcrl.config.resolved import secret_env, to_dict, write_resolved
from hpcrl.config.schema import CkptConfig, Config
from hpcrl.launch import attention_check, host_memory, memory_plan, prepare
from hpcrl.launch.partition import check_components, component_requests, partition_nodes
from hpcrl.launch.placement import Placement, slurm_placement
from hpcrl.models.hub import job_env as hub_job_env
from hpcrl.paths import RunPaths


def resume_setup_line(paths: RunPaths, python: str, step: int | None) -> str:
    """Shell line for the batch script: resume on requeue (and on a requested resume)."""
    run = shlex.quote(str(paths.root))
    py = shlex.quote(python)
    requested = "" if step is None else f" --step {step}"
    cond = '[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]' if step is None else "true"
    return (
        f"if {cond}; then {py} -m hpcrl.cli prepare-resume --output-dir {run}{requested or ' --step -1'} "
        f"--if-checkpoint || exit 1; fi"
    )


def slurm_plan(cfg: Config, nodes: int | None) -> tuple[Placement, list[str]]:
    """The hetjob's placement against what the partition's nodes offer (sinfo), so an impossible
    request fails here in one line instead of pending forever in the queue, and the memory plan's
    lines (a GPU plan that cannot fit is refused). Writes nothing."""
    assert cfg.slurm is not None
    offer = partition_nodes(cfg.slurm.partition)
    most_gpus = max(n.gpus for n in offer) if offer and cfg.slurm.gpus_per_node else None
    placement = slurm_placement(cfg, nodes, partition_gpus=most_gpus)
    if offer:
        where = f"partition '{cfg.slurm.partition}'" if cfg.slurm.partition else "the default partition"
        check_components(component_requests(cfg, placement), offer, where)
    memory = memory_plan.dry_run_lines(cfg, placement)
    memory += host_memory.dry_run_lines(cfg, placement, offer)
    memory += attention_check.attention_lines(cfg, placement, {t for n in offer or [] for t in n.gpu_types})
    return placement, memory


def submit(loaded: Loaded, nodes: int | None, dry_run: bool, resume_step: int | None = None) -> int:
    cfg: Config = loaded.config
    assert cfg.slurm is not None
    # A resumed run's literal secrets exist only as references now: each must be in this environment
    # again before anything is written or submitted (env_file secrets are re-read from their files on the nodes and need nothing).
    secrets.check_secret_refs(to_dict(cfg), {**os.environ, **secret_env(cfg)})
    placement, memory = slurm_plan(cfg, nodes)
    prepare.apply_placement(cfg, placement)
    notes = []
    if cfg.slurm.requeue and cfg.ckpt is None:
        cfg.ckpt = CkptConfig()
        notes.append(
            "note:         checkpointing enabled (requeue resumes from checkpoints); set [ckpt] to tune"
        )
    if resume_step is None and cfg.ckpt is not None:
        cfg.ckpt.resume_step = None  # roles get the step from prepare-resume, never from a stale config
    paths = prepare.prepare_output_dir(cfg, dry_run=dry_run)
    from hpcrl.launch import slurm as slurm_mod
    from hpcrl.launch.hetjob import sbatch_test_only

    python = sys.executable
    spec = slurm_mod.build_spec(cfg, placement, paths, python=python)
    if cfg.server.api_key and not dry_run:  # sbatch exports the submitting environment (--export=ALL)
        from hpcrl.inference.guard import export_run_api_key

        export_run_api_key(cfg.server.api_key)
    spec.setup.insert(0, resume_setup_line(paths, python, resume_step))
    spec = replace(spec, env={**spec.env, **hub_job_env(cfg, download=not dry_run)})  # nodes run offline
    script = slurm_mod.render(spec, paths)
    paths.slurm_dir.mkdir(parents=True, exist_ok=True)
    script_path = paths.slurm_dir / "hetjob.sbatch"
    script_path.write_text(script)
    extra = memory + [f"sbatch:       {script_path}"] + notes
    if dry_run:
        from hpcrl.envs.verifiers.v1_runtime import dry_run_check as runtimes_can_start
        from hpcrl.render.select import dry_run_check

        runtimes_can_start(cfg)  # each v1 env's runtime can start (apptainer on PATH, a hosted key)
        extra += dry_run_check(cfg)  # a typed renderer must build on the model's tokenizer
        if shutil.which("sbatch"):
            ok, msg = sbatch_test_only(script)
            extra.append(f"sbatch --test-only: {'OK' if ok else 'REJECTED'}: {' '.join(msg.split())[:300]}")
            prepare.print_summary(loaded, placement, "submit (SLURM hetjob)", extra)
            return 0 if ok else 1
        extra.append("sbatch --test-only: skipped (no sbatch on this machine)")
        prepare.print_summary(loaded, placement, "submit (SLURM hetjob)", extra)
        return 0
    from hpcrl.launch.restart import clear_stale_addresses

    clear_stale_addresses(paths)
    # An earlier `cancel --checkpoint` must not keep this job from requeueing.
    paths.stop_request_file.unlink(missing_ok=True)
    # Literal secrets reach the job through sbatch's environment (exported to every step), never
    # through the script or configs in the run directory; SLURM keeps it for requeues.
    os.environ.update(secret_env(cfg))
    job_id = slurm_mod.submit(spec, paths)
    from hpcrl.launch.manage import write_job

    write_job(
        paths,
        {
            "target": "slurm",
            "job_id": job_id,
            "nodes": placement.train_nodes + placement.infer_nodes,
            "submitted_at": time.time(),
            "script": str(script_path),
        },
    )
    print(
        f"hpcrl: submitted SLURM job {job_id} ({placement.train_nodes} trainer + {placement.infer_nodes} inference "
        + (f"+ {placement.env_nodes} env " if placement.env_nodes else "")
        + f"node(s)); logs: {paths.logs_dir}/  follow: bash tmux.sh {job_id} {paths.root}",
        flush=True,
    )
    return 0


def prepare_resume_main(argv: list[str]) -> int:
    """`hpcrl prepare-resume --output-dir DIR [--step -1|N] [--if-checkpoint]` (run by the batch script)."""
    import argparse

    p = argparse.ArgumentParser(prog="hpcrl prepare-resume")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--step", type=int, default=-1)
    p.add_argument(
        "--if-checkpoint", action="store_true", help="no checkpoint yet: start fresh instead of failing"
    )
    args = p.parse_args(argv)
    from hpcrl import checkpoint  # after parsing: --help stays light
    from hpcrl.launch.checks import load
    from hpcrl.launch.restart import clear_stale_addresses, set_aside_after

    paths = RunPaths(Path(args.output_dir))
    loaded = load(["@", str(paths.resolved_config)])
    cfg: Config = loaded.config
    try:
        step = checkpoint.resolve_resume_step(paths, args.step)
    except checkpoint.CheckpointError as e:
        if not args.if_checkpoint:
            print(f"hpcrl: error: {e}", file=sys.stderr)
            return 2
        step = 0
    set_aside_after(paths, step)
    clear_stale_addresses(paths)
    # An earlier `cancel --checkpoint` must not keep this job from requeueing.
    paths.stop_request_file.unlink(missing_ok=True)
    if cfg.ckpt is None:
        cfg.ckpt = CkptConfig()
    cfg.ckpt.resume_step = step if step > 0 else None
    write_resolved(cfg, paths.configs_dir)
    print(json.dumps({"resume_step": step, "run": str(paths.root)}), flush=True)
    return 0
