"""The dry-run host-memory plan: what a trainer node and an inference node hold in host memory at a
weight sync and a checkpoint, against the node's memory (sinfo) and `slurm.mem`.

    host = host_plan(cfg, placement)           # HostPlan, or None when the architecture is unknown
    host.lines()                               # the dry-run lines: one per trainer / inference node
    host.check(limit_mb_trainer, limit_mb_inference)   # ConfigError (one line) when a node cannot fit

Pure functions of the config, the placement and the model's parameter count P (hpcrl.models.arch),
in the policy dtype (the trainer's compute dtype: the publish and the HF export cast to it).
Per trainer rank, S = P / ranks x dtype bytes its shard, B = trainer.broadcast.bucket_mb (the
protocol-4 weight sync of issue 49; the GPU side is hpcrl.launch.memory_plan's "weight publish"):
  sharded publish, collective      0: every rank casts its pieces lazily and sends them from its GPU
                                   (its largest cast piece + a scratch bucket of chunk_mb / ranks +
                                   its communicators: the GPU plan)
  sharded publish, filesystem      B: one bucket of pieces being written (its largest cast piece is
                                   on the GPU)
    + delta                        + S pieces on the host to diff + S "delta base (previous shard)"
                                   (hpcrl/trainer/sharded_publish.py keeps both on the host)
  gathered (sharded = false)       P on every rank, + P on rank 0 with delta (its previous policy)
(delta sync travels as files only: the config refuses it with the collective transport, and with
inference.backend = "vllm")
  checkpoint HF export             rank 0: one file (EXPORT_FILE_BYTES) + the largest tensor it is
                                   assembling (hpcrl/trainer/stream.py export_hf_streamed); other ranks
                                   send their rows from the device. Only when the checkpoint writes HF
                                   weights (ckpt set, ckpt.hf_weights: auto = a policy <= 16 GiB)
A rank's figure is the larger of its publish and its checkpoint (they run one after the other; the
allocator reuses the first publish's memory).
Per inference server while loading a policy (L = the largest tensor in the policy dtype):
  collective                       0: one receiving process per server (vLLM: TP worker 0, which
                                   forwards each round down a chain of its followers) holds its round
                                   buffers, the assembly and its communicators on the GPU (the GPU
                                   plan's "weight receive")
  filesystem, sharded              vLLM: every tp worker assembles one whole tensor for load_weights:
                                   tp x L; hf engine: copies each piece into its parameters: one piece,
                                   at most B
  filesystem, sharded = false      one file: the whole dict, tp x P (vLLM) or P (hf engine)
  delta                            nothing more: the hf engine applies a delta in place to the
                                   parameters it serves (its base); vLLM cannot (refused at load)
Every process adds PROCESS_BASE_GIB. A node's figure: the processes placed on it (ranks per trainer
node, servers x tp workers per inference node), rank 0's node for the trainer.

`hpcrl run` (one machine, `local_check`): every process it starts shares this machine's memory
(/proc/meminfo MemTotal, or the cgroup's limit when lower): the trainer node's and the inference
node's figures above, the orchestrator, and, computing on CPU, each trainer rank's training state
(the memory plan's per-rank parameters, gradients, optimizer, activations and logits, in the CPU
dtypes: on CPU the "device" is host memory). A CPU process counts CPU_PROCESS_BASE_GIB (no CUDA).
Refused (one line) when the processes compute on GPUs; computing on CPU the lines inform, as every
other memory plan does on CPU (`LocalPlan.check` is the same either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError
from hpcrl.models.arch import find_arch

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.launch.placement import Placement

GIB = 1024**3
MIB = 1024**2
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Per process (trainer rank or inference worker): Python + torch + the CUDA context's host side.
# Issue 39 measured a 302 M-parameter trainer rank (gloo, CPU) at 3.0 GB peak RSS of which 0.6 GB was
# the publish: ~2.4 GB of interpreter, torch and the training step; the CUDA context and its pinned
# staging add ~1 GB of host memory per process on a GPU. Rounded up.
PROCESS_BASE_GIB = 4.0
# A process computing on CPU (no CUDA context, no pinned staging): Python + torch + transformers with
# the tiny model loaded measured 0.36 GB peak RSS here; rounded up for the training step, the bus and a
# server's HTTP stack.
CPU_PROCESS_BASE_GIB = 1.0
EXPORT_FILE_BYTES = 2**30  # export_hf_streamed's max_shard_bytes: rank 0 holds one file's tensors


@dataclass(frozen=True)
class NodeHost:
    role: str  # trainer / inference
    processes: int
    held_gib: float  # what the syncs hold on the node, all processes
    base_gib: float  # processes x PROCESS_BASE_GIB
    note: str

    @property
    def total_gib(self) -> float:
        return self.held_gib + self.base_gib


def trainer_rank_gib(
    params: int,
    ranks: int,
    dtype_bytes: int,
    *,
    sharded: bool = True,
    collective: bool = False,
    delta: bool = False,
    bucket_mb: int = 256,
    rank0: bool = False,
    largest_tensor: int = 0,
    hf_weights: bool = True,
) -> float:
    """GiB of host memory one trainer rank holds at a publish or a checkpoint's HF export, whichever is
    larger (see the module docstring)."""
    policy = params * dtype_bytes
    shard, bucket = policy / ranks, min(bucket_mb * MIB, policy)  # a bucket never exceeds the policy
    if not sharded:  # the gathered path
        publish = policy + (policy if delta and rank0 else 0)
    elif collective:  # sent from the GPU (the GPU plan's weight publish)
        publish = 0.0
    else:  # one bucket; with delta its pieces to diff and the delta base (previous shard)
        publish = bucket + (2 * shard if delta else 0)
    export = min(EXPORT_FILE_BYTES, policy) + largest_tensor * dtype_bytes if rank0 and hf_weights else 0
    return max(publish, export) / GIB


def server_gib(
    params: int,
    dtype_bytes: int,
    *,
    tp: int,
    vllm: bool,
    collective: bool,
    bucket_mb: int = 256,
    sharded: bool = True,
    largest_tensor: int = 0,
) -> float:
    """GiB of host memory one inference server holds while loading a policy (all its tp workers).
    Delta sync adds nothing: the hf engine applies it in place (see the module docstring)."""
    if collective:  # received on the GPU
        return 0.0
    policy = params * dtype_bytes
    if not sharded:  # one file: the whole dict, in every worker
        return (tp if vllm else 1) * policy / GIB
    if vllm:  # one assembled tensor at a time, in every worker
        return tp * largest_tensor * dtype_bytes / GIB
    return min(bucket_mb * MIB, policy) / GIB  # hf engine: one piece (at most a bucket)


@dataclass
class HostPlan:
    trainer: NodeHost
    inference: NodeHost
    sharded: bool
    delta: bool
    collective: bool

    def lines(self, limits_mb: tuple[int | None, int | None] = (None, None)) -> list[str]:
        out = ["  host memory per node (syncs + checkpoint HF export; "
               f"{PROCESS_BASE_GIB:g} GiB a process for Python, torch, CUDA):"]  # fmt: skip
        for node, limit in zip((self.trainer, self.inference), limits_mb):
            of = f" of {limit / 1024:.0f} GiB" if limit else ""
            out.append(
                f"    {node.role} node: {node.total_gib:.1f} GiB{of} ({node.processes} processes: "
                f"{node.held_gib:.1f} held by syncs, {node.base_gib:.1f} baseline; {node.note})"
            )
        return out

    def check(self, limits_mb: tuple[int | None, int | None], mem_set: bool = False) -> None:
        """One-line refusal when a trainer or inference node's host memory cannot hold the plan.
        A limit of None or 0 (no memory information) is not checked."""
        for node, limit in zip((self.trainer, self.inference), limits_mb):
            if not limit or node.total_gib * 1024 <= limit:
                continue
            field, fix = self._fix(node, mem_set)
            raise ConfigError(
                field,
                f"{'an' if node.role == 'inference' else 'a'} {node.role} node needs {node.total_gib:.0f} GiB of host memory at a weight sync "
                f"({node.note}) but has {limit / 1024:.0f} GiB: {fix}",
            )

    def _fix(self, node: NodeHost, mem_set: bool) -> tuple[str, str]:
        more = "or more nodes"
        if mem_set:
            more = "raise slurm.mem (0 = all of a node's memory) " + more
        if node.role == "trainer":
            if not self.sharded:
                return (
                    "trainer.broadcast.sharded",
                    f"trainer.broadcast.sharded = true (one bucket per rank), {more}",
                )
            if self.delta:
                return (
                    "trainer.broadcast.delta",
                    f"trainer.broadcast.delta = false (each rank keeps its pieces and the delta base "
                    f"(previous shard) on the host), {more}",
                )
            return (
                "trainer.broadcast.bucket_mb",
                f"a smaller trainer.broadcast.bucket_mb, {more} (deployment.num_train_nodes)",
            )
        if not self.collective and not self.sharded:
            return (
                "trainer.broadcast.sharded",
                f"trainer.broadcast.sharded = true (a server then loads one tensor at a time), {more}",
            )
        return "inference.parallel.tp", f"fewer servers per node (inference.parallel.tp), {more}"


def host_plan(
    cfg: Config, placement: Placement, compute: str = "bfloat16", base_gib: float = PROCESS_BASE_GIB
) -> HostPlan | None:
    """The host-memory plan of `cfg` placed as `placement`, the policy in `compute` (the trainer's
    compute dtype), `base_gib` a process; None when the model's architecture is unknown here."""
    from hpcrl.launch.memory_plan import largest_tensor, serves_with_vllm, sync_transport

    model = cfg.trainer.model or cfg.model
    arch = find_arch(model.name or cfg.model.name)
    if arch is None:
        return None
    b = cfg.trainer.broadcast
    collective = sync_transport(cfg, placement) == "collective"  # auto: collective on GPUs, else files
    nbytes = BYTES.get(compute, 2)
    ranks, rpn = placement.trainer_ranks, placement.ranks_per_train_node
    largest = largest_tensor(arch)
    from hpcrl.checkpoint import writes_hf_weights

    c = cfg.ckpt  # the checkpoint's HF weights (rank 0 alone) only when ckpt.hf_weights writes them
    hf = c is not None and writes_hf_weights(c.hf_weights, c.weights_only, arch.params * nbytes)
    kw = dict(
        sharded=b.sharded, collective=collective, delta=b.delta, bucket_mb=b.bucket_mb, largest_tensor=largest,
        hf_weights=hf,
    )  # fmt: skip
    r0 = trainer_rank_gib(arch.params, ranks, nbytes, rank0=True, **kw)
    other = trainer_rank_gib(arch.params, ranks, nbytes, **kw)
    path = "gathered" if not b.sharded else "sharded"
    how = f"{path}, {'collective' if collective else 'filesystem'}" + (", delta" if b.delta else "")
    shard = arch.params * nbytes / ranks / GIB
    if not b.sharded:
        terms = "the whole policy" + (" (+ the previous one on rank 0)" if b.delta else "")
    elif collective:
        terms = "pieces sent from the GPU"
    else:
        terms = f"bucket {min(b.bucket_mb * MIB, arch.params * nbytes) / GIB:.2f}" + (
            f" + pieces to diff {shard:.2f} + delta base (previous shard) {shard:.2f}" if b.delta else ""
        )
    trainer = NodeHost(
        "trainer", rpn, r0 + (rpn - 1) * other, rpn * base_gib,
        f"{how}: rank 0 {r0:.1f} + {rpn - 1} x {other:.1f} GiB, {terms}",
    )  # fmt: skip
    tp, servers = cfg.inference.parallel.tp, placement.servers_per_infer_node
    vllm = serves_with_vllm(cfg, placement)
    per = server_gib(
        arch.params, nbytes, tp=tp, vllm=vllm, collective=collective, bucket_mb=b.bucket_mb,
        sharded=b.sharded, largest_tensor=largest,
    )  # fmt: skip
    workers = servers * (tp if vllm else 1)
    kind = ("vLLM" if vllm else "hf") + (", collective" if collective else ", filesystem")
    if collective:
        what = "received on the GPU"
    elif not b.sharded:
        what = "one file: the whole dict" + (" per worker" if vllm else "")
    else:
        what = f"{tp} worker(s) x the largest tensor" if vllm else "one piece (<= bucket_mb)"
    inference = NodeHost(
        "inference", workers, servers * per, workers * base_gib,
        f"{kind}: {servers} server(s) x {per:.1f} GiB, {what}",
    )  # fmt: skip
    return HostPlan(trainer, inference, b.sharded, b.delta, collective)


