"""Long sequences: peak memory and time of one training step as seq_len grows, vocab 151,936, CPU.

    python scripts/bench/long_seq.py [--lens 1024,2048,4096,8192,16384] [--sweep-chunks]

The model is hpcrl/tiny-qwen3-151k (hidden 128, 2 layers, Qwen3's vocabulary: the LM head is what a
long sequence fills memory with). One step = one sample of ``seq_len`` tokens, loss on its second
half (a prompt and a completion of equal length), forward + backward of the default RL loss +
AdamW step. Every cell is a fresh process; memory is the process's peak RSS during the step (Linux
VmHWM, reset after the model and optimizer are built: the peak counts what torch's CPU allocator
really takes from the OS, which tracemalloc cannot see) and, beside it, the RSS before the step.
Columns:

* ``today``: the unchunked head (``trainer.model.logprobs_chunk_tokens = 0``): fp32 logits of every
  kept position and a full log-softmax. Cells whose predicted peak exceeds ``--max-gib`` are not run
  (the machine is shared); their value is extrapolated from the largest measured today cell
  (linear in kept tokens) and marked ``~``.
* ``chunked``: ``logprobs_chunk_tokens = --chunk``.
* ``chunked+ac``: the same with activation checkpointing.
* ``cp=2/rank``: chunked, cp = 2 over 2 gloo ranks (FSDP over both): the larger of the two ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_memory import peak_rss_mib, reset_peak, rss_mib  # noqa: E402

VOCAB = 151_936


def one_step(model_dir: str, seq_len: int, column: str, chunk: int) -> dict[str, float]:
    """Run in a fresh process (rank of a gloo group for cp): build, then one measured step."""
    import torch

    from hpcrl.trainer import parallel
    from hpcrl.trainer.loss import LossParams, compute_loss
    from hpcrl.trainer.model import load_model
    from hpcrl.trainer.packing import PackedBatch, forward_packed

    torch.manual_seed(0)
    cp = 2 if column == "cp2" else 1
    chunk = 0 if column == "today" else chunk
    group = None
    attn = None
    if cp > 1:
        from hpcrl.models.ring_attention import register_hf
        from hpcrl.trainer.context_parallel import make_cp_group

        parallel.init_distributed(torch.device("cpu"))
        group = make_cp_group(cp)
        attn = register_hf()
    model = load_model(model_dir, attn_impl=attn, activation_checkpointing=column == "chunked_ac")
    model = parallel.apply_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(seq_len) >= seq_len // 2
    batch = PackedBatch(
        input_ids=torch.randint(3, VOCAB, (seq_len,), generator=g),
        position_ids=torch.arange(seq_len),
        seq_lens=torch.tensor([seq_len]),
        loss_mask=mask,
        advantages=torch.randn(seq_len, generator=g),
        inference_logprobs=torch.full((seq_len,), -12.0),
    )
    before = rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    if group is not None:
        from hpcrl.trainer.context_parallel import forward_cp, restrict

        batch = restrict(batch, group)
        fwd = forward_cp(model, batch, group, wanted=batch.loss_mask, chunk_tokens=chunk)
    else:
        fwd = forward_packed(model, batch, wanted=batch.loss_mask, chunk_tokens=chunk)
    after_fwd = rss_mib()
    out = compute_loss(
        LossParams(),
        trainer_logprobs=fwd.logprobs,
        loss_mask=batch.loss_mask,
        num_loss_tokens=int(mask.sum()),
        inference_logprobs=batch.inference_logprobs,
        advantages=batch.advantages,
        entropy=fwd.entropy,
    )
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {
        "peak_mib": peak_rss_mib(),
        "before_mib": before,
        "saved_mib": after_fwd - before,  # what the forward keeps for the backward (activations)
        "step_s": time.perf_counter() - t0,
    }


def _run_cell(model_dir: str, seq_len: int, column: str, chunk: int) -> dict[str, float]:
    from hpcrl.launch.placement import rank_env
    from hpcrl.net import free_port

    world = 2 if column == "cp2" else 1
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "2" if world == 1 else "1", "PYTHONPATH": str(REPO)}
        if world > 1:
            env.update(rank_env(rank, world, "127.0.0.1", port))
        args = [sys.executable, __file__, "--cell", model_dir, str(seq_len), column, str(chunk)]
        procs.append(
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{column} at {seq_len}: exit {p.returncode}\n{err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    worst = max(results, key=lambda r: r["peak_mib"])
    return {**worst, "step_s": max(r["step_s"] for r in results)}


COLUMNS = ("today", "chunked", "chunked_ac", "cp2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--chunk", type=int, default=1024, help="logprobs_chunk_tokens of the chunked columns")
    ap.add_argument("--max-gib", type=float, default=8.0, help="do not run a today cell predicted above this")
    ap.add_argument(
        "--sweep-chunks", default="", help="e.g. 256,512,1024,2048: chunk sizes to time at --sweep-len"
    )
    ap.add_argument("--sweep-len", type=int, default=4096)
    args = ap.parse_args()
    if args.cell:
        model_dir, n, column, chunk = args.cell
        print(json.dumps(one_step(model_dir, int(n), column, int(chunk))))
        return 0
    from hpcrl.models.tiny import resolve_model

    model_dir = resolve_model("hpcrl/tiny-qwen3-151k")
    lens = [int(x) for x in args.lens.split(",")]
    rows: dict[int, dict[str, dict[str, float] | None]] = {}
    today_slope = None  # MiB per kept token of the today column's step (peak - before)
    for n in lens:
        rows[n] = {}
        for col in COLUMNS:
            if col == "today" and today_slope is not None and today_slope * n / 2 / 1024 > args.max_gib:
                rows[n][col] = None
                continue
            r = _run_cell(model_dir, n, col, args.chunk)
            rows[n][col] = r
            if col == "today":
                today_slope = (r["peak_mib"] - r["before_mib"]) / (n / 2)
            print(
                f"  {col:10s} seq {n:6d}: peak {r['peak_mib']:8.0f} MiB (before {r['before_mib']:.0f}, "
                f"kept by the forward {r['saved_mib']:.0f}), {r['step_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"\nseq_len | today MiB (s) | chunked {args.chunk} | chunked+ac | cp=2 per rank | chunked/today | cp2/chunked"
    )
    print("---|---|---|---|---|---|---")
    for n in lens:
        cells = []
        r = rows[n]
        for col in COLUMNS:
            c = r[col]
            if c is None:
                base = r["chunked"]["before_mib"]  # type: ignore[index]
                est = base + today_slope * n / 2  # type: ignore[operator]
                cells.append(f"~{est:.0f} (not run)")
                r["today_est"] = {"peak_mib": est}
            else:
                cells.append(f"{c['peak_mib']:.0f} ({c['step_s']:.1f} s)")
        today = r["today"] or r["today_est"]
        ratio = r["chunked"]["peak_mib"] / today["peak_mib"]  # type: ignore[index]
        cp_ratio = r["cp2"]["peak_mib"] / r["chunked"]["peak_mib"]  # type: ignore[index]
        print(f"{n} | " + " | ".join(cells) + f" | {ratio:.3f} | {cp_ratio:.2f}")
    if args.sweep_chunks:
        n = args.sweep_len
        print(f"\nchunk sweep at seq_len {n}: chunk | peak MiB | step s")
        for c in [int(x) for x in args.sweep_chunks.split(",")]:
            r = _run_cell(model_dir, n, "chunked", c)
            print(f"{c} | {r['peak_mib']:.0f} | {r['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
