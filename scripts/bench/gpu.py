"""The CUDA checks of issues 30 and 31, as one script for one short GPU lease.

    python scripts/bench/gpu.py [--parts grouped,step,long] [--out DIR] [--quick]

Every part prints a markdown table and appends its rows to ``DIR/gpu.json``; a part that fails
prints its error and the others still run. ``--quick`` runs toy shapes (on CPU too) to check the
script itself.

1. grouped: one MoE layer's experts (SwiGLU, bf16) over 8,192 tokens x top-8 routed rows, as the
   three ``torch._grouped_mm`` calls the custom model runs on CUDA against the per-expert loop it
   runs elsewhere (``hpcrl.models.qwen3.moe.grouped_ffn`` / ``loop_ffn``), at the expert shapes of
   Qwen3-30B-A3B and Qwen3-235B-A22B: forward and forward+backward time (median of 10 after 3
   warm-ups), TFLOP/s, and the largest difference between the two, relative to the loop's largest
   magnitude.
2. step: one training step (forward + backward + AdamW, bf16 parameters, one packed row of 8,192
   tokens, cross-entropy over every position) of hpcrl's custom implementation against
   transformers' on the same architecture: a Qwen3-30B-A3B-shaped MoE cut to 4 layers (128 experts,
   top-8) and Qwen3-1.7B (dense, 28 layers). Tokens/s (median of 5 after 2 warm-ups), peak memory
   (max allocated), and MFU = model FLOPs / time / the card's dense bf16 peak, with model FLOPs
   6 x (active matmul parameters, LM head included) x tokens + 6 x layers x tokens^2 x q-width
   (causal attention).
3. long: issue 31's memory table on CUDA in bf16, one rank: hpcrl/tiny-qwen3-151k (hidden 128,
   vocab 151,936), one sample of seq_len tokens with the loss on its second half, forward_packed +
   the RL loss + backward + AdamW, columns today (no chunking), chunked (1,024 positions) and
   chunked + activation checkpointing: peak max-allocated memory of the step and its time (second
   step). Then the largest seq_len one step fits in, without and with chunking (doubling, then
   bisection; capped at 1M tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

GIB = 2**30
# Dense bf16 tensor-core peak of the cards this runs on (NVIDIA's datasheets, without sparsity).
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def peak_tflops(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n### {title}\n")
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


# --- 1. grouped matmul against the per-expert loop -----------------------------------------------

EXPERT_SHAPES = [("Qwen3-30B-A3B", 128, 2048, 768, 8), ("Qwen3-235B-A22B", 128, 4096, 1536, 8)]


def part_grouped(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    from hpcrl.models.qwen3.moe import grouped_ffn, loop_ffn

    shapes = [("toy", 8, 64, 32, 2)] if quick else EXPERT_SHAPES
    warm, reps = (1, 2) if quick else (3, 10)
    impls: dict[str, Callable[..., torch.Tensor]] = {"loop": loop_ffn}
    if dev.type == "cuda":
        impls["grouped_mm"] = grouped_ffn
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        rows += grouped_case(dev, shape, impls, 64 if quick else 8192, warm, reps)
        gc.collect()
    return rows


def grouped_case(
    dev: torch.device,
    shape: tuple[str, int, int, int, int],
    impls: dict[str, Callable[..., torch.Tensor]],
    tokens: int,
    warm: int,
    reps: int,
) -> list[dict[str, Any]]:
    name, e, h, i, k = shape
    torch.manual_seed(0)
    bf: dict[str, Any] = dict(device=dev, dtype=torch.bfloat16)
    x = torch.randn(tokens, h, **bf)
    idx = torch.randn(tokens, e, device=dev).topk(k, -1).indices.reshape(-1)
    order = torch.argsort(idx, stable=True)
    counts = torch.bincount(idx, minlength=e)
    xs = x[order // k].requires_grad_()
    ws = [
        (torch.randn(e, i, h, **bf) * h**-0.5).requires_grad_(),
        (torch.randn(e, i, h, **bf) * h**-0.5).requires_grad_(),
        (torch.randn(e, h, i, **bf) * i**-0.5).requires_grad_(),
    ]
    dy = torch.randn(tokens * k, h, **bf)
    flops = 2 * tokens * k * h * i * 3  # three [rows, h] x [h, i]-sized products
    rows: list[dict[str, Any]] = []
    results = {}
    for impl, fn in impls.items():

        def fwd(fn: Callable[..., torch.Tensor] = fn) -> None:
            with torch.no_grad():
                fn(xs, counts, *ws)

        def fwd_bwd(fn: Callable[..., torch.Tensor] = fn) -> None:
            fn(xs, counts, *ws).backward(dy)

        try:
            t_f = timed(fwd, dev, warm, reps)
            t_fb = timed(fwd_bwd, dev, warm, reps)
        except Exception as err:  # e.g. a shape _grouped_mm refuses: keep the loop's figures
            rows.append({"experts": name, "impl": impl, "fwd ms": f"failed: {err}"[:300]})
            continue
        for t in (xs, *ws):
            t.grad = None
        y = fn(xs, counts, *ws)
        y.backward(dy)
        results[impl] = (y.detach(), xs.grad.detach().clone(), ws[0].grad.detach().clone())
        for t in (xs, *ws):
            t.grad = None
        rows.append(
            {
                "experts": name,
                "E x H x I, top-k": f"{e} x {h} x {i}, {k}",
                "impl": impl,
                "fwd ms": t_f * 1e3,
                "fwd TFLOP/s": flops / t_f / 1e12,
                "fwd+bwd ms": t_fb * 1e3,
                "fwd+bwd TFLOP/s": 3 * flops / t_fb / 1e12,
            }
        )
    if len(results) == 2:
        ref, got = results["loop"], results["grouped_mm"]
        rows[-1]["speedup fwd+bwd"] = rows[-2]["fwd+bwd ms"] / rows[-1]["fwd+bwd ms"]
        rows[-1]["rel err y / dx / dgate"] = " / ".join(f"{rel_err(g, r):.1e}" for g, r in zip(got, ref))
    return rows


# --- 2. custom vs transformers training step -----------------------------------------------------

MOE_SHAPE = dict(  # Qwen3-30B-A3B's layer, 4 of its 48 layers
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151_936,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
)
DENSE_SHAPE = dict(  # Qwen3-1.7B
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151_936,
    tie_word_embeddings=True,
)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TOY.update(num_key_value_heads=2, head_dim=16, vocab_size=1000)


STEP_KINDS = ["moe", "dense"]


def make_config(kind: str, quick: bool) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40_960)
    if kind == "moe":
        shape = {**MOE_SHAPE, **(TOY | dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2))}
        cfg = Qwen3MoeConfig(**common, **(shape if quick else MOE_SHAPE))
    else:
        cfg = Qwen3Config(**common, **({**DENSE_SHAPE, **TOY} if quick else DENSE_SHAPE))
    cfg._attn_implementation = "sdpa"
    return cfg


def train_flops(cfg: Any, tokens: int) -> float:
    h, layers, q = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attn = 2 * h * q + 2 * h * kv
    if getattr(cfg, "num_experts", 0):
        ffn = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
    else:
        ffn = 3 * h * cfg.intermediate_size
    active = layers * (attn + ffn) + cfg.vocab_size * h
    return 6 * active * tokens + 6 * layers * tokens * tokens * q


def build(impl: str, cfg: Any, dev: torch.device) -> torch.nn.Module:
    if impl == "custom":
        from hpcrl.models.qwen3 import Qwen3ForTraining

        with torch.device(dev):
            model = Qwen3ForTraining(cfg)
        for p in model.parameters():
            if p.dim() == 1:
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model.train()


def part_step(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    tokens = 128 if quick else 8192
    warm, reps = (1, 1) if quick else (2, 5)
    rows = []
    for kind in STEP_KINDS:
        cfg = make_config(kind, quick)
        for impl in ("custom", "transformers"):
            try:
                rows.append(step_row(kind, impl, cfg, dev, tokens, warm, reps))
            except Exception as e:  # one failing case must not hide the others
                rows.append({"model": kind, "impl": impl, "step s": f"failed: {type(e).__name__}: {e}"[:300]})
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def step_row(kind: str, impl: str, cfg: Any, dev: torch.device, tokens: int, warm: int, reps: int) -> dict:
    model = build(impl, cfg, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)

    def step(model=model, opt=opt, ids=ids) -> None:
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = timed(step, dev, warm, reps)
    flops = train_flops(cfg, tokens)
    n_params = sum(p.numel() for p in model.parameters())
    peak = peak_tflops(dev)
    return {
        "model": f"{kind} ({n_params / 1e9:.2f} B params)",
        "impl": impl,
        "step s": t,
        "tokens/s": tokens / t,
        "TFLOP/s": flops / t / 1e12,
        "MFU": None if peak is None else flops / t / 1e12 / peak,
        "peak GiB": torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None,
    }


# --- 3. long sequences on CUDA -------------------------------------------------------------------

VOCAB = 151_936


def make_model(source: str, dev: torch.device, ac: bool, offload: bool = False) -> torch.nn.Module:
    """``source``: a model directory (loaded as the trainer does) or 'qwen3-1.7b' (random weights)."""
    if source == "qwen3-1.7b":
        model = build("custom", make_config("dense", False), dev)
        model.activation_checkpointing = ac
        model.activation_offload = offload
        return model
    from hpcrl.models.spec import load_model

    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    return load_model(source, dtype, dev, attn_impl="sdpa", impl="custom", activation_checkpointing=ac)


def long_cell(
    source: str, dev: torch.device, seq_len: int, column: str, chunk: int = 1024
) -> dict[str, float]:
    """Two training steps of one seq_len-token sample; memory of the first, time of the second.
    ``column``: today | chunked | chunked_ac | today_ac | chunked_ac_offload."""
    from long_seq import long_sample, rl_loss

    from hpcrl.trainer.packing import forward_packed

    ac = column.endswith("_ac") or column.endswith("_offload")
    model = make_model(source, dev, ac=ac, offload=column.endswith("_offload"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    batch = long_sample(seq_len, dev)
    n_loss = int(batch.loss_mask.sum())
    chunk_tokens = 0 if column.startswith("today") else chunk

    saved: list[float] = []

    def step() -> None:
        fwd = forward_packed(model, batch, wanted=batch.loss_mask, chunk_tokens=chunk_tokens)
        if dev.type == "cuda" and not saved:  # what the forward keeps for the backward
            saved.append((torch.cuda.memory_allocated(dev) - before) / GIB)
        rl_loss(fwd, batch, n_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cuda = dev.type == "cuda"
    sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    step()
    peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
    t = timed(step, dev, 0, 1)
    kept = saved[0] if saved else 0.0
    return {"peak_gib": peak / GIB, "step_gib": (peak - before) / GIB, "saved_gib": kept, "step_s": t}


def fits(source: str, dev: torch.device, seq_len: int, column: str) -> bool:
    try:
        long_cell(source, dev, seq_len, column)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def largest(source: str, dev: torch.device, column: str, start: int, cap: int, rounds: int = 3) -> str:
    lo, hi = 0, None
    n = start
    while n <= cap:
        if not fits(source, dev, n, column):
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        return f">= {lo} (cap)"
    for _ in range(rounds):
        mid = (lo + hi) // 2 // 1024 * 1024
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(source, dev, mid, column) else (lo, mid)
    return f"{lo} (fails at {hi})"


def part_long(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    from hpcrl.models.resolve import resolve_model

    path = resolve_model("hpcrl/tiny-qwen3-151k")
    lens = [1024, 2048] if quick else [1024, 4096, 16384, 32768, 65536]
    rows = []
    for n in lens:
        row: dict[str, Any] = {"seq_len": n}
        for col in ("today", "chunked", "chunked_ac"):
            try:
                r = long_cell(path, dev, n, col)
                row[f"{col} GiB (s)"] = f"{r['peak_gib']:.2f} ({r['step_s']:.3f} s)"
                row[f"_{col}"] = r["peak_gib"]
            except torch.OutOfMemoryError:
                row[f"{col} GiB (s)"] = "OOM"
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if row.get("_today") and row.get("_chunked"):
            row["chunked / today"] = row["_chunked"] / row["_today"]
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    if dev.type == "cuda" and not quick:
        found = {col: largest(path, dev, col, 65536, 1 << 20) for col in ("today", "chunked", "chunked_ac")}
        rows.append({"seq_len": "largest that fits", **{f"{c} GiB (s)": v for c, v in found.items()}})
    return rows


def part_chunks(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """Step time and peak memory by logprobs_chunk_tokens (0 = today's unchunked head)."""
    from hpcrl.models.resolve import resolve_model

    path = resolve_model("hpcrl/tiny-qwen3-151k")
    rows = []
    for n in [2048] if quick else [16384, 65536]:
        for chunk in (0, 256, 1024, 4096, 16384):
            col = "today" if chunk == 0 else "chunked"
            r = long_cell(path, dev, n, col, chunk=chunk or 1)
            rows.append(
                {"seq_len": n, "chunk": chunk or "none", "peak GiB": r["peak_gib"], "step s": r["step_s"]}
            )
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def part_long_dense(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """Qwen3-1.7B (random weights, custom, bf16): memory and time by seq_len, what the forward keeps
    against the dry-run plan's activation estimate, and the largest seq_len that fits."""
    from hpcrl.launch.memory_plan import activation_gib
    from hpcrl.models.arch import Arch

    if quick or dev.type != "cuda":
        return [{"seq_len": "skipped (CUDA only)"}]
    c = make_config("dense", False)
    arch = Arch(
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        tied=True,
    )
    rows = []
    for n in (8192, 32768):
        for col in ("chunked", "chunked_ac", "chunked_ac_offload", "today_ac"):
            row: dict[str, Any] = {"seq_len": n, "column": col}
            try:
                r = long_cell("qwen3-1.7b", dev, n, col)
                row.update({k: r[k] for k in ("peak_gib", "saved_gib", "step_s")})
            except torch.OutOfMemoryError:
                row["peak_gib"] = "OOM"
            row["plan activations GiB"] = activation_gib(
                arch, n, 2, col != "chunked", col.endswith("_offload")
            )
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
    for col in ("today_ac", "chunked_ac"):
        rows.append(
            {
                "seq_len": "largest that fits",
                "column": col,
                "peak_gib": largest("qwen3-1.7b", dev, col, 65536, 1 << 17, rounds=1),
            }
        )
    return rows


def part_head(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """The chunked LM head alone (forward + backward of token logprobs with entropy), Qwen3's head
    shape (hidden 2048, vocab 151,936; bf16 on CUDA), 16,384 positions, by chunk rows and by the rows
    its log-softmax sums exponentiate at once (``chunked.EXP_BYTES`` / ``EXP_BYTES_GPU``): launch
    count vs temporaries."""
    from hpcrl.models import chunked

    n, hidden, vocab = (512, 64, 4096) if quick else (16384, 2048, 151_936)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(n, hidden, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g).to(dev)
    rows, saved = [], (chunked.EXP_BYTES, chunked.EXP_BYTES_GPU)
    try:
        for chunk in (55, 256, 1024):
            for exp_rows in (6, 32, 64):
                chunked.EXP_BYTES = chunked.EXP_BYTES_GPU = exp_rows * 4 * vocab

                def step(chunk: int = chunk) -> None:
                    lp, _ = chunked.chunked_token_logprobs(h, w, labels, chunk=chunk, entropy=True)
                    lp.sum().backward()
                    h.grad = w.grad = None

                ms = timed(step, dev, 1 if quick else 2, 1 if quick else 5) * 1e3
                rows.append({"chunk rows": chunk, "exp rows": exp_rows, "fwd+bwd ms": ms})
    finally:
        chunked.EXP_BYTES, chunked.EXP_BYTES_GPU = saved
    return rows


PARTS = {
    "grouped": part_grouped,
    "step": part_step,
    "long": part_long,
    "chunks": part_chunks,
    "long_dense": part_long_dense,
    "head": part_head,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped MoE (step)")
    ap.add_argument("--kinds", default="moe,dense", help="models of the step part")
    args = ap.parse_args()
    MOE_SHAPE["num_hidden_layers"] = args.moe_layers
    STEP_KINDS[:] = args.kinds.split(",")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    info = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(info))
    out = Path(args.out) / "gpu.json"
    failed = 0
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            rows = PARTS[name](dev, args.quick)
        except Exception:
            failed += 1
            print(f"\n### {name}: FAILED\n{traceback.format_exc()}", flush=True)
            rows = [{"error": traceback.format_exc(limit=3)}]
        else:
            table(f"{name} ({time.perf_counter() - t0:.0f} s, {info['device']})", rows)
        with out.open("a") as f:
            f.write(json.dumps({"part": name, **info, "rows": rows}, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