def node_limits_mb(requests: list, offer: list | None) -> tuple[int | None, int | None]:
    """Per role (trainer, inference): the memory a node gives the job, in MB: slurm.mem when set (not 0),
    else the most any offered node has (sinfo); None when neither is known."""
    most = max((n.mem_mb for n in offer or []), default=0) or None
    out: dict[str, int | None] = {}
    for r in requests:
        out[r.role] = r.mem_mb if r.mem_mb else most
    return out.get("trainer", most), out.get("inference", most)


def dry_run_lines(cfg: Config, placement: Placement, offer: list | None) -> list[str]:
    """The host lines of the submit summary; refuses (ConfigError) a plan a node cannot hold when the
    job computes on GPUs and the node's memory is known (sinfo or slurm.mem)."""
    from hpcrl.launch.checks import trainer_precision
    from hpcrl.launch.partition import component_requests

    plan = host_plan(cfg, placement, trainer_precision(cfg, on_gpu=True).compute)
    if plan is None:
        return []
    limits = node_limits_mb(component_requests(cfg, placement), offer) if cfg.slurm else (None, None)
    if placement.uses_gpus and not placement.cpu_compute:
        plan.check(limits, mem_set=bool(cfg.slurm and cfg.slurm.mem and cfg.slurm.mem.strip() != "0"))
        return plan.lines(limits)
    return plan.lines(limits) + ["    note: CPU compute: the host plan is information, not checked"]


