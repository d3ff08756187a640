"""hpcrl's expert-parallel MoE inside transformers' vision-language MoE classes (``[model.vlm]`` with
``model.ep > 1``): Qwen3-VL-MoE (``qwen3_vl_moe``) and Qwen3.5-MoE (``qwen3_5_moe``).

hpcrl has no custom vision-language class; as prime-rl's composite VLM (transformers' vision encoder
plus its own MoE text model), the model stays transformers' (vision tower, attention, linear
attention, multimodal RoPE), and each sparse MoE block of its language model is swapped for
:class:`VLMoE`: hpcrl's :class:`hpcrl.models.qwen3.moe.MoE` (sort by expert, grouped SwiGLU, the
two all-to-alls of expert parallelism, routing statistics, router replay) over the block's own
parameters. The parameters keep transformers' names and layouts (``mlp.gate.weight`` [E, H],
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]; Qwen3.5's
``shared_expert`` and ``shared_expert_gate`` kept as they are), so warm starts, checkpoints and the
exported weights are the transformers model's, and :func:`hpcrl.models.qwen3.parallelize.apply_ep`
shards the experts as it does the text model's. The router is transformers': softmax in fp32, top-k,
renormalized.

    swap_moe_blocks(model) -> int   # blocks swapped (0: none found); works on the meta device too
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcrl.errors import ConfigError
from hpcrl.models.qwen3.moe import MoE, Router
from hpcrl.models.registry import VL_MOE_TYPES as MODEL_TYPES

# transformers' sparse MoE block classes of the VL MoE families (by name: no import of their modules)
BLOCKS = ("Qwen3VLMoeTextSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock")
__all__ = [
    "BLOCKS",
    "MODEL_TYPES",
    "VLMoE",
    "add_expert_lora",
    "has_expert_lora",
    "has_swapped_moe",
    "merge_lora",
    "swap_moe_blocks",
]


class FusedExperts(nn.Module):
    """transformers' stacked experts (gate and up fused: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]) with :class:`hpcrl.models.qwen3.moe.GroupedExperts`' interface."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        super().__init__()
        self.num_experts = int(gate_up_proj.shape[0])
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def local_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's experts (apply_ep's DTensor gives its rows) as (gate, up, down) in ``dtype``."""

        def loc(p: Tensor) -> Tensor:
            t = p.to_local() if hasattr(p, "to_local") else p
            return t.to(dtype)

        gate, up = loc(self.gate_up_proj).chunk(2, dim=1)  # transformers: linear(x, gate_up).chunk(2, -1)
        return gate, up, loc(self.down_proj)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        from hpcrl.models.qwen3.moe import expert_ffn

        if self.lora_scaling is None:
            return expert_ffn(x, counts, *self.local_weights(x.dtype))
        return self._lora_ffn(x, counts)

    lora_scaling: float | None = None  # set by add_lora

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """LoRA on every expert's projections (the model.lora target "experts", which peft cannot
        wrap: the experts are stacked parameters, not nn.Linear modules): per expert e,
        gate_up[e] + s B_gu[e] A_gu[e] and down[e] + s B_d[e] A_d[e], s = alpha / rank; A as peft
        initialises an nn.Linear's (Kaiming uniform), B zeros, so training starts at the base model.
        The stacked A / B shard over ep like the experts (dim 0)."""
        e, two_i, h = self.gate_up_proj.shape
        dev, dt = self.gate_up_proj.device, self.gate_up_proj.dtype

        def param(*shape: int, zero: bool) -> nn.Parameter:
            t = torch.zeros(*shape, device=dev, dtype=dt)
            if not zero and dev.type != "meta":
                for w in t:  # one nn.Linear's init per expert
                    nn.init.kaiming_uniform_(w, a=5**0.5)
            return nn.Parameter(t)

        self.lora_A_gate_up = param(e, rank, h, zero=False)
        self.lora_B_gate_up = param(e, two_i, rank, zero=True)
        self.lora_A_down = param(e, rank, two_i // 2, zero=False)
        self.lora_B_down = param(e, h, rank, zero=True)
        self.lora_scaling, self.lora_dropout = alpha / rank, dropout

    def _lora_ffn(self, x: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of rows grouped by expert with each projection's LoRA path x A^T B^T beside it
        (never a merged [E, 2I, H] weight: the backward keeps only [rows, rank] extra)."""
        w = {
            n: p.to_local() if hasattr(p, "to_local") else p for n, p in self.named_parameters(recurse=False)
        }
        w = {n: t.to(x.dtype) for n, t in w.items()}
        s, drop = self.lora_scaling, self.lora_dropout

        def proj(a: Tensor, kind: str) -> Tensor:
            base = expert_mm(a, counts, w[f"{kind}_proj"])
            low = expert_mm(F.dropout(a, drop, self.training) if drop else a, counts, w[f"lora_A_{kind}"])
            return base + s * expert_mm(low, counts, w[f"lora_B_{kind}"])

        gate, up = proj(x, "gate_up").chunk(2, dim=-1)
        return proj(F.silu(gate) * up, "down")


