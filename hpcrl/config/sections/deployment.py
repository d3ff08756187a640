"""Where processes run: [deployment] (GPUs, nodes, process counts) and [slurm] (`hpcrl submit`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import MAX_GPU_MEMORY_GIB, MAX_GPUS_PER_NODE, D, Section


class DeploymentConfig(Section):
    num_train_gpus: Annotated[Annotated[int, Meta(ge=0)] | None, D("Single node: GPUs for the trainer.")] = (
        None
    )
    num_infer_gpus: Annotated[Annotated[int, Meta(ge=0)] | None, D("Single node: GPUs for inference.")] = None
    num_train_nodes: Annotated[Annotated[int, Meta(ge=1)] | None, D("Multi-node: trainer nodes.")] = None
    num_infer_nodes: Annotated[Annotated[int, Meta(ge=1)] | None, D("Multi-node: inference nodes.")] = None
    gpus_per_node: Annotated[int, D("GPUs on each node (multi-node layout).", ge=0, le=MAX_GPUS_PER_NODE)] = 8
    num_trainer_ranks: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D("CPU: trainer processes (default 1; on GPU one per trainer GPU)."),
    ] = None
    num_inference_servers: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("CPU: inference servers (default 1).")
    ] = None
    orchestrator_node: Annotated[
        Literal["trainer", "inference"], D("Where the orchestrator runs on SLURM.")
    ] = "trainer"
    env_nodes: Annotated[
        int,
        D(
            "SLURM: CPU nodes of their own for the env servers, one more hetjob component (envs); env "
            "servers are spread over them and reach the orchestrator through the run directory. "
            "0 = env servers run beside the orchestrator, which starts them (hpcrl run: must be 0).",
            ge=0,
        ),
    ] = 0
    env_partition: Annotated[
        str | None, D("SLURM partition of the env nodes (default: slurm.partition); env_nodes > 0 only.")
    ] = None
    compute: Annotated[
        Literal["auto", "cpu"],
        D(
            "auto: CUDA where present. cpu: every role computes on CPU even where GPUs are allocated "
            "(rehearse a GPU job on a fake-GPU SLURM); placement and GPU requests are unchanged."
        ),
    ] = "auto"
    gpu_memory_gib: Annotated[
        float,
        D(
            "Memory of one GPU in GiB: the --dry-run memory plan refuses a trainer rank or inference server "
            "that cannot fit it (GPU compute only; with compute = cpu the plan is information).",
            gt=0,
            le=MAX_GPU_MEMORY_GIB,
        ),
    ] = 80.0
    max_server_restarts: Annotated[
        int,
        D(
            "Times the supervisor (hpcrl run, or the SLURM server step) restarts one dead inference server "
            "before giving up (0 = a dead server ends the job).",
            ge=0,
        ),
    ] = 5


class SlurmConfig(Section):
    partition: Annotated[str | None, D("SLURM partition.")] = None
    account: Annotated[str | None, D("SLURM account.")] = None
    qos: Annotated[str | None, D("SLURM QOS.")] = None
    time: Annotated[str, D("Walltime (HH:MM:SS or D-HH:MM:SS).")] = "24:00:00"
    job_name: Annotated[str | None, D("Job name (default: the run name).")] = None
    gpus_per_node: Annotated[int, D("GPUs requested per node.", ge=0, le=MAX_GPUS_PER_NODE)] = 8
    cpus_per_task: Annotated[int, D("CPUs per task.", ge=1)] = 1
    mem: Annotated[str | None, D("Memory per node (e.g. 0, 400G).")] = None
    constraint: Annotated[str | None, D("Node feature constraint.")] = None
    nodes: Annotated[
        Annotated[int, Meta(ge=2)] | None, D("Total nodes (split by deployment or 1 : rest).")
    ] = None
    signal_before_s: Annotated[int, D("Seconds before the time limit to checkpoint and requeue.", ge=10)] = (
        300
    )
    requeue: Annotated[bool, D("Requeue on preemption / time limit and resume automatically.")] = True
    extra_sbatch: Annotated[list[str], D("Extra #SBATCH options, e.g. ['--exclusive'].")] = msgspec.field(
        default_factory=list
    )
    setup: Annotated[list[str], D("Shell lines run on every node before the job (module load, venv).")] = (
        msgspec.field(default_factory=list)
    )
    pre_run_command: Annotated[
        str | None,
        D(
            "A shell command the batch script runs once, after env_files and the setup lines and before any "
            "role starts (prime-rl's: cleanup, `uv sync`; wrap it in `srun bash -c '...'` for every node)."
        ),
    ] = None
