"""`hpcrl submit` of an SFT config: the same SLURM path as RL (rendered script, `--dry-run` with
`sbatch --test-only`, pre-timeout checkpoint and requeue), one component of trainer nodes.

    nodes   --nodes, else deployment.num_train_nodes, else 1
    tasks   one torch.distributed rank per GPU of a node (slurm.gpus_per_node), or on CPU
            deployment.num_trainer_ranks spread over the nodes (at least one per node)

Every rank runs `sbatch/sft.sh` (-> `hpcrl sft @ configs/sft.toml`); a requeued job resumes from the
newest complete checkpoint (the script adds `--ckpt.resume-step -1` when one exists).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass

from hpcrl.config.loader import Loaded
from hpcrl.config.resolved import secret_env
from hpcrl.config.schema import CkptConfig, SFTConfig
from hpcrl.config.sections import environ
from hpcrl.errors import ConfigError
from hpcrl.launch import prepare
from hpcrl.launch.hetjob import HetComponent, HetJobSpec, sbatch_test_only
from hpcrl.launch.memory_sft import SFTGpus
from hpcrl.paths import RunPaths


@dataclass(frozen=True)
class SFTLayout:
    nodes: int
    tasks_per_node: int
    gpus_per_node: int  # 0: CPU ranks

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    def line(self) -> str:
        where = f"{self.gpus_per_node} GPU(s) per node, one rank each" if self.gpus_per_node else "CPU, gloo"
        return f"trainer:      {self.ranks} rank(s) on {self.nodes} node(s) ({where})"


def layout(cfg: SFTConfig, nodes: int | None) -> SFTLayout:
    assert cfg.slurm is not None
    d = cfg.deployment
    n = nodes or d.num_train_nodes or 1
    if nodes and d.num_train_nodes and nodes != d.num_train_nodes:
        raise ConfigError(
            "--nodes", f"{nodes} conflicts with deployment.num_train_nodes = {d.num_train_nodes}"
        )
    gpus = cfg.slurm.gpus_per_node
    if gpus:
        return SFTLayout(n, gpus, gpus)
    per_node = -(-(d.num_trainer_ranks or n) // n)  # ceil: at least one rank per node
    return SFTLayout(n, per_node, 0)


def build_spec(cfg: SFTConfig, lay: SFTLayout, paths: RunPaths, python: str) -> HetJobSpec:
    from hpcrl.launch.slurm import sbatch_dir, setup_lines, split_extra_sbatch

    s = cfg.slurm
    assert s is not None
    job_wide, per_component = split_extra_sbatch(s.extra_sbatch)
    setup = setup_lines(cfg)  # slurm.setup and slurm.pre_run_command, secrets as references
    component = HetComponent(
        "sft",
        [str(sbatch_dir() / "sft.sh")],
        nodes=lay.nodes,
        ntasks_per_node=lay.tasks_per_node,
        gpus_per_node=lay.gpus_per_node or None,
        partition=s.partition,
        account=s.account,
        qos=s.qos,
        constraint=s.constraint,
        mem=s.mem,
        cpus_per_task=s.cpus_per_task,
        extra_sbatch=per_component,
        forward_signal=True,  # the ranks checkpoint on USR2
        user_env=environ.for_script(cfg, "sft"),  # env_vars, secrets as references
    )
    return HetJobSpec(
        job_name=s.job_name or cfg.name or paths.root.name,
        components=[component],
        time=s.time,
        env={"HPCRL_RUN_DIR": str(paths.root), "HPCRL_PYTHON": python},
        setup=setup,
        extra_sbatch=job_wide,
        requeue=s.requeue,
        signal_before_s=s.signal_before_s,
        stop_file=str(paths.stop_request_file),
    )


def submit_sft(loaded: Loaded, nodes: int | None, dry_run: bool) -> int:
    cfg: SFTConfig = loaded.config
    assert cfg.slurm is not None
    lay = layout(cfg, nodes)
    notes = [lay.line()]
    if cfg.slurm.requeue and cfg.ckpt is None:
        cfg.ckpt = CkptConfig()
        notes.append(
            "note:         checkpointing enabled (requeue resumes from checkpoints); set [ckpt] to tune"
        )
    if cfg.ckpt is not None:
        cfg.ckpt.resume_step = None  # a requeue resumes through sbatch/sft.sh, never from a stale config
    paths = prepare.prepare_output_dir(cfg, dry_run=dry_run)
    from hpcrl.launch.slurm import render, submit

    spec = build_spec(cfg, lay, paths, sys.executable)
    script = render(spec, paths)
    paths.slurm_dir.mkdir(parents=True, exist_ok=True)
    script_path = paths.slurm_dir / "hetjob.sbatch"
    script_path.write_text(script)
    notes.append(f"sbatch:       {script_path}")
    if dry_run:
        if shutil.which("sbatch"):
            ok, msg = sbatch_test_only(script)
            notes.append(f"sbatch --test-only: {'OK' if ok else 'REJECTED'}: {' '.join(msg.split())[:300]}")
        else:
            ok = True
            notes.append("sbatch --test-only: skipped (no sbatch on this machine)")
        gpus = SFTGpus(lay.gpus_per_node, lay.ranks, lay.tasks_per_node, local=False)
        prepare.print_sft_summary(loaded, "submit (SLURM)", gpus if lay.gpus_per_node else None)
        print("\n".join(notes))
        return 0 if ok else 1
    from hpcrl.launch.manage import write_job
    from hpcrl.launch.restart import clear_stale_addresses

    clear_stale_addresses(paths)
    paths.stop_request_file.unlink(missing_ok=True)  # an earlier `cancel --checkpoint` must not stick
    os.environ.update(
        secret_env(cfg)
    )  # literal secrets of setup lines reach the job through sbatch's environment
    job_id = submit(spec, paths)
    write_job(
        paths,
        {
            "target": "slurm",
            "job_id": job_id,
            "nodes": lay.nodes,
            "submitted_at": time.time(),
            "script": str(script_path),
        },
    )
    print(
        f"hpcrl: submitted SLURM job {job_id} (SFT: {lay.ranks} rank(s) on {lay.nodes} node(s)); "
        f"logs: {paths.logs_dir}/",
        flush=True,
    )
    return 0


def is_sft_argv(argv: list[str]) -> bool:
    """Whether the config files in argv are an SFT config (`hpcrl sft`'s [data] / [loss_mask])."""
    from hpcrl.config.loader import read_toml

    files = [b for a, b in zip(argv, argv[1:]) if a == "@"]
    files += [a[1:] if a.startswith("@") else a for a in argv if a.endswith(".toml") and a not in files]
    for f in files:
        try:
            d = read_toml(f)
        except ConfigError:
            continue  # the real load names it
        if isinstance(d.get("data"), dict) or isinstance(d.get("loss_mask"), dict):
            return True
    return False


def local_notes(cfg: SFTConfig) -> list[str]:
    """What `hpcrl sft` (this machine) leaves to `hpcrl submit`, said instead of ignored."""
    nodes = cfg.deployment.num_train_nodes
    if cfg.slurm is None and not (nodes and nodes > 1):
        return []
    what = f"deployment.num_train_nodes = {nodes}" if nodes and nodes > 1 else "[slurm]"
    return [
        f"{what}: `hpcrl sft` runs on this machine; `hpcrl submit` runs this config on SLURM across nodes"
    ]
