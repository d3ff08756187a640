"""What the partition's nodes offer (sinfo), and whether each hetjob component fits one of them.

    nodes = partition_nodes(cfg.slurm.partition)          # [NodeOffer] from sinfo; None: no sinfo
    check_components(component_requests(cfg, placement), nodes, label)   # ConfigError if not

`sbatch --test-only` answers a component that no node can hold with "Requested node configuration
is not available" and no hint; `hpcrl submit` checks here first, so the user learns which component
asks what, what the nodes have, and which field to change. GPUs per node are checked while placing
(hpcrl.launch.placement.slurm_placement, `partition_gpus`); CPUs (tasks per node x cpus_per_task) and
memory per node (`slurm.mem`) here. Pure functions except `partition_nodes`, which runs sinfo.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.launch.placement import Placement

SINFO_FORMAT = "%N|%c|%m|%G"  # node name | CPUs | memory (MB) | GRES


@dataclass(frozen=True)
class NodeOffer:
    name: str
    cpus: int
    mem_mb: int
    gpus: int
    gpu_types: tuple[str, ...] = ()  # GRES types ('gpu:h100:8' -> 'h100'); empty when untyped


@dataclass(frozen=True)
class ComponentRequest:
    """What one hetjob component asks of each of its nodes, and the fields that set it."""

    role: str
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    mem_mb: int | None  # None: not requested (SLURM's default), 0: all of the node's memory
    gpus_per_node: int
    tasks_field: str  # the field that sets tasks per node
    mem_field: str = "slurm.mem"  # where the memory request comes from


def gres_gpus(gres: str) -> int:
    """GPUs in a sinfo GRES string: 'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:8' -> 4, 8, 2; '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
    return total


def gres_gpu_types(gres: str) -> tuple[str, ...]:
    """GPU types in a sinfo GRES string: 'gpu:h100:8(S:0-1)' -> ('h100',); 'gpu:4' -> ()."""
    return tuple(
        m.group(1).lower()
        for item in gres.split(",")
        if (m := re.match(r"gpu:([^:(\d][^:(]*):\d+", item.strip()))
    )


def parse_sinfo(text: str) -> list[NodeOffer]:
    """Nodes of `sinfo -h -N -o '%N|%c|%m|%G'` output, each once (sinfo -N repeats a node per
    partition). Lines that do not parse are skipped."""
    out: dict[str, NodeOffer] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            continue
        name, cpus, mem, gres = parts
        try:
            offer = NodeOffer(
                name, int(cpus.rstrip("+")), int(mem.rstrip("+")), gres_gpus(gres), gres_gpu_types(gres)
            )
        except ValueError:
            continue
        out.setdefault(name, offer)
    return list(out.values())


