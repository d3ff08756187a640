"""The trainer's memory savers under prime-rl's names: activation checkpointing (``trainer.model.ac``),
activation offloading (``ac_offloading``), ``torch.compile`` of the decoder layers (``compile``) and
optimizer state in host memory (``optim_cpu_offload`` / ``full_offload``). One implementation each,
for both model implementations (transformers' and hpcrl's own); :func:`prepare_model` runs on the
built model before FSDP shards it (hpcrl.models.spec.build calls it), :func:`offload_optimizer_state`
on the optimizer.

- Checkpointing replaces the ``forward`` of a chosen module by an instance attribute that runs the
  original under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved so dropout recomputes
  the same mask). Parameter names and the state dict do not change, FSDP's hooks around the module
  still run, and ``compile`` traces the wrapper with the layer. ``full`` mode wraps every ``freq``-th
  decoder layer (layers 0, freq, 2 freq, ...: prime-rl's choice); ``selective`` mode wraps the
  ``targets`` inside those layers instead (:func:`selective_modules`).
- Offloading runs the model's forward under :class:`OffloadActivations`: every tensor autograd saves
  for backward (1 KiB or more, not a parameter) is copied to host memory and copied back when
  backward needs it; with checkpointing that is each checkpointed layer's input. On CPU the "host
  copy" is a copy in the same memory: the same code runs, nothing is saved.
- compile: ``module.compile()`` of each decoder layer in place (names unchanged), prime-rl's per-layer
  scheme.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hpcrl.models.parallelize import decoder_layers

if TYPE_CHECKING:
    from hpcrl.config.schema import TrainerModelConfig
    from hpcrl.config.sections.model import ActivationCheckpointConfig, CompileConfig

log = logging.getLogger("hpcrl.trainer")

MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors stay where they are (not worth a copy)


# ------------------------------------------------------------------------- activation checkpointing
def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward instead of keeping what it saves (only its inputs
    are kept). Idempotent."""
    if getattr(module, "_hpcrl_checkpointed", False):
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._hpcrl_checkpointed = True


def checkpoint_vision_blocks(model: nn.Module, freq: int) -> str | None:
    """[model.ac] (full mode) with a trained vision encoder ([model.vlm] freeze_vision_encoder =
    false): every ``freq``-th block of the tower is checkpointed too (its longest ModuleList: the
    blocks), as the language model's layers are; a frozen tower saves nothing to checkpoint. The
    tower is the module hpcrl.trainer.sft_vlm.prepare_model marked. None: no trained tower."""
    from hpcrl.models.parallelize import VISION_MARK

    for tower in model.modules():
        if not getattr(tower, VISION_MARK, False) or not any(p.requires_grad for p in tower.parameters()):
            continue
        lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            return None
        blocks = max(lists, key=len)
        chosen = [b for i, b in enumerate(blocks) if i % freq == 0]
        for b in chosen:
            checkpoint_forward(b)
        return f"activation checkpointing: {len(chosen)} of {len(blocks)} vision encoder blocks (trained)"
    return None


def _is_moe(mlp: nn.Module | None) -> bool:
    return mlp is not None and hasattr(mlp, "experts")


