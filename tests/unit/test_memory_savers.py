"""prime-rl's memory savers on the tiny models (hpcrl.trainer.memory_savers): activation
checkpointing (full, every freq-th layer, selective targets), activation offloading, torch.compile
and the optimizer state's offload each give the plain model's loss and gradients, on transformers'
implementation and on hpcrl's own, and do what they are for: checkpointing keeps fewer tensors for
backward (counted by an outer saved_tensors_hooks), offloading moves what is kept to host copies,
compile runs the layers through torch.compile (the fast aot_eager backend here; inductor is the
slow test), the chunked LM head (fused_lm_head_token_chunk_size) lowers the step's tensor peak."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.config.sections.model import (
    ActivationCheckpointConfig,
    ActivationOffloadingConfig,
    CompileConfig,
    TrainerModelConfig,
)
from hpcrl.models.parallelize import decoder_layers
from hpcrl.models.spec import load_model
from hpcrl.trainer import memory_savers as ms

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), preset="tiny-moe", seed=0)


def _ids(model: torch.nn.Module, n: int = 48) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], int]:
    """(next-token loss, gradients, tensors autograd saved at the top level) of one forward/backward."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL) -> float:
    """The largest gradient difference, relative to the tensor's largest entry when that exceeds 1."""
    assert a.keys() == b.keys()
    worst = max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp(min=1.0)).item() for n in a)
    assert worst <= tol, worst
    return worst


