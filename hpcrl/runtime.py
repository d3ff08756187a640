"""The per-process runtime: what every role does for itself when it starts, wherever it runs.

    start_process(cfg, paths, role, rank, port)   compute switch, own GPUs, placement record
    bind_gpus(os.environ)                          keep only this process's GPUs (before CUDA starts)
    use_cuda(cfg)                                  whether this process computes on CUDA
    weight_transport(cfg)                          `trainer.broadcast.transport` with "auto" decided
    record(paths, role, rank, port)                one line in logs/placement.jsonl

Ground floor: every role imports it; the plan of a whole run (which node and GPUs each process gets)
lives above, in hpcrl/launch/placement.py, and reaches processes through their environment
(HPCRL_GPUS_PER_TASK, the torchrun-style variables of `rank_env`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.paths import RunPaths

GPUS_PER_TASK_ENV = "HPCRL_GPUS_PER_TASK"  # set by the launcher / rendered job for each process


def cpu_compute(cfg: Config) -> bool:
    """`deployment.compute = "cpu"`: compute on CPU wherever the process runs."""
    return cfg.deployment.compute == "cpu"


def select_gpus(visible: list[str], need: int, local_id: int) -> list[str]:
    """The GPUs a process keeps of the `visible` ones: all of them when they are exactly `need`
    (SLURM --gpus-per-task or the local launcher bound it), else slice `local_id` of `need` each
    (--gpus-per-node: every task of a node sees all its GPUs). `need` 0 keeps none."""
    if need == 0:
        return []
    if len(visible) == need:
        return list(visible)
    start = local_id * need
    if len(visible) % need == 0 and start + need <= len(visible):
        return list(visible[start : start + need])
    raise ConfigError(
        "deployment",
        f"this process should own {need} GPU(s) (slot {local_id}) but sees "
        f"CUDA_VISIBLE_DEVICES={','.join(visible) or '(none)'}: the job's GPU "
        "request does not match the placement",
    )


def visible_list(environ: Mapping[str, str]) -> list[str] | None:
    v = environ.get("CUDA_VISIBLE_DEVICES")
    if v is None:
        return None
    return [x.strip() for x in v.split(",") if x.strip()]


def bind_gpus(environ: MutableMapping[str, str] | None = None) -> list[str] | None:
    """Narrow CUDA_VISIBLE_DEVICES to this process's own GPUs (before CUDA initialises).

    Needs HPCRL_GPUS_PER_TASK (set by the launcher and the rendered job); the slot is the task's
    index on its node (SLURM_LOCALID, else LOCAL_RANK). No-op when either is missing."""
    env = os.environ if environ is None else environ
    need = env.get(GPUS_PER_TASK_ENV)
    visible = visible_list(env)
    if need is None or visible is None:
        return visible
    local = int(env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or 0)
    keep = select_gpus(visible, int(need), local)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(keep)
    return keep


def rank_env(
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    *,
    local_rank: int | None = None,
    local_world: int | None = None,
) -> dict[str, str]:
    """The torchrun-style variables of one rank that we start ourselves (hpcrl.trainer.parallel.dist_env
    reads them; under srun the SLURM_* variables serve instead). By default every rank is on this
    machine: its local rank is its rank and the local world is the world. The GPU a rank uses is not
    decided here: bind_gpus narrows CUDA_VISIBLE_DEVICES by LOCAL_RANK."""
    local_rank = rank if local_rank is None else local_rank
    local_world = world if local_world is None else local_world
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise ValueError(f"rank {rank} (local {local_rank} of {local_world}) does not fit a world of {world}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master port {master_port} is not a TCP port")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def use_cuda(cfg: Config | None = None) -> bool:
    """Whether this process computes on CUDA: GPUs present and not `deployment.compute = "cpu"`."""
    if cfg is not None and cpu_compute(cfg):
        return False
    if os.environ.get("HPCRL_COMPUTE") == "cpu":  # set by roles from deployment.compute (children)
        return False
    import torch

    return torch.cuda.is_available()


def weight_transport(cfg: Config, uses_gpus: bool | None = None) -> str:
    """`trainer.broadcast.transport` with "auto" decided, the one rule: collective when the trainer
    computes on GPUs (NCCL), safetensors files on CPU or with delta sync. The launcher decides once
    from its placement
    (`uses_gpus`) and records the answer in the resolved configs, so launched roles never see "auto"
    and always agree; a role started by hand decides from what its own process sees (use_cuda)."""
    transport = cfg.trainer.broadcast.transport
    if transport != "auto":
        return transport
    if cfg.trainer.broadcast.delta:  # delta sync travels as files only (config refuses it collective)
        return "filesystem"
    if uses_gpus is None:
        uses_gpus = use_cuda(cfg)
    return "collective" if uses_gpus else "filesystem"


def apply_compute(cfg: Config) -> None:
    """Make `deployment.compute = "cpu"` visible to code that has no config (engine, weight group)."""
    if cpu_compute(cfg):
        os.environ["HPCRL_COMPUTE"] = "cpu"


# -- the record -----------------------------------------------------------------------------------
def _as_int(x: str) -> int | str:
    return int(x) if x.isdigit() else x  # GPU UUIDs stay strings


def placement_line(
    role: str, rank: int, port: int | None = None, environ: Mapping[str, str] | None = None
) -> dict:
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    return {
        "role": role,
        "rank": rank,
        "node": env.get("SLURMD_NODENAME") or host.split(".")[0],
        "gpus": [_as_int(g) for g in (visible_list(env) or [])],
        "host": host,
        "port": port,
        "pid": os.getpid(),
        "job": env.get("SLURM_JOB_ID"),
        "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
        "time": round(time.time(), 3),
    }


def record(
    paths: RunPaths, role: str, rank: int, port: int | None = None, extra: Mapping[str, object] | None = None
) -> dict:
    """Append this process's placement to logs/placement.jsonl (one O_APPEND write of one line,
    which local filesystems and Lustre keep whole) and keep it in logs/placement/<role>_<rank>.json
    (atomic replace: what `hpcrl status` shows even where appends from many nodes are not atomic)."""
    from hpcrl.fileio import write_atomic

    line = {**placement_line(role, rank, port), **(extra or {})}
    data = json.dumps(line, sort_keys=False)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.placement_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (data + "\n").encode())
    finally:
        os.close(fd)
    paths.placement_file(role, rank).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(paths.placement_file(role, rank), [data.encode()])
    return line


def read_records(paths: RunPaths) -> list[dict]:
    """The newest record of every process, ordered by role then rank."""
    out = []
    folder = paths.placement_file("trainer", 0).parent
    for f in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    order = {"trainer": 0, "inference": 1, "orchestrator": 2}
    return sorted(out, key=lambda r: (order.get(r.get("role"), 9), r.get("rank", 0)))


def start_process(cfg: Config, paths: RunPaths | None, role: str, rank: int, port: int | None = None) -> None:
    """What every role does first: compute device switch, own GPUs, placement record."""
    apply_compute(cfg)
    bind_gpus()
    if paths is not None:
        record(paths, role, rank, port)