def selective_modules(layer: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules each selective target names in one decoder layer ({} entries: the layer lacks them).
    Qwen3 and Llama layers (transformers' and hpcrl's) have norm, attn_proj and mlp or routed_experts;
    Qwen3.5's linear-attention layers linear_attn."""
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    norms = [m for m in layer.modules() if m is not layer and "norm" in type(m).__name__.lower()]
    proj: list[nn.Module] = []
    if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        proj = [getattr(attn, n) for n in names if isinstance(getattr(attn, n, None), nn.Module)]
    # linear_attn (prime-rl's meaning): the layer's token mixer other than full attention: Qwen3.5's
    # gated delta net (layer.linear_attn), a mamba mixer, or a sliding-window layer's self_attn
    mixer = getattr(layer, "linear_attn", None)
    mixer = getattr(layer, "mamba", None) if mixer is None else mixer
    if mixer is None and getattr(layer, "attention_type", None) == "sliding_attention":
        mixer, proj = attn, []  # the whole attention: its projections are inside it
    linear = [mixer] if isinstance(mixer, nn.Module) else []
    out: dict[str, list[nn.Module]] = {"norm": norms, "attn_proj": proj, "mla_up_proj": []}
    out["linear_attn"] = linear
    out["mlp"] = [mlp] if mlp is not None and not _is_moe(mlp) else []
    out["routed_experts"] = [mlp.experts] if _is_moe(mlp) else []
    return out


def apply_ac(model: nn.Module, ac: ActivationCheckpointConfig) -> str:
    """Checkpoint every ``ac.freq``-th decoder layer, whole or (selective) its ``ac.targets``; returns
    what was done, for the log. A selective target no chosen layer has is a ValueError."""
    layers = decoder_layers(model)
    chosen = [layer for i, layer in enumerate(layers) if i % ac.freq == 0]
    if ac.mode == "full":
        for layer in chosen:
            checkpoint_forward(layer)
        return f"activation checkpointing: {len(chosen)} of {len(layers)} decoder layers (freq {ac.freq})"
    found: set[str] = set()
    for layer in chosen:
        for target, modules in selective_modules(layer).items():
            if target in ac.targets and modules:
                found.add(target)
                for m in modules:
                    checkpoint_forward(m)
    missing = [t for t in ac.targets if t not in found]
    if missing:
        have = sorted({t for layer in chosen for t, m in selective_modules(layer).items() if m})
        raise ValueError(
            f"trainer.model.ac.targets: {missing} name nothing in {type(layers[0]).__name__} "
            f"(this model's layers have: {', '.join(have)})"
        )
    return (
        f"selective activation checkpointing of {', '.join(ac.targets)} in {len(chosen)} of "
        f"{len(layers)} decoder layers (freq {ac.freq})"
    )


# ---------------------------------------------------------------------------- activation offloading
class _Offloaded:
    """A saved tensor's host copy and where it goes back to."""

    __slots__ = ("device", "host", "key")

    def __init__(self, host: Tensor, device: torch.device, key: int):
        self.host, self.device, self.key = host, device, key


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory in the forward, back to their device in backward.

    A tensor of at least ``min_bytes`` that is not a parameter is copied to (pinned, on CUDA) host
    memory when autograd saves it; the graph holds the host copy. The last ``max_inflight``
    offloaded tensors are also kept on the device, so the first backward ops, which need the
    last-saved tensors, take them without waiting for a copy back. Counters: ``offloaded`` (tensors)
    and ``offloaded_bytes``, ``reloaded`` (copied back) and ``kept`` (served from the device)."""

    def __init__(self, pin_memory: bool = True, max_inflight: int = 5, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.pin = pin_memory and torch.cuda.is_available()
        self.max_inflight, self.min_bytes = max_inflight, min_bytes
        self.recent: OrderedDict[int, Tensor] = OrderedDict()
        self.offloaded = self.offloaded_bytes = self.reloaded = self.kept = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if isinstance(t, nn.Parameter) or nbytes < self.min_bytes or t.device.type == "meta":
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin and t.is_cuda)  # same strides
        host.copy_(t, non_blocking=t.is_cuda)  # ordered on the compute stream: read back on it too
        key = self.offloaded
        self.offloaded, self.offloaded_bytes = self.offloaded + 1, self.offloaded_bytes + nbytes
        self.recent[key] = t
        while len(self.recent) > self.max_inflight:
            self.recent.popitem(last=False)
        return _Offloaded(host, t.device, key)

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        kept = self.recent.pop(packed.key, None)
        if kept is not None:
            self.kept += 1
            return kept
        self.reloaded += 1
        if packed.device.type == "cpu":
            return packed.host
        return packed.host.to(packed.device, non_blocking=True)


def offload_forward(model: nn.Module, pin_memory: bool, max_inflight: int) -> None:
    """Run ``model``'s forward (with grad) under :class:`OffloadActivations`; the last forward's
    hooks (their counters) are ``model._hpcrl_offload``."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        hooks = OffloadActivations(pin_memory, max_inflight)
        model._hpcrl_offload = hooks
        with hooks:
            return inner(*args, **kwargs)

    model.forward = forward


# ---------------------------------------------------------------------------------------- compile
def compile_layers(model: nn.Module, cfg: CompileConfig) -> str:
    """``torch.compile`` every decoder layer in place (its parameter names unchanged)."""
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True  # routing counts (.item()) stay in the graph
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(fullgraph=cfg.fullgraph, backend=cfg.backend)
    return f"torch.compile: {len(layers)} decoder layers (backend {cfg.backend}, fullgraph {cfg.fullgraph})"


# ------------------------------------------------------------------------------------------- model
def prepare_model(model: nn.Module, cfg: TrainerModelConfig) -> list[str]:
    """Checkpointing, compile and offloading as ``cfg`` asks (before FSDP: the wrapped layers are what
    it shards); returns one log line per saver applied."""
    done: list[str] = []
    if cfg.ac is not None:
        done.append(apply_ac(model, cfg.ac))
    if cfg.compile is not None:
        done.append(compile_layers(model, cfg.compile))
    if cfg.ac_offloading is not None:
        off = cfg.ac_offloading
        offload_forward(model, off.pin_memory, off.max_inflight_activations)
        done.append(
            f"activation offloading: saved tensors to host memory (pinned {off.pin_memory}, "
            f"{off.max_inflight_activations} kept on the device)"
        )
    return done


# --------------------------------------------------------------------------- optimizer state offload
def _move_state(optimizer: torch.optim.Optimizer, to_host: bool) -> None:
    """Every state tensor of ``optimizer`` to host memory or to its parameter's device; 0-d tensors
    (AdamW's step counter) stay where they are. A DTensor moves its local shard."""
    pin = to_host and torch.cuda.is_available()
    for p, state in optimizer.state.items():
        local_p = p.to_local() if hasattr(p, "to_local") else p
        device = torch.device("cpu") if to_host else local_p.device
        for name, v in list(state.items()):
            if not isinstance(v, Tensor) or v.dim() == 0:
                continue
            local = v._local_tensor if hasattr(v, "_local_tensor") else v
            if local.device == device:
                continue
            moved = local.to(device, non_blocking=not pin)
            if pin:
                moved = moved.pin_memory()
            if hasattr(v, "_local_tensor"):
                v = copy.copy(v)  # noqa: PLW2901 - the same DTensor (mesh, placements) over the moved shard
                v._local_tensor = moved
                state[name] = v
            else:
                state[name] = moved


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Keep ``optimizer``'s state in host memory between steps: moved to the parameters' device
    before each step and back after it (step hooks; a checkpoint load puts it on the device, the next
    step's hook brings it back). Where the parameters are on the CPU nothing moves."""

    def before(opt: torch.optim.Optimizer, *_: Any) -> None:
        _move_state(opt, to_host=False)

    def after(opt: torch.optim.Optimizer, *_: Any) -> None:
        _move_state(opt, to_host=True)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