# -- hpcrl run: every process on this one machine -------------------------------------------------
def machine_memory_mb(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """This machine's memory for a run, in MB (MiB): MemTotal, or the cgroup's limit (v2 memory.max,
    v1 memory.limit_in_bytes) when lower; None when neither can be read."""
    from pathlib import Path

    found: list[int] = []
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                found.append(int(line.split()[1]) // 1024)  # kB
    except (OSError, ValueError, IndexError):
        pass
    for f in (Path(cgroup, "memory.max"), Path(cgroup, "memory", "memory.limit_in_bytes")):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" / a huge number: no limit
            found.append(int(text) // MIB)
    return min(found) if found else None


@dataclass(frozen=True)
class Term:
    what: str
    gib: float
    field: str  # the field that shrinks it
    fix: str


@dataclass
class LocalPlan:
    processes: int
    terms: list[Term]

    @property
    def total_gib(self) -> float:
        return sum(t.gib for t in self.terms)

    def lines(self, limit_mb: int | None) -> list[str]:
        of = f" of {limit_mb / 1024:.1f} GiB" if limit_mb else ""
        parts = ", ".join(f"{t.what} {t.gib:.1f}" for t in self.terms if t.gib > 0)
        return [
            f"  host memory (this machine): {self.total_gib:.1f} GiB{of} ({self.processes} processes: {parts})"
        ]

    def check(self, limit_mb: int | None) -> None:
        """One-line refusal naming the biggest term's field when the machine cannot hold the run."""
        if not limit_mb or self.total_gib * 1024 <= limit_mb:
            return
        big = max(self.terms, key=lambda t: t.gib)
        raise ConfigError(
            big.field,
            f"this machine needs {self.total_gib:.1f} GiB of host memory for the processes `hpcrl run` "
            f"starts (biggest: {big.what} {big.gib:.1f} GiB) but has {limit_mb / 1024:.1f} GiB: {big.fix}, "
            "or run on a larger machine (hpcrl submit)",
        )


def local_plan(cfg: Config, placement: Placement) -> LocalPlan | None:
    """What the processes of `hpcrl run` hold on this machine (see the module docstring); None when the
    model's architecture is unknown here."""
    from hpcrl.launch.checks import trainer_precision
    from hpcrl.launch.memory_plan import plan_for

    gpu = placement.uses_gpus and not placement.cpu_compute
    base = PROCESS_BASE_GIB if gpu else CPU_PROCESS_BASE_GIB
    plan = host_plan(cfg, placement, trainer_precision(cfg, on_gpu=gpu).compute, base_gib=base)
    if plan is None:
        return None
    ranks = placement.trainer_ranks
    ranks_field = "deployment.num_train_gpus" if placement.uses_gpus else "deployment.num_trainer_ranks"
    servers_field = "deployment.num_infer_gpus" if placement.uses_gpus else "deployment.num_inference_servers"
    tfield, tfix = plan._fix(plan.trainer, False)
    ifield, ifix = plan._fix(plan.inference, False)
    procs = plan.trainer.processes + plan.inference.processes + 1  # + the orchestrator
    terms = [
        Term("trainer syncs", plan.trainer.held_gib, tfield, tfix.split(", or more nodes")[0]),
        Term("inference loads", plan.inference.held_gib, ifield, ifix.split(", or more nodes")[0]),
        Term(
            "process baselines",
            procs * base - base + CPU_PROCESS_BASE_GIB,  # the orchestrator computes on CPU
            ranks_field,
            f"fewer trainer ranks ({ranks_field}) or inference servers ({servers_field})",
        ),
    ]
    if not gpu:  # computing on CPU, the training state is host memory
        mp = plan_for(cfg, placement, on_gpu=False)
        if mp is not None:
            terms.append(
                Term(
                    "CPU training state",
                    ranks * mp.trainer_gib,
                    "trainer.micro_batch_tokens",
                    "a smaller model or trainer.micro_batch_tokens, or fewer trainer ranks "
                    f"({ranks_field}: each holds its activations)",
                )
            )
    return LocalPlan(procs, terms)


def local_check(cfg: Config, placement: Placement, limit_mb: int | None = None) -> list[str]:
    """`hpcrl run`'s host lines; refuses (ConfigError, one line) a run this machine's memory cannot
    hold. `limit_mb`: this machine's memory (default: machine_memory_mb())."""
    plan = local_plan(cfg, placement)
    if plan is None:
        return []
    limit = machine_memory_mb() if limit_mb is None else limit_mb
    if not placement.uses_gpus or placement.cpu_compute:
        # As the dry run's GPU and SLURM host plans: on CPU the lines inform (a GPU or hosted config
        # rehearsed on a CPU machine still dry-runs; the activation constants are calibrated on GPUs)
        return [*plan.lines(limit), "    note: CPU compute: the host plan is information, not checked"]
    plan.check(limit)
    return plan.lines(limit)
