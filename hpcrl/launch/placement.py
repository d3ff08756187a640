"""Placement: which process runs on which node and which GPUs. The one module that decides.

    p = local_placement(cfg, visible_gpus())  /  slurm_placement(cfg, nodes, partition_gpus)
    p.trainer_slot(r).gpus, p.server_slot(i).gpus     node-local GPU indices of each process
    p.resources("trainer")                              what a SLURM component requests
    (what each process does for itself at start, bind_gpus / record, is hpcrl/runtime.py)

Rules (pure functions of `[deployment]`, `[slurm]` and `inference.parallel.tp`):
- A trainer rank owns one GPU; an inference server owns `tp` GPUs. No GPU is shared, none requested
  is left idle.
- `num_train_gpus` / `num_infer_gpus` size each role in GPUs. On one machine both share it (trainer
  GPUs first, then the servers'). On SLURM each role becomes one hetjob component: a role with at
  most `gpus_per_node` GPUs takes one node and requests exactly its GPUs (the hosted single-node
  shape asks for 1 trainer GPU and 1 inference GPU); a larger role takes whole nodes.
  `num_train_nodes` / `num_infer_nodes` size each role in whole nodes of `gpus_per_node` GPUs.
- SLURM requests: each component asks `--gpus-per-node=G` with one task per trainer rank / server,
  so every task of a node is allocated the node's G GPUs (no cgroup hides a peer's GPU, NCCL keeps
  its peer-to-peer paths); each process then keeps slot `SLURM_LOCALID` of them (`bind_gpus`:
  GPU k for trainer rank k of the node, GPUs [k*tp, (k+1)*tp) for server k). A process that is
  already bound to exactly its count (the local launcher, a site's --gpus-per-task policy) keeps it.
- `deployment.compute = "cpu"` makes processes compute on CPU (torch device, hf engine, gloo)
  wherever they run. It is read by `use_cuda` only; placement, the job's GPU requests and the
  binding are the same as on GPUs (that is how a fake-GPU SLURM rehearses a GPU job).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError
from hpcrl.runtime import cpu_compute

if TYPE_CHECKING:
    from hpcrl.config.schema import Config


@dataclass(frozen=True)
class Slot:
    """One process: its role, rank (trainer rank / server index), node index within its role's
    nodes, index among its role's processes on that node, and node-local GPU indices."""

    role: str
    rank: int
    node: int
    local: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    target: str  # "local" | "slurm"
    train_nodes: int
    infer_nodes: int
    ranks_per_train_node: int
    servers_per_infer_node: int
    gpus_per_trainer_rank: int  # 0: CPU processes
    gpus_per_server: int  # tp on GPUs, 0 on CPU
    orchestrator_on: str = "trainer"
    infer_gpu_offset: int = 0  # one machine: the servers' GPUs come after the trainer's
    cpu_compute: bool = False  # deployment.compute = "cpu": GPUs placed, CPU computes
    env_nodes: int = 0  # SLURM: CPU nodes of the env servers' own component (deployment.env_nodes)
    notes: tuple[str, ...] = field(default=())

    @property
    def trainer_ranks(self) -> int:
        return self.train_nodes * self.ranks_per_train_node

    @property
    def inference_servers(self) -> int:
        return self.infer_nodes * self.servers_per_infer_node

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_trainer_rank > 0

    def trainer_slot(self, rank: int) -> Slot:
        node, local = divmod(rank, self.ranks_per_train_node)
        g = self.gpus_per_trainer_rank
        return Slot("trainer", rank, node, local, tuple(range(local * g, (local + 1) * g)))

    def server_slot(self, index: int) -> Slot:
        node, local = divmod(index, self.servers_per_infer_node)
        g = self.gpus_per_server
        start = self.infer_gpu_offset + local * g
        return Slot("inference", index, node, local, tuple(range(start, start + g)))

    def slots(self) -> list[Slot]:
        return [self.trainer_slot(r) for r in range(self.trainer_ranks)] + [
            self.server_slot(i) for i in range(self.inference_servers)
        ]

    def resources(self, role: str) -> dict[str, int | None]:
        """What one SLURM component asks for: tasks per node and its GPU request."""
        if role == "envs":  # one env host per node; it starts that node's env servers
            return {"nodes": self.env_nodes, "ntasks_per_node": 1, "gpus_per_node": None}
        if role == "trainer":
            g = self.gpus_per_trainer_rank * self.ranks_per_train_node
            return {
                "nodes": self.train_nodes,
                "ntasks_per_node": self.ranks_per_train_node,
                "gpus_per_node": g or None,
            }
        g = self.gpus_per_server * self.servers_per_infer_node
        return {
            "nodes": self.infer_nodes,
            "ntasks_per_node": self.servers_per_infer_node,
            "gpus_per_node": g or None,
        }

    def gpus_per_task(self, role: str) -> int:
        return {"trainer": self.gpus_per_trainer_rank, "inference": self.gpus_per_server}.get(role, 0)

    def summary(self) -> list[str]:
        cpu = " (CPU compute)" if self.cpu_compute else ""
        lines = [
            f"trainer:      {self.trainer_ranks} rank(s) on {self.train_nodes} node(s)"
            + (f", {self.gpus_per_trainer_rank} GPU each{cpu}" if self.uses_gpus else " (CPU, gloo)"),
            f"inference:    {self.inference_servers} server(s) on {self.infer_nodes} node(s)"
            + (
                f", {self.gpus_per_server} GPU(s) each (tp){cpu}"
                if self.gpus_per_server
                else " (CPU, embedded hf engine)"
            ),
            f"orchestrator: 1 process beside "
            f"{'trainer rank 0' if self.orchestrator_on == 'trainer' else 'inference server 0'}",
        ]
        if self.env_nodes:
            lines.append(f"env servers:  on {self.env_nodes} CPU node(s) of their own (component envs)")
        if self.target == "local":
            lines.append(f"target:       this machine ({'GPU' if self.uses_gpus else 'CPU'})")
        return lines + list(self.notes)

    def plan(self, limit: int = 4) -> list[str]:
        """The --dry-run placement plan: every node's processes and GPUs (first and last nodes of a
        big job; every node is laid out alike)."""
        if not self.uses_gpus:
            return []
        out = ["placement:"]
        for role, nodes, per_node, slot in (
            ("trainer", self.train_nodes, self.ranks_per_train_node, self.trainer_slot),
            ("inference", self.infer_nodes, self.servers_per_infer_node, self.server_slot),
        ):
            shown = list(range(nodes)) if nodes <= limit else [0, 1, nodes - 1]
            for n in shown:
                if n == nodes - 1 and nodes > limit:
                    out.append(f"  {role} nodes 2..{nodes - 2}: same pattern")
                procs = [slot(n * per_node + k) for k in range(per_node)]
                where = "this machine" if self.target == "local" else f"{role} node {n}"
                parts = [
                    f"{'rank' if role == 'trainer' else 'server'} {s.rank} -> GPU {_gpu_list(s.gpus)}"
                    for s in procs
                ]
                out.append(f"  {where}: " + ", ".join(parts))
        res = [self.resources(r) for r in ("trainer", "inference")] if self.target == "slurm" else []
        for role, r in zip(("trainer", "inference"), res):
            out.append(
                f"  sbatch {role}: --nodes={r['nodes']} --ntasks-per-node={r['ntasks_per_node']} "
                f"--gpus-per-node={r['gpus_per_node']}"
            )
        return out