def expert_mm(x: Tensor, counts: Tensor, w: Tensor) -> Tensor:
    """Rows ``x`` grouped by expert (``counts`` each) times their expert's ``w[e]`` [out, in]
    transposed: ``torch._grouped_mm`` on CUDA in bf16, else a loop (empty groups too: the output
    stays connected to every weight, as hpcrl.models.qwen3.moe.loop_ffn's)."""
    aligned = w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0  # _grouped_mm's 16-byte strides (a small rank)
    if x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and aligned:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return torch.cat([F.linear(part, w[e]) for e, part in enumerate(torch.split(x, counts.tolist()))])


def expert_lora_of(model: nn.Module, name: str) -> tuple[str, str, float] | None:
    """(A's key, B's key, scaling) of the expert LoRA on state-dict entry ``name`` (a VL MoE's
    ``experts.gate_up_proj`` / ``experts.down_proj``); None: it has none."""
    mod_name, _, param = name.rpartition(".")
    kind = param.removesuffix("_proj")
    if kind not in ("gate_up", "down"):
        return None
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        return None
    s = getattr(mod, "lora_scaling", None)
    return None if s is None else (f"{mod_name}.lora_A_{kind}", f"{mod_name}.lora_B_{kind}", s)


def merge_lora(model: nn.Module, name: str, full: Tensor, tensor_of: Any, row0: int = 0) -> Tensor:
    """The exported weight ``name`` (a VL MoE's stacked experts, or ``full.shape[0]`` of them from
    expert ``row0`` on) with its expert LoRA merged: W[e] + s B[e] @ A[e]; ``full`` as it is
    without one. ``tensor_of(key)``: a state-dict entry, whole (collective under FSDP / ep)."""
    found = expert_lora_of(model, name)
    if found is None:
        return full
    a_key, b_key, s = found
    n = full.shape[0]
    a = tensor_of(a_key)[row0 : row0 + n].float()
    b = tensor_of(b_key)[row0 : row0 + n].float()
    return (full.float() + torch.bmm(b, a) * s).to(full.dtype)


class VLMoE(MoE):
    """A VL MoE block on hpcrl's MoE: routed experts plus, for Qwen3.5-MoE, the sigmoid-gated shared
    expert (transformers' modules, LoRA wrappers included)."""

    def __init__(self, block: nn.Module):
        nn.Module.__init__(self)
        gate, experts = block.gate, block.experts
        self.num_experts, self.top_k, self.norm_topk_prob = int(gate.num_experts), int(gate.top_k), True
        with torch.device("meta"):  # its weight is the block's own
            router = Router(int(gate.hidden_dim), self.num_experts)
        router.weight = gate.weight
        self.shared_expert = self.shared_expert_gate = None
        for name, child in block.named_children():  # the block's order: its state dict's
            if name == "gate":
                self.gate = router
            elif name == "experts":
                self.experts = FusedExperts(experts.gate_up_proj, experts.down_proj)
            else:
                setattr(self, name, child)
        self.ep_group = None
        self.ep_size = 1
        from hpcrl.models.qwen3.moe import RoutingStats

        self.stats = RoutingStats()
        self.aux_coef = 0.0

    # Router replay: this micro-batch's [tokens, k] routes for this block, set by the model's forward
    # pre-hook (_replay_hook) and kept until the next forward, so an AC recompute replays them too.
    replay_routes: Tensor | None = None

    def forward(self, x: Tensor, replay: Tensor | None = None) -> Tensor:
        out = super().forward(x, self.replay_routes if replay is None else replay)
        if self.shared_expert is None:
            return out
        flat = x.reshape(-1, x.shape[-1])
        shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out + shared.reshape(out.shape)


