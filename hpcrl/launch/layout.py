"""Deployment layout: which roles run where (local machine or SLURM components). Pure functions."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config


@dataclass(frozen=True)
class Layout:
    """How a run is spread over machines. `gpus=0` means CPU processes."""

    target: str  # "local" | "slurm"
    train_nodes: int
    infer_nodes: int
    trainer_ranks: int  # total torch.distributed ranks
    ranks_per_train_node: int
    inference_servers: int  # total servers
    servers_per_infer_node: int
    gpus_per_trainer_rank: int
    gpus_per_server: int
    orchestrator_on: str
    notes: list[str] = field(default_factory=list)

    def summary(self) -> list[str]:
        dev = "GPU" if self.gpus_per_trainer_rank else "CPU"
        lines = [
            f"trainer:      {self.trainer_ranks} rank(s) on {self.train_nodes} node(s)"
            + (f", {self.gpus_per_trainer_rank} GPU each" if self.gpus_per_trainer_rank else " (CPU, gloo)"),
            f"inference:    {self.inference_servers} server(s) on {self.infer_nodes} node(s)"
            + (f", {self.gpus_per_server} GPU each" if self.gpus_per_server else " (CPU, embedded hf engine)"),
            f"orchestrator: 1 process beside {'trainer rank 0' if self.orchestrator_on == 'trainer' else 'inference server 0'}",
        ]
        if self.target == "local":
            lines.append(f"target:       this machine ({dev})")
        return lines + self.notes


def local_layout(cfg: Config, gpus_available: int = 0) -> Layout:
    """One machine: GPU counts from [deployment] when GPUs exist, else CPU ranks/servers."""
    d = cfg.deployment
    if gpus_available > 0 and d.num_train_gpus is not None:
        tg, ig = d.num_train_gpus, d.num_infer_gpus or 1
        if tg + ig > gpus_available:
            raise ConfigError("deployment.num_train_gpus", f"{tg} + {ig} GPUs requested but {gpus_available} visible")
        tp = cfg.inference.parallel.tp
        return Layout("local", 1, 1, tg, tg, ig // tp, ig // tp, 1, tp, "trainer")
    notes = []
    if d.num_train_gpus or d.num_infer_gpus or d.num_train_nodes:
        notes.append("note:         [deployment] GPU/node counts apply on GPUs / SLURM; this machine runs on CPU")
    ranks = d.num_trainer_ranks or 1
    servers = d.num_inference_servers or 1
    return Layout("local", 1, 1, ranks, ranks, servers, servers, 0, 0, "trainer", notes)


def slurm_layout(cfg: Config, nodes: int | None = None) -> Layout:
    """Heterogeneous job: component 0 = trainer nodes, component 1 = inference nodes.

    Node split: [deployment] num_train_nodes / num_infer_nodes when set; otherwise from --nodes (or
    slurm.nodes): half the nodes (rounded down, at least 1) train and the rest serve.
    """
    d = cfg.deployment
    s = cfg.slurm
    gpn = s.gpus_per_node if s is not None else d.gpus_per_node
    total = nodes if nodes is not None else (s.nodes if s is not None else None)
    if d.num_train_nodes is not None and d.num_infer_nodes is not None:
        tn, inn = d.num_train_nodes, d.num_infer_nodes
        if total is not None and tn + inn != total:
            raise ConfigError("--nodes", f"{total} != deployment num_train_nodes + num_infer_nodes ({tn + inn})")
    elif total is not None:
        if total < 2:
            raise ConfigError("--nodes", f"{total}: a heterogeneous job needs at least 2 nodes (1 trainer + 1 inference)")
        tn = max(1, total // 2)
        inn = total - tn
    elif d.num_train_gpus is not None or d.num_infer_gpus is not None:
        tn, inn = 1, 1
    else:
        raise ConfigError("--nodes", "give --nodes N or [deployment] num_train_nodes / num_infer_nodes")
    tp = cfg.inference.parallel.tp
    if gpn == 0:
        ranks_per_node = d.num_trainer_ranks or 1
        servers_per_node = 1
        return Layout("slurm", tn, inn, tn * ranks_per_node, ranks_per_node, inn, 1, 0, 0, d.orchestrator_node)
    if tp > gpn:
        raise ConfigError("inference.parallel.tp", f"{tp} exceeds slurm.gpus_per_node ({gpn})")
    servers_per_node = gpn // tp
    return Layout("slurm", tn, inn, tn * gpn, gpn, inn * servers_per_node, servers_per_node, 1, tp, d.orchestrator_node)