def _gpu_list(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


# -- deciding ------------------------------------------------------------------------------------
def _tp(cfg: Config) -> int:
    return cfg.inference.parallel.tp


def local_placement(cfg: Config, gpus_available: int = 0) -> Placement:
    """One machine: GPU counts from [deployment] when GPUs exist, else CPU ranks/servers."""
    d = cfg.deployment
    if d.env_nodes:
        raise ConfigError(
            "deployment.env_nodes",
            f"{d.env_nodes}: env nodes of their own exist only in a SLURM job (hpcrl submit); "
            "use 0 with hpcrl run (env servers run beside the orchestrator)",
        )
    tp = _tp(cfg)
    if gpus_available > 0 and d.num_train_gpus is not None:
        tg, ig = d.num_train_gpus, d.num_infer_gpus or tp
        if tg + ig > gpus_available:
            raise ConfigError(
                "deployment.num_train_gpus",
                f"{tg} trainer + {ig} inference GPUs requested but {gpus_available} visible",
            )
        if ig % tp:
            raise ConfigError("inference.parallel.tp", f"{tp} does not divide num_infer_gpus ({ig})")
        return Placement(
            "local", 1, 1, tg, ig // tp, 1, tp, "trainer", infer_gpu_offset=tg, cpu_compute=cpu_compute(cfg)
        )
    notes = []
    if d.num_train_gpus or d.num_infer_gpus or d.num_train_nodes:
        notes.append(
            "note:         [deployment] GPU/node counts apply on GPUs / SLURM; this machine runs on CPU"
        )
    ranks = d.num_trainer_ranks or 1
    servers = d.num_inference_servers or 1
    return Placement("local", 1, 1, ranks, servers, 0, 0, "trainer", notes=tuple(notes))


def _nodes_for(gpus: int, gpn: int, field_name: str) -> tuple[int, int]:
    """(nodes, GPUs per node) for a role of `gpus` GPUs on nodes of `gpn`: one partial node, or
    whole nodes."""
    if gpus <= gpn:
        return 1, gpus
    if gpus % gpn:
        raise ConfigError(
            field_name,
            f"{gpus} GPUs do not fill whole nodes of gpus_per_node = {gpn}; "
            f"use at most {gpn} or a multiple of it",
        )
    return gpus // gpn, gpn


def slurm_placement(cfg: Config, nodes: int | None = None, partition_gpus: int | None = None) -> Placement:
    """Heterogeneous job: component 0 = trainer nodes, component 1 = inference nodes.

    `partition_gpus`: the most GPUs a node of the partition has (sinfo), to reject what cannot run.
    """
    d, s = cfg.deployment, cfg.slurm
    gpn = s.gpus_per_node if s is not None else d.gpus_per_node
    gpn_field = "slurm.gpus_per_node" if s is not None else "deployment.gpus_per_node"
    total = nodes if nodes is not None else (s.nodes if s is not None else None)
    if total is not None and d.env_nodes:  # --nodes counts the env nodes too
        if total - d.env_nodes < 2:
            raise ConfigError(
                "--nodes",
                f"{total}: {d.env_nodes} env node(s) (deployment.env_nodes) leave fewer than 2 nodes "
                "for 1 trainer + 1 inference",
            )
        total -= d.env_nodes
    p = _slurm_roles(cfg, d, s, gpn, gpn_field, total, partition_gpus)
    return replace(p, env_nodes=d.env_nodes)


def _slurm_roles(
    cfg, d, s, gpn: int, gpn_field: str, total: int | None, partition_gpus: int | None
) -> Placement:
    tp = _tp(cfg)
    if gpn == 0:
        return _cpu_slurm(cfg, total)
    if d.num_train_gpus is not None or d.num_infer_gpus is not None:
        tn, t_per = _nodes_for(d.num_train_gpus or 1, gpn, "deployment.num_train_gpus")
        inn, i_per = _nodes_for(d.num_infer_gpus or tp, gpn, "deployment.num_infer_gpus")
        if total is not None and total != tn + inn:
            raise ConfigError(
                "--nodes",
                f"{total} != the {tn + inn} node(s) [deployment] GPU counts need "
                f"({tn} trainer + {inn} inference)",
            )
    else:
        tn, inn = _node_split(d, total)
        t_per = i_per = gpn
    if tp > i_per or i_per % tp:
        raise ConfigError(
            "inference.parallel.tp", f"{tp} does not divide the {i_per} GPU(s) of an inference node"
        )
    if partition_gpus is not None:
        need = max(t_per, i_per)
        if need > partition_gpus:
            part = f"partition '{s.partition}'" if s is not None and s.partition else "the default partition"
            raise ConfigError(
                gpn_field if need == gpn else "deployment",
                f"{need} GPUs per node requested but nodes of {part} have at most {partition_gpus} (sinfo)",
            )
    return Placement(
        "slurm", tn, inn, t_per, i_per // tp, 1, tp, d.orchestrator_node, cpu_compute=cpu_compute(cfg)
    )


def _node_split(d, total: int | None) -> tuple[int, int]:
    """Node counts: [deployment] num_train_nodes / num_infer_nodes, else half of --nodes train."""
    if d.num_train_nodes is not None and d.num_infer_nodes is not None:
        tn, inn = d.num_train_nodes, d.num_infer_nodes
        if total is not None and tn + inn != total:
            raise ConfigError(
                "--nodes", f"{total} != deployment num_train_nodes + num_infer_nodes ({tn + inn})"
            )
        return tn, inn
    if total is None:
        raise ConfigError("--nodes", "give --nodes N or [deployment] num_train_nodes / num_infer_nodes")
    if total < 2:
        raise ConfigError(
            "--nodes", f"{total}: a heterogeneous job needs at least 2 nodes (1 trainer + 1 inference)"
        )
    tn = max(1, total // 2)
    return tn, total - tn


def _cpu_slurm(cfg: Config, total: int | None) -> Placement:
    d = cfg.deployment
    if d.num_train_gpus is not None or d.num_infer_gpus is not None:
        tn, inn = 1, 1
        if total is not None and total != 2:
            raise ConfigError(
                "--nodes", f"{total}: [deployment] GPU counts on CPU nodes make 1 trainer + 1 inference node"
            )
    else:
        tn, inn = _node_split(d, total)
    return Placement("slurm", tn, inn, d.num_trainer_ranks or 1, 1, 0, 0, d.orchestrator_node)


# -- binding (each process, at start) ---------------------------------------------------------------