def _check(block: nn.Module, where: str, field: str) -> None:
    """The block in the layout VLMoE reads (transformers >= 5: a router module with top_k and
    weight [E, H], experts gate_up_proj [E, 2I, H] and down_proj [E, H, I], SiLU), else one line.
    transformers 4.57's (gate an nn.Linear, experts [E, H, 2I]) is refused here, not half-read."""
    import transformers

    gate, experts = block.gate, block.experts
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    ok = all(hasattr(gate, a) for a in ("weight", "top_k", "num_experts", "hidden_dim"))
    ok = ok and isinstance(gu, Tensor) and isinstance(down, Tensor) and gu.dim() == down.dim() == 3
    if ok:
        e, h = gate.weight.shape
        ok = tuple(gu.shape) == (e, 2 * down.shape[2], h) and tuple(down.shape[:2]) == (e, h)
    if not ok:
        shape = "?" if not isinstance(gu, Tensor) else "x".join(map(str, gu.shape))
        raise ConfigError(
            field,
            f"{where}: transformers {transformers.__version__}'s MoE layout ({type(gate).__name__} router, "
            f"experts.gate_up_proj {shape}) is not the one hpcrl's MoE reads (a router with top_k, "
            "gate_up_proj [E, 2I, H]): upgrade transformers to >= 5, or leave the experts to transformers",
        )
    act = getattr(getattr(block.experts, "act_fn", None), "__class__", type(None)).__name__
    if act not in ("SiLU", "SiLUActivation"):
        raise ConfigError(field, f"{where}'s experts use {act}, hpcrl's MoE computes SwiGLU (silu) only")


def swap_moe_blocks(model: nn.Module, field: str = "model.ep") -> int:
    """Replace every transformers VL sparse MoE block under ``model`` with :class:`VLMoE` (same
    parameter objects, so on the meta device too); returns how many. A layout it cannot read:
    ConfigError naming ``field`` (what asked for the swap)."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in BLOCKS]
    for name, block in found:
        _check(block, name, field)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, VLMoE(block))
    if found and not getattr(model, "hpcrl_replay_hook", False):  # router replay's routes
        moes = [m for m in model.modules() if isinstance(m, VLMoE)]
        model.register_forward_pre_hook(_replay_hook(moes), with_kwargs=True)
        model.hpcrl_replay_hook = True
    return len(found)


def _replay_hook(moes: list[VLMoE]) -> Any:
    """A forward pre-hook (with kwargs) that takes ``routed_experts`` ([B, L, moe layers * k] or
    [B, L, moe layers, k], -1 = route freely: what hpcrl.trainer.packing.model_inputs passes and
    transformers' forward would swallow) and gives each swapped block its layer's routes, in the
    order hpcrl.models.qwen3.model._layer_routes reads them; a forward without routes clears them."""
    from hpcrl.models.qwen3.model import _layer_routes

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        routed = kwargs.pop("routed_experts", None)
        if routed is not None:
            width = routed.shape[-1] * (routed.shape[-2] if routed.dim() == 4 else 1)
            if width != sum(m.top_k for m in moes):
                raise ValueError(
                    f"router replay: routed_experts holds {width} expert ids a token, the model's "
                    f"{len(moes)} MoE layers route {sum(m.top_k for m in moes)}"
                )
        for j, m in enumerate(moes):
            m.replay_routes = None if routed is None else _layer_routes(routed, j, m.top_k)
        return args, kwargs

    return hook


def has_swapped_moe(model: nn.Module) -> bool:
    return isinstance(model, nn.Module) and any(isinstance(m, VLMoE) for m in model.modules())


def has_expert_lora(model: nn.Module) -> bool:
    """Whether some swapped block's stacked experts carry LoRA (add_expert_lora): peft's adapter
    format (its state dict, what /load_lora_adapter reads) does not hold it."""
    return any(isinstance(m, FusedExperts) and m.lora_scaling is not None for m in model.modules())


def add_expert_lora(model: nn.Module, rank: int, alpha: float, dropout: float, seed: int) -> int:
    """LoRA on the stacked experts of every swapped block (FusedExperts.add_lora), seeded as
    hpcrl.models.load.apply_lora seeds peft's; returns the blocks adapted."""
    moes = [m for m in model.modules() if isinstance(m, VLMoE)]
    dev = next(iter(model.parameters())).device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed + 1)  # not the peft adapter's stream
        for m in moes:
            m.experts.add_lora(rank, alpha, dropout)
    return len(moes)