def partition_nodes(partition: str | None) -> list[NodeOffer] | None:
    """The nodes of `partition` (default partition when None) as sinfo reports them; None when
    there is no sinfo or it gives no answer (the checks are then left to sbatch)."""
    cmd = ["sinfo", "-h", "-N", "-o", SINFO_FORMAT] + (["-p", partition] if partition else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    return parse_sinfo(p.stdout) or None


def partition_max_gpus(partition: str | None) -> int | None:
    """The most GPUs one node of `partition` has, from `sinfo` (None: no sinfo or no answer)."""
    nodes = partition_nodes(partition)
    return None if nodes is None else max(n.gpus for n in nodes)


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_mem_mb(mem: str, field: str = "slurm.mem") -> int:
    """SLURM's --mem syntax in MB: '0' (all of the node), '2048' (MB), '512M', '64G', '1T'."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGTkmgt]?)[Bb]?\s*", mem)
    if not m:
        raise ConfigError(field, f"{mem!r} is not a SLURM memory size (e.g. 0 for all, 2048, 512M, 64G, 1T)")
    return int(int(m.group(1)) * _MEM_UNITS[(m.group(2) or "M").upper()])


def component_requests(cfg: Config, placement: Placement) -> list[ComponentRequest]:
    """The trainer and inference components as `hpcrl.launch.slurm.build_spec` renders them."""
    s, d = cfg.slurm, cfg.deployment
    assert s is not None
    mem = parse_mem_mb(s.mem) if s.mem is not None else None
    mem_field = "slurm.mem"
    from hpcrl.launch.slurm import split_extra_sbatch

    for opt in split_extra_sbatch(s.extra_sbatch)[1]:  # a component's own --mem / --mem-per-cpu win
        name, _, value = opt.partition("=")
        if name in ("--mem", "--mem-per-cpu") and value:
            mem = parse_mem_mb(value, "slurm.extra_sbatch") * (
                s.cpus_per_task if name == "--mem-per-cpu" else 1
            )
            mem_field = f"slurm.extra_sbatch ({name})"
    out = []
    # env nodes on a partition of their own (deployment.env_partition) are not counted against this one
    envs = ("envs",) if placement.env_nodes and not d.env_partition else ()
    for role in ("trainer", "inference", *envs):
        r = placement.resources(role)
        if role == "envs":
            tasks = "deployment.env_nodes"
        elif not placement.uses_gpus:
            tasks = "deployment.num_trainer_ranks" if role == "trainer" else "--nodes"
        elif role == "trainer":
            tasks = "deployment.num_train_gpus" if d.num_train_gpus is not None else "slurm.gpus_per_node"
        else:
            tasks = "deployment.num_infer_gpus" if d.num_infer_gpus is not None else "slurm.gpus_per_node"
            tasks += " or inference.parallel.tp"
        gpus = r["gpus_per_node"] or 0
        out.append(
            ComponentRequest(
                role,
                r["nodes"],
                r["ntasks_per_node"],
                s.cpus_per_task,
                mem * r["ntasks_per_node"] if mem and "mem-per-cpu" in mem_field else mem,
                gpus,
                tasks,
                mem_field,
            )
        )
    return out


def _fits(req: ComponentRequest, node: NodeOffer) -> bool:
    cpus_ok = req.ntasks_per_node * req.cpus_per_task <= node.cpus
    mem_ok = not req.mem_mb or req.mem_mb <= node.mem_mb
    return cpus_ok and mem_ok and req.gpus_per_node <= node.gpus


def check_components(requests: list[ComponentRequest], nodes: list[NodeOffer], where: str) -> None:
    """Refuse (ConfigError, one line) a component whose per-node CPUs or memory no node of the
    partition has, or components that together need more such nodes than exist (hetjob components
    never share a node). `where` names the partition in the message."""
    used: set[str] = set()
    for req in requests:
        cpus = req.ntasks_per_node * req.cpus_per_task
        most_cpus = max(n.cpus for n in nodes)
        if cpus > most_cpus:
            ask = f"{req.ntasks_per_node} task(s) x {req.cpus_per_task} CPU(s) = {cpus} CPUs per node"
            if req.cpus_per_task > 1 and req.ntasks_per_node <= most_cpus:
                field, fix = (
                    "slurm.cpus_per_task",
                    f"lower slurm.cpus_per_task to {most_cpus // req.ntasks_per_node}",
                )
            else:
                field, fix = req.tasks_field.split(" ")[0], f"fewer tasks per node ({req.tasks_field})"
                if req.cpus_per_task > 1:
                    fix += " or lower slurm.cpus_per_task"
            raise ConfigError(
                field,
                f"the {req.role} component asks {ask} but nodes of {where} have at most {most_cpus} "
                f"CPUs (sinfo); {fix}",
            )
        most_mem = max(n.mem_mb for n in nodes)
        if req.mem_mb and req.mem_mb > most_mem:
            field = req.mem_field.split(" ")[0]
            raise ConfigError(
                field,
                f"the {req.role} component asks {req.mem_mb} MB per node but nodes of {where} have at most "
                f"{most_mem} MB (sinfo); lower {req.mem_field}"
                + (" (0 = all of a node's memory)" if field == "slurm.mem" else ""),
            )
        free = [n for n in nodes if n.name not in used and _fits(req, n)]
        if len(free) < req.nodes:
            raise ConfigError(
                "deployment.env_nodes" if req.role == "envs" else "--nodes",
                f"the {req.role} component needs {req.nodes} node(s) with {cpus} CPUs"
                + (f", {req.mem_mb} MB" if req.mem_mb else "")
                + (f", {req.gpus_per_node} GPUs" if req.gpus_per_node else "")
                + f" but {where} has {len(free)} more such node(s) (sinfo; hetjob components never share a node)",
            )
        used.update(n.name for n in free[: req.nodes])
