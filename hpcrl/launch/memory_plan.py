"""The --dry-run memory plan: per-GPU memory of a trainer rank and of an inference server's GPU.

    plan = plan_for(cfg, placement)        # MemoryPlan, or None when the architecture is unknown
    plan.lines()                           # the table the dry-run summary prints
    plan.check(cfg.deployment.gpu_memory_gib)   # ConfigError (one line) when it cannot fit

Pure functions of the config, the placement and the model's architecture (hpcrl.models.arch: its
config.json, locally or in the HF cache, else a built-in table; never a download).

Trainer rank, as hpcrl's expert parallelism lays it out (hpcrl/models/qwen3/parallelize.py): the
non-expert parameters D are FSDP2-sharded over all N ranks; each ep position computes with E / ep
experts (X / ep of the expert parameters X), FSDP-sharded over the N / ep ranks that share the
position. Every rank stores S = (D + X) / N = P / N, with or without ep:
  parameters   S x master bytes               (model.optimization_dtype; fp32 by default)
  gradients    S x master bytes               (FSDP2 keeps gradient shards in the parameters' dtype)
  optimizer    S x master bytes x 2           (AdamW's two moments; SGD without momentum: 0);
               0 with trainer.model.optim_cpu_offload / full_offload (host memory between steps)
  gathered     (root + PREFETCH_LAYERS layers) x compute bytes + one layer x reduce bytes: the
               unsharded non-expert parameters FSDP all-gathers and one layer's unsharded gradients
               before the reduce-scatter (model.reduce_dtype). Under ep a layer's gathered experts
               are its ep position's X_layer / ep (none when N = ep: they are stored whole).
               Root = the LM head + the final norm: an untied input embedding is its own FSDP group,
               resharded after the forward (hpcrl/trainer/parallel.py), so it is not gathered at the
               step's peak (the LM head's backward); a tied one is the head. Under cp with
               trainer.model.vocab_parallel (the default; not with LoRA on them) a rank gathers vocab / cp
               rows of it (hpcrl/models/vocab_parallel.py)
  activations  T = micro_batch_tokens / cp tokens (a packed micro-batch; context parallelism splits
               it) x layers x per-token-per-layer elements x compute bytes, where the elements are
                 A = ACT_HIDDEN x hidden + ACT_ATTN x (q_dim + 2 kv_dim) + ACT_MLP x mlp_width
                     + ACT_ROUTED x top_k x hidden   (MoE: the dispatched copies of each token)
               (mlp_width = intermediate, or top_k x moe_intermediate). With activation checkpointing
               each layer keeps only its input (ACT_CKPT x hidden) and one layer at a time is
               recomputed in full: T x (layers x ACT_CKPT x hidden + A) x compute bytes; with
               trainer.model.ac.freq = f only layers 0, f, 2f, ... are checkpointed (the others keep
               A); selective mode keeps A less what its targets recompute (SELECTIVE_SAVES); with
               trainer.model.ac_offloading what the layers keep is in host memory: T x A x bytes.
  logits       tokens x vocab x (compute bytes + LOGIT_FP32_COPIES x 4): the model's logits, their
               fp32 upcast, the fp32 log-softmax kept for backward and its gradient. Tokens = T today
               (an upper bound: logits are kept for loss tokens only). When the trainer computes
               logprobs in chunks: chunk x vocab x (compute bytes + LOGIT_FP32_CHUNKED x 4) (one fp32
               buffer per chunk, hpcrl/models/chunked.py; vocab / cp columns when vocabulary-parallel,
               which always chunks).
  weight publish  collective (protocol 4: the T trainer ranks send at once, in rounds of C =
               trainer.broadcast.chunk_mb at a receiver): the pieces are cast and sent lazily, so a
               rank holds its largest piece cast to the policy dtype (its rows of the largest tensor,
               largest / T, or a whole expert's tensor when the custom MoE hands it whole experts) +
               one scratch bucket of C / T + one NCCL communicator per inference server (it sends to
               one process of each: servers x NCCL_P2P_GIB). Files: the largest cast piece (its bucket of
               trainer.broadcast.bucket_mb is on the host: hpcrl.launch.host_memory). LoRA (and any
               layout that is not rows) still materialises the cast shard: S = P / T in the policy
               dtype instead of the piece. sharded = false: the largest tensor, gathered whole.
Inference server GPU (tp GPUs per server): weights P x dtype bytes / tp; the KV cache gets
gpu_memory_utilization x GPU memory - weights - INFER_RESERVE_GIB, at 2 x layers x kv heads per GPU
(kv_heads / tp, at least 1: vLLM replicates them when tp > kv_heads) x head_dim x dtype bytes a token.
  weight receive  collective: every receiving process of a server (vLLM: its TP workers; the hf
               engine: one) takes the buckets of the senders r with r mod tp = its worker index from
               the network (every NIC of the node carries ~1 / tp of the policy), then the round's
               segments go around the server's ring over NVLink (hpcrl/weights/rounds.py). Each
               process holds 2 round buffers (2 x C) on its GPU, verifies each part there, and loads
               per round: the hf engine copies the parts into its parameters (large ones land there
               directly); a vLLM worker hands load_weights whole HF tensors, so it assembles a tensor
               whose rows span rounds in a buffer of its own: + the largest tensor (policy dtype).
               NCCL: one 2-rank communicator per peer, each NCCL_P2P_GIB (an assumption, not a
               measurement): ceil(T / tp) senders + its 2 ring neighbours (1 at tp 2, none at tp 1).
               It all sits OUTSIDE vLLM's pool: it must fit GPU memory x
               (1 - gpu_memory_utilization), else `MemoryPlan.check` refuses naming
               trainer.broadcast.chunk_mb (or inference.gpu_memory_utilization when even a 1 MiB
               chunk cannot fit). Files: read on the host piece by piece (host plan): 0 on the GPU.

The ACT_* constants count what a Qwen3 layer saves for backward with flash attention (no [s, s]
scores); ACT_ATTN and ACT_CKPT are calibrated on a GPU (see their comments), ACT_ROUTED is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcrl.errors import ConfigError
from hpcrl.launch.memory_sync import (  # noqa: F401 (re-exported: host_memory, tests)
    INFER_RESERVE_GIB,
    NCCL_P2P_GIB,
    Receive,
    inference_items,
    largest_piece,
    largest_tensor,
    publish_item,
    receive_item,
    receive_of,
    served_quantization,
    serves_with_vllm,
    sync_transport,
)
from hpcrl.launch.memory_units import BYTES, GIB, MIB, SHORT, Item  # noqa: F401 (re-exported)
from hpcrl.launch.memory_units import count as _count
from hpcrl.launch.memory_vision import expert_lora_params, vlm_rows
from hpcrl.models.arch import Arch, find_arch
from hpcrl.models.rules import check_ep, ep_groups

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.launch.placement import Placement


# Activation model (elements per token per layer, in the compute dtype): see the module docstring.
ACT_HIDDEN = 4  # the two RMSNorms' inputs and outputs
# Measured (scripts/bench/gpu.py --parts long_dense, H200, bf16, hpcrl's Qwen3-1.7B, SDPA flash):
# the forward keeps 113.3 KB per token per layer without checkpointing (24.2 GiB at 8k, 96.9 at 32k,
# linear), i.e. 56.7 k elements; 4 x 2048 + 3 x 4096 + 4 x 6144 counted 45.1 k. The attention part
# (q/k before and after their norms and RoPE, RoPE's temporaries, v, SDPA's output and log-sum-exp,
# o_proj's input) is what the count missed: 6 x (q_dim + 2 kv_dim) gives 57.3 k (+1 %).
ACT_ATTN = 6
ACT_MLP = 4  # gate, up, silu(gate), silu(gate) * up
ACT_ROUTED = 2  # MoE: each token's top_k dispatched inputs and their combined outputs
ACT_CKPT = 1  # activation checkpointing: each layer keeps its input (measured 1.13 x hidden: 3.95 GiB at 32k)
# Selective checkpointing (trainer.model.ac.mode = "selective"): elements per token a target's
# recompute drops from A, by the count above (not calibrated): mlp / routed_experts their ACT_MLP x
# mlp_width; attn_proj the pre-norm q and k (one of the ACT_ATTN copies); norm's outputs are the next
# projection's saved inputs anyway (0).
SELECTIVE_SAVES = {"mlp": ("mlp", ACT_MLP), "routed_experts": ("mlp", ACT_MLP), "attn_proj": ("attn", 1)}
# State tensors per parameter (upper bounds): AdamW's two moments; Muon's momentum on matrices, its
# AdamW part's two moments on the rest; SGD's momentum buffer (prime-rl's default momentum 0.9);
# sign SGD none.
OPTIMIZER_STATES = {"adamw": 2, "muon": 2, "sgd": 1, "sign_sgd": 0}
PREFETCH_LAYERS = 2  # FSDP2 holds the current layer and prefetches the next
LOGIT_FP32_COPIES = 3  # fp32 upcast, log-softmax (kept for backward), its gradient
LOGIT_FP32_CHUNKED = 1  # chunked: the chunk's fp32 logits, log-softmaxed and differentiated in place
# trainer.model fields from the long-sequence work (chunked logprobs, context parallelism), read
# with getattr so this module works before and after they exist.
# The chunk a vocabulary-parallel head runs with when chunking is off: hpcrl.models.chunked's
# DEFAULT_CHUNK (that module imports torch; a unit test keeps the two equal).
VOCAB_PARALLEL_CHUNK = 256
CHUNK_FIELD = "logprobs_chunk_tokens"  # positions per LM-head chunk; 0 / absent: all at once


@dataclass
class MemoryPlan:
    model: str
    arch: Arch
    trainer: list[Item]
    trainer_head: str
    ac: bool
    ac_other_gib: float  # activations with the other activation-checkpointing setting
    inference: list[Item]
    inference_head: str
    kv_tokens: int
    max_model_len: int
    ep_lines: list[str] = field(default_factory=list)
    ranks_field: str = "deployment.num_train_nodes"  # the field that adds trainer ranks
    receive: Receive | None = None  # the weight sync on an inference GPU, outside vLLM's pool
    utilization: float = 0.9  # inference.gpu_memory_utilization

    @property
    def trainer_gib(self) -> float:
        return sum(i.gib for i in self.trainer)

    @property
    def inference_gib(self) -> float:
        return sum(i.gib for i in self.inference)

    def lines(self, limit_gib: float | None = None) -> list[str]:
        a = self.arch
        experts = f", {_count(a.expert_params)} in {a.num_experts} experts (top-{a.top_k})" if a.moe else ""
        out = [f"memory plan:  {self.model}: {_count(a.params)} params{experts}; numbers from {a.source}"]
        of = f" of {limit_gib:g} GiB" if limit_gib else ""
        out.append(f"  trainer rank ({self.trainer_head}): {self.trainer_gib:.1f} GiB{of}")
        out += [i.row() for i in self.trainer]
        out.append(f"  inference GPU ({self.inference_head}): {self.inference_gib:.1f} GiB{of}")
        out += [i.row() for i in self.inference]
        out += self.ep_lines
        return out

    def check(self, limit_gib: float) -> None:
        """One-line refusal when a trainer rank or an inference server's GPU cannot fit `limit_gib`."""
        check_trainer(
            self.trainer, limit_gib, moe=self.arch.moe, ac=self.ac, ac_other_gib=self.ac_other_gib,
            ranks_field=self.ranks_field,
        )  # fmt: skip
        kv = next(i for i in self.inference if i.name == "KV cache")
        if kv.gib <= 0 or self.kv_tokens < self.max_model_len:
            raise ConfigError(
                "deployment.gpu_memory_gib",
                f"an inference server's KV cache holds {max(self.kv_tokens, 0)} tokens on "
                f"{limit_gib:g} GiB GPUs, less than one sequence of max_model_len {self.max_model_len}: "
                "raise inference.parallel.tp or inference.gpu_memory_utilization, lower "
                "inference.max_model_len, or raise deployment.gpu_memory_gib",
            )
        self._check_receive(limit_gib)

    def _check_receive(self, limit_gib: float) -> None:
        """The weight receive must fit what vLLM leaves outside its pool: limit x (1 - utilization)."""
        r = self.receive
        if r is None or not r.collective or not r.vllm:
            return
        room, need = limit_gib * (1 - self.utilization), r.gib()
        if need <= room + 1e-9:
            return
        head = (
            f"an inference GPU's weight receive needs {need:.2f} GiB outside vLLM's pool ({r.arithmetic()}) "
            f"but {limit_gib:g} GiB x (1 - inference.gpu_memory_utilization {self.utilization:g}) leaves {room:.2f} GiB"
        )
        fixed = r.gib(0)
        most = int((room - fixed) * GIB / MIB // 2)  # the largest chunk_mb whose two buffers fit
        if most >= 1:
            raise ConfigError(
                "trainer.broadcast.chunk_mb",
                f"{head}: trainer.broadcast.chunk_mb <= {most} (a receiver holds 2 rounds of it), or a "
                "lower inference.gpu_memory_utilization",
            )
        util = int((1 - r.gib(1) / limit_gib) * 100) / 100
        raise ConfigError(
            "inference.gpu_memory_utilization",
            f"{head}, too little even at trainer.broadcast.chunk_mb = 1 ({r.gib(1):.2f} GiB): "
            f"inference.gpu_memory_utilization <= {util:.2f}, or fewer trainer ranks (one communicator each)",
        )


def check_trainer(
    items: list[Item],
    limit_gib: float,
    *,
    moe: bool,
    ac: bool,
    ac_other_gib: float,
    ranks_field: str,
    model_field: str = "trainer.model",
) -> None:
    """One-line refusal when a trainer rank's `items` cannot fit `limit_gib`, naming the fields that
    shrink its biggest items (`model_field`: trainer.model for RL, model for SFT)."""
    total = sum(i.gib for i in items)
    if total <= limit_gib:
        return
    m = model_field

    def fixes_of(item: str) -> list[tuple[str, str]]:
        if item in ("parameters", "gradients", "optimizer", "weight publish"):  # publish: a piece per rank
            return [(ranks_field, f"more trainer ranks ({ranks_field})")]
        if item == "gathered":
            return [(f"{m}.ep", f"a larger {m}.ep")] if moe else []
        if item == "activations":
            ckpt = f"{m}.activation_checkpointing"
            out = [] if ac else [(ckpt, f"{ckpt} = true ({ac_other_gib:.1f} GiB activations)")]
            tokens = m.removesuffix("model") + "micro_batch_tokens"  # trainer.micro_batch_tokens (RL)
            return out + [(f"{m}.cp", f"{m}.cp or a smaller {tokens}")]
        if item == "logits":
            return [(f"{m}.{CHUNK_FIELD}", f"chunked logprobs ({m}.{CHUNK_FIELD})")]
        return []

    fixes: list[tuple[str, str]] = []  # (field, what to do), biggest item first
    for item in sorted(items, key=lambda i: -i.gib)[:3]:
        for fix in fixes_of(item.name):
            if fix not in fixes:
                fixes.append(fix)
    fixes.append(("deployment.gpu_memory_gib", "raise deployment.gpu_memory_gib"))
    raise ConfigError(
        fixes[0][0],
        f"a trainer rank needs {total:.1f} GiB of {limit_gib:g} GiB ({_biggest(items)}): "
        + ", ".join(f for _, f in fixes[:-1])
        + f", or {fixes[-1][1]}",
    )


def _biggest(items: list[Item]) -> str:
    top = sorted(items, key=lambda i: -i.gib)[:2]
    return ", ".join(f"{i.name} {i.gib:.1f}" for i in top)


# -- pieces (pure) --------------------------------------------------------------------------------
def expert_shard_groups(ranks: int, ep: int) -> list[list[int]]:
    """Ranks that share an ep position (one from each ep group): its experts are FSDP-sharded over
    them (gathered a layer at a time, gradients reduce-scattered)."""
    return [list(range(i, ranks, ep)) for i in range(ep)]


def _span(g: list[int]) -> str:
    return (
        f"{g[0]}"
        if len(g) == 1
        else f"{g[0]}-{g[-1]}"
        if g == list(range(g[0], g[-1] + 1))
        else ",".join(map(str, g))
    )


def ep_lines(ranks: int, ep: int, ranks_per_node: int, num_experts: int) -> list[str]:
    """The dry-run's ep groups: which ranks exchange tokens, which shard the same experts."""
    check_ep(ep, ranks, num_experts=num_experts or None)
    groups = ep_groups(ranks, ep)
    if ep == 1:
        return []
    shown = groups if len(groups) <= 8 else groups[:4] + groups[-1:]
    lines = [
        f"  ep groups:  {len(groups)} x {ep} ranks (all-to-all inside each; {num_experts // ep} experts per rank): "
        + " ".join(f"[{_span(g)}]" for g in shown)
        + (" ..." if len(shown) < len(groups) else ""),
    ]
    if len(groups) > 1:
        lines.append(
            f"  expert shards (FSDP over the {len(groups)} ranks of an ep position, {num_experts / ranks:g} "
            "experts stored per rank): "
            + " ".join(f"[{_span(g)}]" for g in expert_shard_groups(ranks, ep)[:8])
            + (" ..." if ep > 8 else "")
        )
    if ranks_per_node and (ep > ranks_per_node or ranks_per_node % ep):
        lines.append(
            f"  note:       an ep group spans nodes ({ep} > {ranks_per_node} ranks per node or not aligned)"
        )
    return lines


def activation_gib(
    a: Arch,
    tokens: int,
    compute_bytes: int,
    ac: bool,
    offload: bool = False,
    freq: int = 1,
    targets: tuple[str, ...] = (),
) -> float:
    """Activations of one micro-batch (see the module docstring); ``targets``: selective mode's."""
    per_layer = (
        ACT_HIDDEN * a.hidden
        + ACT_ATTN * (a.q_dim + 2 * a.kv_dim)
        + ACT_MLP * a.mlp_width
        + (ACT_ROUTED * a.top_k * a.hidden if a.moe else 0)
    )
    chosen = -(-a.layers // freq)  # layers 0, freq, 2 freq, ...
    if not ac:
        elems = a.layers * per_layer
    elif offload:  # what every layer keeps is on the host; one layer at a time comes back
        elems = per_layer
    elif targets:
        width = {"mlp": a.mlp_width, "attn": a.q_dim + 2 * a.kv_dim}
        saved = sum(
            width[SELECTIVE_SAVES[t][0]] * SELECTIVE_SAVES[t][1] for t in targets if t in SELECTIVE_SAVES
        )
        elems = a.layers * per_layer - chosen * min(saved, per_layer)
    else:  # the checkpointed layers' inputs, the others' whole activations, one layer recomputed
        elems = chosen * ACT_CKPT * a.hidden + (a.layers - chosen + 1) * per_layer
    return tokens * elems * compute_bytes / GIB


def logits_gib(vocab: int, tokens: int, compute_bytes: int, chunked: bool = False) -> float:
    return tokens * vocab * (compute_bytes + (LOGIT_FP32_CHUNKED if chunked else LOGIT_FP32_COPIES) * 4) / GIB


def trainer_items(
    a: Arch,
    *,
    ranks: int,
    ep: int,
    cp: int,
    tokens: int,
    compute: str,
    master: str,
    reduce: str,
    optimizer: str,
    ac: bool,
    chunk: int | None,
    lora_params: int = 0,
    offload: bool = False,
    vocab_parallel: bool = False,
    publish: Item | None = None,
    ac_freq: int = 1,
    ac_targets: tuple[str, ...] = (),
    optimizer_on_host: bool = False,
) -> list[Item]:
    """Per-GPU memory of one trainer rank (see the module docstring). `lora_params` > 0: only those
    train (gradients and optimizer state), the base weights stay frozen. `publish`: the weight
    publish's row (publish_item)."""
    split = cp if vocab_parallel and cp > 1 else 1  # the head's rows per rank: vocab / split
    if split > 1:
        chunk = chunk or VOCAB_PARALLEL_CHUNK
    cb, mb, rb = BYTES[compute], BYTES[master], BYTES[reduce]
    stored = a.params / ranks  # experts too: E / ep per ep position, FSDP-sharded over its N / ep ranks
    if ep > 1:  # a layer gathers its position's E / ep experts (none to gather when N = ep)
        layer = a.dense_layer_params + (a.expert_layer_params / ep if ranks > ep else 0)
    else:  # no expert parallelism: experts are FSDP-sharded (and gathered) like any parameter
        layer = a.dense_layer_params + a.expert_layer_params
    if a.moe_layers < a.layers:  # an MoE model's dense layers (decoder_sparse_step) may gather more
        layer = max(layer, a.attn_params + 3 * a.hidden * a.intermediate)
    trained = lora_params / ranks if lora_params else stored
    moments = OPTIMIZER_STATES.get(optimizer, 0)
    root = (
        -(-a.vocab // split) * a.hidden + a.hidden
    )  # the LM head (tied or not) + final norm, see the docstring
    gathered = (root + PREFETCH_LAYERS * layer) * cb + (layer * rb if not lora_params else 0)
    t = -(-tokens // cp)
    # a vocabulary-parallel head runs on the cp group's gathered rows (cp x t), and keeps them and their
    # gradient ([cp x t, hidden] each) for its backward
    logit_tokens = min(t * split, chunk) if chunk else t
    head_inputs = 2 * split * t * a.hidden * cb if split > 1 else 0
    ac_note = f"{t} tokens x {a.layers} layers, checkpointing {'on' if ac else 'off'}"
    ac_note += (f" (every {ac_freq})" if ac and ac_freq > 1 else "") + (
        f" of {', '.join(ac_targets)}" if ac and ac_targets else ""
    )
    ac_note += ", offloaded to the host" if ac and offload else ""
    on_host = " in host memory between steps" if optimizer_on_host else ""
    return [
        Item(
            "parameters",
            SHORT[master],
            stored * mb / GIB,
            f"{_count(a.params)} / {ranks} ranks (experts: / ep {ep}, then / {ranks // ep} within a position)"
            if a.moe and ep > 1
            else f"{_count(a.params)} / {ranks} ranks",
        ),
        Item("gradients", SHORT[master], trained * mb / GIB, "LoRA only" if lora_params else ""),
        Item(
            "optimizer",
            SHORT[master],
            0.0 if optimizer_on_host else trained * mb * moments / GIB,
            f"{optimizer}: {moments} state(s){on_host}",
        ),
        Item(
            "gathered",
            SHORT[compute],
            gathered / GIB,
            f"root + {PREFETCH_LAYERS} layers"
            + (f" (a layer's experts: E / {ep})" if a.moe and ep > 1 and ranks > ep else "")
            + (" (experts stay local)" if a.moe and ep > 1 and ranks == ep else "")
            + (f" (head: vocab / {split})" if split > 1 else ""),
        ),
        Item(
            "activations",
            SHORT[compute],
            activation_gib(a, t, cb, ac, offload, ac_freq, ac_targets),
            ac_note + (f", cp {cp}" if cp > 1 else ""),
        ),
        Item(
            "logits",
            "fp32",
            logits_gib(-(-a.vocab // split), logit_tokens, cb, chunked=bool(chunk)) + head_inputs / GIB,
            f"{logit_tokens} x {-(-a.vocab // split)}"
            + (" (chunked)" if chunk else " (full; no chunked logprobs)")
            + (
                f" + the group's hidden states, {split * t} x {a.hidden}, and their gradient"
                if split > 1
                else ""
            ),
        ),
    ] + ([publish] if publish is not None else [])


# -- from a config --------------------------------------------------------------------------------
def chunk_tokens(cfg: Config, vocab: int | None = None) -> int | None:
    """The trainer's logprob chunk size (None: the full [tokens, vocab] logits at once), bounded by
    ``logprobs_chunk_mib`` at ``vocab`` as the trainer bounds it (hpcrl/models/chunked.py)."""
    return model_chunk_tokens(cfg.trainer.model or cfg.model, vocab)


def model_chunk_tokens(model: Any, vocab: int | None = None) -> int | None:
    """chunk_tokens of a trainer model section (RL's trainer.model, SFT's model)."""
    value = getattr(model, CHUNK_FIELD, None)
    if not (isinstance(value, int) and value > 0):
        return None
    mib = getattr(model, "logprobs_chunk_mib", 0) or 0
    if vocab is None or not mib:
        return value
    from hpcrl.models.chunked import chunk_rows  # the trainer's own rule (imports torch: only when bounded)

    return chunk_rows(value, vocab, mib)


def lora_param_count(a: Arch, rank: int, targets: list[str]) -> int:
    """LoRA parameters r x (in + out) per adapted projection (experts are not adapted)."""
    shapes = {
        "q_proj": (a.hidden, a.q_dim), "k_proj": (a.hidden, a.kv_dim), "v_proj": (a.hidden, a.kv_dim),
        "o_proj": (a.q_dim, a.hidden),
    }  # fmt: skip
    if not a.moe:
        shapes.update(gate_proj=(a.hidden, a.intermediate), up_proj=(a.hidden, a.intermediate))
        shapes["down_proj"] = (a.intermediate, a.hidden)
    return a.layers * sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)


def trainer_kw(
    model: Any, arch: Arch, *, ranks: int, tokens: int, prec: Any, optimizer: str
) -> dict[str, Any]:
    """trainer_items' arguments (but `ac`) from a trainer model section: RL's trainer.model, SFT's model."""
    ep, cp = int(getattr(model, "ep", 1) or 1), int(getattr(model, "cp", 1) or 1)
    # getattr: [model] and the trainer's model section are being split per role; these are trainer fields
    lora_cfg = getattr(model, "lora", None)
    vp = bool(getattr(model, "vocab_parallel", False)) and not (
        lora_cfg and {"lm_head", "embed_tokens"} & set(lora_cfg.target_modules)
    )
    # a vocabulary-parallel chunk is vocab / cp columns wide: its byte bound allows cp x the rows
    columns = -(-arch.vocab // cp) if vp and cp > 1 else arch.vocab
    ac_cfg, chunk = getattr(model, "ac", None), model_chunk_tokens(model, columns)
    lora = lora_param_count(arch, lora_cfg.rank, lora_cfg.target_modules) if lora_cfg else 0
    if lora and getattr(model, "vlm", None) is not None:  # LoRA on a VL MoE's stacked experts too
        lora += expert_lora_params(arch, lora_cfg)
    kw: dict[str, Any] = dict(
        ranks=ranks, ep=ep, cp=cp, tokens=tokens,
        compute=prec.compute, master=prec.master, reduce=prec.reduce, optimizer=optimizer,
        chunk=chunk, lora_params=lora, offload=getattr(model, "ac_offloading", None) is not None,
        vocab_parallel=vp,
        optimizer_on_host=bool(getattr(model, "optim_cpu_offload", False) or getattr(model, "full_offload", None)),
    )  # fmt: skip
    if ac_cfg is not None:
        kw |= {
            "ac_freq": ac_cfg.freq,
            "ac_targets": tuple(ac_cfg.targets) if ac_cfg.mode == "selective" else (),
        }
    return kw


def plan_for(cfg: Config, placement: Placement, on_gpu: bool = True) -> MemoryPlan | None:
    """The memory plan of `cfg` placed as `placement` (GPU dtypes: bf16 compute unless set; `on_gpu =
    False`: the CPU trainer's dtypes, for the host plan of `hpcrl run` on CPU), or None when the
    model's architecture is unknown here."""
    from hpcrl.launch.checks import trainer_precision

    model = cfg.trainer.model or cfg.model
    arch = find_arch(model.name or cfg.model.name)
    if arch is None:
        return None
    prec = trainer_precision(cfg, on_gpu=on_gpu)
    ep, cp = int(getattr(model, "ep", 1) or 1), int(getattr(model, "cp", 1) or 1)
    ranks = placement.trainer_ranks
    ep_text = ep_lines(ranks, ep, placement.ranks_per_train_node, arch.num_experts)
    kw = trainer_kw(
        model, arch, ranks=ranks, tokens=max(cfg.trainer.micro_batch_tokens, cfg.seq_len), prec=prec,
        optimizer=cfg.trainer.optim.type,
    )  # fmt: skip
    lora_cfg = getattr(model, "lora", None)
    ac = getattr(model, "ac", None) is not None
    b = cfg.trainer.broadcast
    collective = sync_transport(cfg, placement) == "collective"
    tp = cfg.inference.parallel.tp
    kw["publish"] = publish_item(
        arch, ranks=ranks, servers=placement.inference_servers, collective=collective,
        chunk_mb=b.chunk_mb, dtype=prec.compute, lora=bool(lora_cfg), sharded=b.sharded,
    )  # fmt: skip
    trainer = trainer_items(arch, ac=ac, **kw)
    other = next(i.gib for i in trainer_items(arch, ac=not ac, **kw) if i.name == "activations")
    vlm_rows(trainer, arch, getattr(model, "vlm", None), kw, name=model.name or cfg.model.name,
             seq_len=cfg.seq_len, states=OPTIMIZER_STATES.get(kw["optimizer"], 0))  # [model.vlm]  # fmt: skip
    idtype = getattr(cfg.inference.model, "dtype", None) or cfg.model.dtype
    idtype = idtype if idtype in BYTES else "bfloat16"  # auto: bf16 on GPU
    util = cfg.inference.gpu_memory_utilization
    receive = receive_of(
        arch, senders=ranks, tp=tp, vllm=serves_with_vllm(cfg, placement), collective=collective,
        chunk_mb=b.chunk_mb, dtype=prec.compute,
    )  # fmt: skip
    infer, kv_tokens = inference_items(
        arch, tp=tp, dtype=idtype, limit_gib=cfg.deployment.gpu_memory_gib, utilization=util,
        receive=receive, policy_dtype=prec.compute, quantization=served_quantization(cfg),
    )  # fmt: skip
    parallel = f"FSDP {ranks}" + (f", ep {ep}" if ep > 1 else "") + (f", cp {cp}" if cp > 1 else "")
    head = f"{ranks} ranks, {parallel}; {SHORT[prec.compute]} compute, {SHORT[prec.master]} master"
    local = cfg.deployment.num_train_gpus is not None or placement.target == "local"
    return MemoryPlan(
        model=model.name or cfg.model.name or "", arch=arch, trainer=trainer, trainer_head=head, ac=ac,
        ac_other_gib=other, inference=infer,
        inference_head=f"tp {tp}, {SHORT[idtype]}{_quant(cfg)}, gpu_memory_utilization {util:g}",
        kv_tokens=kv_tokens, max_model_len=cfg.inference.max_model_len or cfg.seq_len, ep_lines=ep_text,
        receive=receive, utilization=util,
        ranks_field="deployment.num_train_gpus" if local else "deployment.num_train_nodes",
    )  # fmt: skip


def _quant(cfg: Config) -> str:
    q = served_quantization(cfg)
    return f", {q} weights" if q else ""


def dry_run_lines(cfg: Config, placement: Placement) -> list[str]:
    """The plan's lines for the submit summary. Refuses (ConfigError) what cannot fit
    deployment.gpu_memory_gib when the job computes on GPUs; with compute = cpu it only informs."""
    model = cfg.trainer.model or cfg.model
    plan = plan_for(cfg, placement)
    if plan is None:
        name = model.name or cfg.model.name
        return [
            f"memory plan:  skipped: no architecture numbers for {name!r} (not a local directory, not in the "
            "HF cache, not in hpcrl.models.arch.KNOWN)",
            *ep_lines(
                placement.trainer_ranks, int(getattr(model, "ep", 1) or 1), placement.ranks_per_train_node, 0
            ),
        ]
    limit = cfg.deployment.gpu_memory_gib
    if placement.uses_gpus and not placement.cpu_compute:
        plan.check(limit)
        return plan.lines(limit)
    return plan.lines(limit) + ["  note:       CPU compute: the plan is information, not checked"]