def _prepared(model_dir: Path, impl: str, **fields: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_model(model_dir, impl=impl)
    ms.prepare_model(model, TrainerModelConfig(**fields))
    return model


@pytest.mark.parametrize("impl", ["hf", "custom"])
@pytest.mark.parametrize(
    "ac",
    [
        ActivationCheckpointConfig(),
        ActivationCheckpointConfig(freq=2),
        ActivationCheckpointConfig(mode="selective", targets=["norm", "attn_proj", "mlp"]),
    ],
    ids=["full", "freq2", "selective"],
)
def test_checkpointing_same_grads_fewer_saved(
    tiny_model_dir: Path, impl: str, ac: ActivationCheckpointConfig
):
    plain = _prepared(tiny_model_dir, impl)
    ids = _ids(plain)
    loss0, g0, saved0 = _step(plain, ids)
    model = _prepared(tiny_model_dir, impl, ac=ac)
    layers = decoder_layers(model)
    wrapped = [getattr(layer, "_hpcrl_checkpointed", False) for layer in layers]
    assert wrapped == (
        [i % ac.freq == 0 for i in range(len(layers))] if ac.mode == "full" else [False] * len(layers)
    )
    loss1, g1, saved1 = _step(model, ids)
    assert loss1 == pytest.approx(loss0, abs=TOL)
    _same(g0, g1)
    assert saved1 < saved0, (saved0, saved1)  # what checkpointing is for
    assert len(g0) == len(list(plain.parameters()))


def test_selective_routed_experts_on_moe(moe_dir: Path):
    plain = _prepared(moe_dir, "custom")
    ids = _ids(plain)
    loss0, g0, saved0 = _step(plain, ids)
    ac = ActivationCheckpointConfig(mode="selective", targets=["routed_experts", "norm"])
    loss1, g1, saved1 = _step(_prepared(moe_dir, "custom", ac=ac), ids)
    assert loss1 == pytest.approx(loss0, abs=TOL) and saved1 < saved0
    _same(g0, g1)
    with pytest.raises(
        ValueError, match=r"ac\.targets: \['mlp'\] name nothing in .* have: attn_proj, norm, routed_experts"
    ):
        _prepared(moe_dir, "custom", ac=ActivationCheckpointConfig(mode="selective", targets=["mlp"]))


def test_selective_target_the_model_lacks(tiny_model_dir: Path):
    with pytest.raises(ValueError, match=r"\['linear_attn'\] name nothing"):
        _prepared(
            tiny_model_dir, "custom", ac=ActivationCheckpointConfig(mode="selective", targets=["linear_attn"])
        )


@pytest.mark.parametrize("impl", ["hf", "custom"])
@pytest.mark.parametrize("inflight", [1, 5])
def test_offloading_same_grads_and_host_copies(tiny_model_dir: Path, impl: str, inflight: int):
    plain = _prepared(tiny_model_dir, impl)
    ids = _ids(plain)
    loss0, g0, _ = _step(plain, ids)
    off = ActivationOffloadingConfig(max_inflight_activations=inflight)
    cfg = TrainerModelConfig(ac_offloading=off)
    assert cfg.ac is not None  # offloading turns checkpointing on, as prime-rl
    model = _prepared(tiny_model_dir, impl, ac_offloading=off)
    loss1, g1, saved1 = _step(model, ids)
    assert loss1 == pytest.approx(loss0, abs=TOL)
    _same(g0, g1)
    hooks = model._hpcrl_offload
    layers = len(decoder_layers(model))
    # every checkpointed layer's input went to the host, and came back (or stayed) in backward
    assert (
        hooks.offloaded >= layers
        and hooks.offloaded_bytes >= layers * ids.numel() * model.config.hidden_size * 4
    )
    assert hooks.kept == min(inflight, hooks.offloaded) and hooks.kept + hooks.reloaded == hooks.offloaded
    assert saved1 == 0  # the outer counting hooks saw nothing: the offloading hooks are innermost


def test_offloading_alone_same_grads(tiny_model_dir: Path):
    """The hooks without checkpointing: every saved activation round-trips through a host copy."""
    model = _prepared(tiny_model_dir, "custom")
    ids = _ids(model)
    _, g0, _ = _step(model, ids)
    hooks = ms.OffloadActivations(max_inflight=2)
    model.zero_grad(set_to_none=True)
    with hooks:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
    _same(g0, {n: p.grad for n, p in model.named_parameters()})
    assert hooks.offloaded > 20 and hooks.kept == 2 and hooks.reloaded == hooks.offloaded - 2


@pytest.mark.parametrize("impl", ["hf", "custom"])
def test_compile_same_loss_and_grads(tiny_model_dir: Path, impl: str):
    plain = _prepared(tiny_model_dir, impl)
    ids = _ids(plain)
    loss0, g0, _ = _step(plain, ids)
    torch._dynamo.reset()
    model = _prepared(
        tiny_model_dir, impl, compile=CompileConfig(backend="aot_eager"), ac=ActivationCheckpointConfig()
    )
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    for _ in range(2):  # the compiled graph, then its cached run
        loss1, g1, _ = _step(model, ids)
        assert loss1 == pytest.approx(loss0, abs=1e-5)
        _same(g0, g1, tol=1e-5)


@pytest.mark.slow
def test_compile_inductor_same_loss_and_grads(tiny_model_dir: Path):
    """Generated C++ kernels (about 100 s to compile on 2 cores)."""
    plain = _prepared(tiny_model_dir, "custom")
    ids = _ids(plain)
    loss0, g0, _ = _step(plain, ids)
    torch._dynamo.reset()
    model = _prepared(tiny_model_dir, "custom", compile=CompileConfig())
    loss1, g1, _ = _step(model, ids)
    assert loss1 == pytest.approx(loss0, abs=1e-5)
    _same(g0, g1, tol=1e-5)


def test_optimizer_state_offload_same_updates(tiny_model_dir: Path):
    from hpcrl.trainer import optim

    params = []
    for offload in (False, True):
        model = _prepared(tiny_model_dir, "custom")
        opt = optim.build_optimizer(model, "adamw", lr=1e-2)
        if offload:
            ms.offload_optimizer_state(opt)
        ids = _ids(model)
        for _ in range(2):
            _step(model, ids)
            opt.step()
        states = [
            v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()
        ]
        assert states and all(v.device.type == "cpu" for v in states)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    _same(params[0], params[1], tol=0.0)


def test_build_applies_savers_once(tiny_model_dir: Path):
    """The trainer's construction path (spec.build's prepare hook): the memory savers are applied to
    the built model, the models' own checkpointing flag stays off (one implementation)."""
    from hpcrl.trainer import precision
    from hpcrl.trainer.setup import build_model

    cfg = TrainerModelConfig(name=str(tiny_model_dir), impl="custom", activation_checkpointing=True)
    prec = precision.of_model(cfg, on_gpu=False)
    model = build_model(str(tiny_model_dir), cfg, prec, torch.device("cpu"))
    assert not model.activation_checkpointing and not model.activation_offload  # the model's own flags
    assert all(layer._hpcrl_checkpointed for layer in decoder_layers(model))


# ----------------------------------------------------------------------------- chunked LM head
def _tensor_peak() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tensor_peak", ROOT / "scripts" / "bench" / "tensor_peak.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TensorPeak


def test_fused_lm_head_chunk_same_grads_lower_peak(tiny_model_dir: Path):
    """fused_lm_head_token_chunk_size (= logprobs_chunk_tokens): the same logprobs and gradients as the
    full [tokens, vocab] head, and a lower tensor-level peak of the forward + backward."""
    from hpcrl.trainer.packing import PackedBatch, forward_packed

    TensorPeak = _tensor_peak()
    n = 256
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(2))
    mb = PackedBatch(
        input_ids=ids,
        position_ids=torch.arange(n),
        seq_lens=torch.tensor([n]),
        loss_mask=torch.ones(n, dtype=torch.bool),
    )
    out = {}
    for chunk in (0, 16):
        model = _prepared(tiny_model_dir, "custom")
        alive = [p for p in model.parameters()]
        with TensorPeak(alive) as tp:
            fwd = forward_packed(model, mb, wanted=mb.loss_mask, chunk_tokens=chunk)
            fwd.logprobs.sum().backward()
        out[chunk] = (
            fwd.logprobs.detach(),
            {k: p.grad for k, p in model.named_parameters()},
            tp.peak - tp.start,
        )
    (lp0, g0, peak0), (lp1, g1, peak1) = out[0], out[16]
    assert (lp0 - lp1).abs().max().item() <= 1e-5
    _same(g0, g1, tol=1e-5)
    vocab_row = model.config.vocab_size * 4
    assert peak0 - peak1 > n * vocab_row, (peak0, peak1)  # at least one whole [tokens, vocab] fp32 less
