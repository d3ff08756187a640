"""prime-rl's memory savers on CPU (hpcrl.trainer.memory_savers): the tensor-level peak and the time of
one forward + backward of a packed row, per trainer.model setting.

    python scripts/bench/memory_savers.py                       # small preset, 2,048 tokens
    python scripts/bench/memory_savers.py --tokens 4096 --compile inductor

Rows: plain; [ac] (every layer); [ac] freq = 2; selective [ac] (norm, attn_proj, mlp); [ac] +
[ac_offloading]; [compile] (aot_eager unless --compile says otherwise, measured after a warm-up
call); and the LM head over all positions vs fused_lm_head_token_chunk_size = 256 on the tiny model
at Qwen3's vocabulary (tiny-151k), where the head dominates. Peak: the largest sum of live tensor
storages during the step above what was alive before it (parameters), scripts/bench/tensor_peak.py.
On CPU offloaded activations are copies in the same memory: that row shows the cost of the copies
and their count, not a saving (on a GPU they leave the device)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tensor_peak import TensorPeak  # noqa: E402

MIB = 2**20


def _model(path: Path, **fields):
    from hpcrl.config.sections.model import TrainerModelConfig
    from hpcrl.models.spec import load_model
    from hpcrl.trainer.memory_savers import prepare_model

    torch.manual_seed(0)
    model = load_model(path, impl="custom")
    prepare_model(model, TrainerModelConfig(**fields))
    return model


def _step(model, tokens: int, chunk: int = 0) -> tuple[float, float, float]:
    """(peak MiB above the parameters, seconds, loss) of one forward + backward."""
    from hpcrl.trainer.packing import PackedBatch, forward_packed

    ids = torch.randint(
        0, min(model.config.vocab_size, 400), (tokens,), generator=torch.Generator().manual_seed(1)
    )
    mb = PackedBatch(
        input_ids=ids,
        position_ids=torch.arange(tokens),
        seq_lens=torch.tensor([tokens]),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
    )
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with TensorPeak(list(model.parameters()) + list(model.buffers())) as tp:
        fwd = forward_packed(model, mb, wanted=mb.loss_mask, chunk_tokens=chunk)
        loss = -fwd.logprobs.sum() / tokens
        loss.backward()
    return (tp.peak - tp.start) / MIB, time.perf_counter() - t0, loss.item()


def main() -> None:
    from hpcrl.config.sections.model import (
        ActivationCheckpointConfig,
        ActivationOffloadingConfig,
        CompileConfig,
    )
    from hpcrl.models.tiny import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--compile", default="aot_eager", choices=["aot_eager", "inductor", "none"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    path = build_tiny_model(tmp / args.preset, preset=args.preset, seed=0)
    rows = [
        ("plain", {}),
        ("[ac]", {"ac": ActivationCheckpointConfig()}),
        ("[ac] freq 2", {"ac": ActivationCheckpointConfig(freq=2)}),
        (
            "selective (norm, attn_proj, mlp)",
            {"ac": ActivationCheckpointConfig(mode="selective", targets=["norm", "attn_proj", "mlp"])},
        ),
        ("[ac] + [ac_offloading]", {"ac_offloading": ActivationOffloadingConfig()}),
    ]
    if args.compile != "none":
        rows.append((f"[compile] {args.compile}", {"compile": CompileConfig(backend=args.compile)}))
    print(f"{args.preset} preset, {args.tokens} tokens, one forward + backward, CPU")
    print(f"{'setting':<34} {'peak MiB':>9} {'seconds':>8} {'loss':>9}")
    for name, fields in rows:
        model = _model(path, **fields)
        if "compile" in fields:
            _step(model, args.tokens)  # compiles
        _step(model, args.tokens)  # warm
        peak, secs, loss = _step(model, args.tokens)
        extra = ""
        hooks = getattr(model, "_hpcrl_offload", None)
        if hooks is not None:
            extra = f"  ({hooks.offloaded} tensors, {hooks.offloaded_bytes / MIB:.1f} MiB to the host)"
        print(f"{name:<34} {peak:9.1f} {secs:8.2f} {loss:9.4f}{extra}")
    big = build_tiny_model(tmp / "tiny-151k", preset="tiny-151k", seed=0)
    print(f"\ntiny-151k (vocab 151,936), {args.tokens} tokens: the LM head")
    for name, chunk in (("all positions at once", 0), ("fused_lm_head_token_chunk_size 256", 256)):
        model = _model(big)
        _step(model, args.tokens, chunk)
        peak, secs, loss = _step(model, args.tokens, chunk)
        print(f"{name:<34} {peak:9.1f} {secs:8.2f} {loss:9.4f}")


if __name__ == "__main__":
    main()
