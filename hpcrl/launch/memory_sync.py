"""The weight sync's terms of the --dry-run memory plan (hpcrl.launch.memory_plan's docstring has the
arithmetic): a trainer rank's publish, an inference process's receive, an inference GPU's items."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.launch.memory_units import BYTES, GIB, MIB, SHORT, Item
from hpcrl.launch.memory_units import count as _count
from hpcrl.models.arch import Arch

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.launch.placement import Placement

# One 2-rank NCCL communicator of the weight sync on a GPU. AN ASSUMPTION, not measured: NCCL_BUFFSIZE
# (4 MiB, NCCL's default) x 2 directions x up to 8 p2p channels = 64 MiB.
NCCL_P2P_GIB = 0.0625
INFER_RESERVE_GIB = 2.0  # inference activations, CUDA graphs inside vLLM's pool, beside the KV cache


@dataclass(frozen=True)
class Receive:
    """The weight sync's GPU memory of one receiving process of an inference server, outside vLLM's
    pool (see the module docstring)."""

    collective: bool
    vllm: bool
    chunk_mb: int  # C: one round at a receiver
    assembly_gib: float  # vLLM: the largest tensor, assembled whole for load_weights (0: hf engine)
    peers: int  # a process's 2-rank communicators: its senders + its ring neighbours
    ring_peers: int  # of which ring neighbours (0: a server of one process)

    def gib(self, chunk_mb: int | None = None) -> float:
        if not self.collective:
            return 0.0
        c = self.chunk_mb if chunk_mb is None else chunk_mb
        return 2 * c * MIB / GIB + self.assembly_gib + self.peers * NCCL_P2P_GIB

    def arithmetic(self) -> str:
        if not self.collective:
            return "files: read on the host piece by piece (host plan)"
        parts = [f"2 x {self.chunk_mb} MiB round buffers {2 * self.chunk_mb * MIB / GIB:.2f}"]
        if self.vllm:
            parts.append(f"assembly (largest tensor) {self.assembly_gib:.2f}")
        parts.append(
            f"{self.peers} NCCL communicators x {NCCL_P2P_GIB:g} (assumed) {self.peers * NCCL_P2P_GIB:.2f}"
        )
        return " + ".join(parts)


def largest_tensor(a: Arch) -> int:
    """Elements of the policy's largest tensor: the embedding / LM head, or a dense MLP projection
    (experts travel under per-expert names, each [moe_intermediate, hidden] or its transpose)."""
    return a.hidden * max(a.vocab, a.intermediate)


def largest_piece(a: Arch, ranks: int) -> int:
    """Elements of a trainer rank's largest piece: its rows of the largest tensor, or a whole expert's
    tensor (the custom MoE hands a rank whole experts, each its own piece)."""
    return max(-(-largest_tensor(a) // ranks), a.hidden * a.moe_intermediate if a.moe else 0)


def publish_item(
    a: Arch,
    *,
    ranks: int,
    servers: int,
    collective: bool,
    chunk_mb: int,
    dtype: str,
    lora: bool = False,
    sharded: bool = True,
) -> Item:
    """GPU memory of one trainer rank's weight publish, in the policy dtype (see the module docstring)."""
    b = BYTES[dtype]
    if lora:  # LoRA merges its rows into a cast copy of the shard: S = P / ranks
        held, what = a.params * b / ranks, f"cast shard S {_count(a.params)} / {ranks} (LoRA)"
    elif not sharded:
        held, what = largest_tensor(a) * b, "largest tensor gathered whole (sharded = false)"
    else:
        piece = largest_piece(a, ranks)
        held = piece * b
        rows = -(-largest_tensor(a) // ranks)
        what = f"largest cast piece {held / GIB:.3f}" + (
            f" ({max(a.vocab, a.intermediate):,} x {a.hidden:,} / {ranks} ranks)"
            if piece == rows
            else f" (a whole expert, {a.moe_intermediate:,} x {a.hidden:,})"
        )
    if not collective:
        return Item("weight publish", SHORT[dtype], held / GIB, what + "; files: its bucket is on the host")
    scratch = chunk_mb * MIB / ranks
    comms = servers * NCCL_P2P_GIB
    return Item(
        "weight publish",
        SHORT[dtype],
        (held + scratch) / GIB + comms,
        f"{what} + scratch bucket {chunk_mb} MiB / {ranks} {scratch / GIB:.3f} + {servers} server(s) "
        f"x {NCCL_P2P_GIB:g} GiB NCCL (assumed) {comms:.3f}",
    )


def receive_of(
    a: Arch, *, senders: int, tp: int, vllm: bool, collective: bool, chunk_mb: int, dtype: str
) -> Receive:
    """The weight receive of one receiving process of an inference server (see the module docstring)."""
    workers = tp if vllm else 1  # the hf engine receives in one process whatever GPUs it spans
    ring = 0 if workers == 1 else (1 if workers == 2 else 2)
    return Receive(
        collective=collective,
        vllm=vllm,
        chunk_mb=chunk_mb,
        assembly_gib=largest_tensor(a) * BYTES[dtype] / GIB if vllm else 0.0,
        peers=-(-senders // workers) + ring,
        ring_peers=ring,
    )


def receive_item(r: Receive, dtype: str, room_gib: float) -> Item:
    """The row of an inference GPU's weight receive; `room_gib`: what vLLM leaves outside its pool."""
    if not r.collective:
        return Item("weight receive", "", 0.0, r.arithmetic())
    if not r.vllm:
        return Item("weight receive", SHORT[dtype], r.gib(), f"{r.arithmetic()} (hf engine)")
    ring = f" ({r.ring_peers} of them ring neighbours)" if r.ring_peers else ""
    return Item(
        "weight receive",
        SHORT[dtype],
        r.gib(),
        f"per worker: {r.arithmetic()}{ring}; outside vLLM's pool: {r.gib():.2f} of {room_gib:.2f} GiB",
    )


def inference_items(
    a: Arch,
    *,
    tp: int,
    dtype: str,
    limit_gib: float,
    utilization: float,
    receive: Receive | None = None,
    policy_dtype: str = "bfloat16",
    quantization: str | None = None,
) -> tuple[list[Item], int]:
    """(items, KV tokens) of one GPU of an inference server; with `receive`, its weight sync's row.
    `quantization` (inference.quantization, FP8): the linear weights take 1 byte per parameter plus
    their block scales (hpcrl.inference.fp8); embeddings and the LM head stay in `dtype`."""
    from hpcrl.inference.fp8 import weight_bytes_per_param

    b = BYTES[dtype]
    qb = weight_bytes_per_param(quantization, b)
    quantized = a.params - a.embed_params if qb != b else 0
    weights = ((a.params - quantized) * b + quantized * qb) / tp / GIB
    how = f"{_count(a.params)} / tp {tp}"
    if quantized:
        how += f"; {_count(quantized)} linear at {qb:.4g} B ({quantization}: FP8 + scales)"
    kv_heads = max(1, a.kv_heads // tp)
    per_token = 2 * a.layers * kv_heads * a.head_dim * b
    kv = utilization * limit_gib - weights - INFER_RESERVE_GIB
    tokens = int(kv * GIB // per_token) if kv > 0 else 0
    return [
        Item("weights", "fp8" if quantized else SHORT[dtype], weights, how),
        Item("reserve", "", INFER_RESERVE_GIB, "activations, CUDA graphs (estimate)"),
        Item(
            "KV cache",
            SHORT[dtype],
            kv,
            f"{tokens:,} tokens at {per_token / 1024:.1f} KiB/token ({kv_heads} kv head(s)/GPU)",
        ),
    ] + ([receive_item(receive, policy_dtype, limit_gib * (1 - utilization))] if receive else []), tokens


def sync_transport(cfg: Config, placement: Placement) -> str:
    """The weight sync's transport as the launcher decides it for `placement` (hpcrl.launch.prepare)."""
    from hpcrl.runtime import weight_transport

    return weight_transport(cfg, placement.uses_gpus)


def served_quantization(cfg: Config) -> str | None:
    """The servers' quantization: inference.quantization, or a vLLM value it does not hold (`fp8` left in
    [inference.vllm] by prime-rl's configs)."""
    return cfg.inference.quantization or cfg.inference.vllm.get("quantization")


def serves_with_vllm(cfg: Config, placement: Placement) -> bool:
    """The inference servers run vLLM: asked for, or `auto` where they compute on GPUs."""
    backend = cfg.inference.backend
    return backend == "vllm" or (backend == "auto" and placement.uses_gpus and not placement.cpu_compute)
