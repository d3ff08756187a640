"""From a resolved config to a heterogeneous SLURM job (the glue `hpcrl submit` calls).

    spec = build_spec(cfg, placement, RunPaths(cfg.output_dir))
    script = render(spec, paths)          # --dry-run: print / write it, `sbatch_test_only(script)`
    job_id = submit(spec, paths)          # sbatch; the id also goes to paths.job_file (caller)

Component 0 = trainer nodes (one srun task per torch.distributed rank, `sbatch/trainer.sh`),
component 1 = inference nodes (one task per server, `sbatch/inference.sh`), component 2 (only with
deployment.env_nodes > 0) = CPU nodes for the env servers (one env host per node, `sbatch/envs.sh`);
the orchestrator is an extra one-task step on the first node of the component
`deployment.orchestrator_node` names.
Every role reads its resolved config from `<run>/configs/<role>.toml` (sbatch/common.sh) and its
run directory from HPCRL_RUN_DIR; nothing is pickled (see hpcrl.launch.hetjob).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hpcrl.config import secrets
from hpcrl.config.sections import environ as role_env
from hpcrl.launch.hetjob import HetComponent, HetJobSpec, HetStep, render_sbatch, submit_hetjob
from hpcrl.paths import RunPaths

# sbatch options that describe the whole job: first #SBATCH block only. Every other
# slurm.extra_sbatch option (--exclusive, --reservation=..., --gres=...) is a resource request and
# goes into every component, since hetjob components do not inherit those from each other.
_JOB_WIDE = {
    "begin", "comment", "deadline", "dependency", "export", "kill-on-invalid-dep", "mail-type",
    "mail-user", "nice", "priority", "wckey", "chdir", "get-user-env", "hold", "parsable",
}  # fmt: skip


def split_extra_sbatch(options: Sequence[str]) -> tuple[list[str], list[str]]:
    """(job-wide options, per-component options) of `slurm.extra_sbatch`."""
    job, per_component = [], []
    for opt in options:
        name = opt[2:].split("=", 1)[0]
        (job if name in _JOB_WIDE else per_component).append(opt)
    return job, per_component


def sbatch_dir() -> Path:
    """The per-role launch scripts: $HPCRL_SBATCH_DIR, else `sbatch/` of this source checkout."""
    env = os.environ.get("HPCRL_SBATCH_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "sbatch"


# The run's server key, made on the batch node when the job starts (never rendered into a file) and
# inherited by every srun step; a key exported at submission (server.api_key) is kept.
RUN_KEY_LINE = (
    'export HPCRL_API_KEY="${HPCRL_API_KEY:-$("$HPCRL_PYTHON" -c '
    "'import secrets; print(secrets.token_urlsafe(32))')}\""
)


def build_spec(
    cfg,
    placement,
    paths: RunPaths,
    *,
    python: str | None = None,
    trainer_args: Sequence[str] = (),
    orchestrator_args: Sequence[str] = (),
    inference_args: Sequence[str] = (),
    scripts: Path | None = None,
) -> HetJobSpec:
    """The hetjob for `cfg` (a resolved Config with `slurm` set) placed as `placement` (hpcrl.launch.placement.slurm_placement).

    `*_args` are appended to `hpcrl <role> @ configs/<role>.toml` on the nodes (e.g. resume flags).
    """
    from hpcrl.config.schema import SlurmConfig

    s = cfg.slurm if cfg.slurm is not None else SlurmConfig()
    scripts = scripts or sbatch_dir()
    job_wide, per_component = split_extra_sbatch(s.extra_sbatch)
    common = {
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "mem": s.mem,
        "cpus_per_task": s.cpus_per_task,
        "extra_sbatch": per_component,
    }
    from hpcrl.runtime import GPUS_PER_TASK_ENV

    def component(role: str, args: Sequence[str], forward_signal: bool) -> HetComponent:
        res = placement.resources(role)
        return HetComponent(
            role,
            [str(scripts / f"{role}.sh"), *args],
            nodes=res["nodes"],
            ntasks_per_node=res["ntasks_per_node"],
            gpus_per_node=res["gpus_per_node"],
            forward_signal=forward_signal,
            env={GPUS_PER_TASK_ENV: str(placement.gpus_per_task(role))} if placement.uses_gpus else {},
            user_env=role_env.for_script(cfg, role),  # env_vars + <role>.env_vars
            **common,
        )

    trainer = component("trainer", trainer_args, forward_signal=True)  # the trainer checkpoints on USR2
    # Servers hold no state: they are stopped when the job requeues.
    inference = component("inference", inference_args, forward_signal=False)
    orchestrator = HetStep(
        "orchestrator",
        component=0 if placement.orchestrator_on == "trainer" else 1,
        command=[str(scripts / "orchestrator.sh"), *orchestrator_args],
        nodes=1,
        ntasks=1,
        overlap=True,
        forward_signal=True,  # it checkpoints its part too
        env={GPUS_PER_TASK_ENV: "0"} if placement.uses_gpus else {},  # it computes nothing on GPUs
        user_env=role_env.for_script(cfg, "orchestrator"),
        # Done after the last policy loads, the orchestrator exits while the trainer still logs its last
        # step and writes its final checkpoint: the trainer's exit ends the job, not this one's.
        end_job_on_success=False,
    )
    components = [trainer, inference]
    if placement.env_nodes:  # deployment.env_nodes: the env servers' own CPU nodes
        envs = component("envs", (), forward_signal=False)  # env servers hold no state
        if cfg.deployment.env_partition:
            envs = replace(envs, partition=cfg.deployment.env_partition, constraint=None)
        components.append(envs)
    return HetJobSpec(
        job_name=s.job_name or cfg.name or paths.root.name,
        components=components,
        steps=[orchestrator],
        time=s.time,
        env={"HPCRL_RUN_DIR": str(paths.root), "HPCRL_PYTHON": python or sys.executable},
        setup=[RUN_KEY_LINE, *setup_lines(cfg)],
        extra_sbatch=job_wide,
        requeue=s.requeue,
        signal_before_s=s.signal_before_s,
        stop_file=str(paths.stop_request_file),
    )


def setup_lines(cfg) -> list[str]:
    """Shell lines before the steps: env_files, slurm.setup, then slurm.pre_run_command (prime-rl's,
    run once by the batch script before any role starts, as there). env_files are sourced by path
    (every step sees their variables; their contents never enter the script), and a setup line or
    pre-run command holding a literal secret runs as `eval "$HPCRL_SECRET_SLURM_..."`: the submitting
    process hands that variable to sbatch in its environment (resolved.secret_env), so the script in
    the run directory holds no secret."""
    lines = [f"set -a; . {shlex.quote(p)}; set +a" for p in getattr(cfg, "env_files", [])]
    s = cfg.slurm
    for line in secrets.externalize(list(s.setup if s else []), "slurm.setup")[0]:
        lines.append(_secret_safe(line))
    if s is not None and s.pre_run_command:
        command = secrets.externalize(s.pre_run_command, "slurm.pre_run_command", "pre_run_command")[0]
        lines += ["# slurm.pre_run_command", _secret_safe(command)]
    return lines


def _secret_safe(line: str) -> str:
    """A line that externalize turned into one `${env:VAR}` reference runs as `eval` of that variable."""
    m = secrets.ENV_REF_RE.fullmatch(line)
    return f'eval "${{{m.group(1)}}}"' if m else line


def render(spec: HetJobSpec, paths: RunPaths) -> str:
    """The sbatch script; its logs go to logs/slurm/ (hetjob_<id>.log, <id>/<step>.<task>.log)."""
    return render_sbatch(spec, paths.slurm_logs_dir)


def submit(spec: HetJobSpec, paths: RunPaths) -> str:
    """Submit and return the job id. Also keeps the rendered script in paths.slurm_dir."""
    paths.slurm_dir.mkdir(parents=True, exist_ok=True)
    (paths.slurm_dir / "hetjob.sbatch").write_text(render(spec, paths))
    return submit_hetjob(spec, paths.slurm_logs_dir)
