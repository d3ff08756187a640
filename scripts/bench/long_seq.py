"""Long sequences: peak memory and time of one training step as seq_len grows, vocab 151,936.

    python scripts/bench/long_seq.py [--lens 1024,2048,4096,8192,16384] [--sweep-chunks]
    python scripts/bench/long_seq.py --device cuda [--lens ...]      (bf16, on a GPU)
    python scripts/bench/long_seq.py --lens 4096,16384 --tensors     (+ tensor-level peaks, CPU)

The model is hpcrl/tiny-qwen3-151k (hidden 128, 2 layers, Qwen3's vocabulary: the LM head is what a
long sequence fills memory with). One step = one sample of ``seq_len`` tokens, loss on its second
half (a prompt and a completion of equal length), forward + backward of the default RL loss +
AdamW step, measured after a 256-token warm-up step (AdamW creates its state in its first step; a
trainer holds it from one step to the next, so the "before" of the measured step includes it, as
in training). Every cell is a fresh process. Each cell reports two memory figures:

* on CPU (fp32): the **process peak**, the process's peak RSS during the step (Linux VmHWM, reset
  after the warm-up step and a ``malloc_trim``: it counts what torch's CPU allocator really takes from
  the OS, which tracemalloc cannot see), and the **step increment**, that peak minus the RSS before the
  step (the process baseline: Python, torch, gloo, the model's parameters and AdamW state). The increment is the
  analogue of CUDA's ``max_memory_allocated`` after a reset, which leaves out the CUDA context;
* on CUDA (bf16 compute over fp32 master weights): the peak of ``torch.cuda.max_memory_allocated``
  during the step, and that peak minus ``memory_allocated`` before the step;
* with ``--tensors`` (CPU), in brackets: the **tensor-level peak** of one more step, the largest sum of
  live tensor storages, parameters and optimizer state included (scripts/bench/tensor_peak.py):
  what ``max_memory_allocated`` counts on CUDA, without the RSS's Python, torch and glibc heap.

Columns:

* ``today``: the unchunked head (``trainer.model.logprobs_chunk_tokens = 0``): fp32 logits of every
  kept position and a full log-softmax. Cells whose predicted peak exceeds ``--max-gib`` are not run
  (the machine is shared); their value is extrapolated from the largest measured today cell
  (linear in kept tokens) and marked ``~``.
* ``chunked``: ``logprobs_chunk_tokens = --chunk``.
* ``chunked+ac``: the same with activation checkpointing.
* ``+offload``: the same with ``trainer.model.activation_offload`` (the checkpointed layer inputs in
  pinned CPU memory): CUDA only (on CPU the activations are in CPU memory already).
* ``cp=2/rank``: chunked, cp = 2 over 2 ranks (FSDP over both: the ranks' shared mesh holds the
  parameters, gradients and AdamW state, half each; the embedding and LM head vocabulary-parallel,
  ``trainer.model.vocab_parallel``, the default), the larger of the two ranks: gloo on CPU,
  NCCL on CUDA where 2 GPUs are visible (one GPU: not run).
* ``cp=2/rank, head gathered``: the same with ``vocab_parallel = false`` (FSDP gathers the whole
  embedding / head weight and its gradient on each rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_memory import peak_rss_mib, reset_peak, rss_mib  # noqa: E402

VOCAB = 151_936
MIB = 1024 * 1024
COLUMNS = ("today", "chunked", "chunked_ac", "offload", "cp2", "cp2_gathered")
HEADS = {
    "today": "today",
    "chunked": "chunked",
    "chunked_ac": "chunked+ac",
    "offload": "chunked+ac+offload",
    "cp2": "cp=2 per rank",
    "cp2_gathered": "cp=2 per rank, head gathered",
}


class Meter:
    """Memory before and at the peak of the step: process RSS on CPU, the CUDA allocator on GPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        import torch

        return torch.cuda.memory_allocated() / MIB if self.cuda else rss_mib()

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(
            0
        )  # the warm-up's freed heap back to the OS: "before" is what lives
        reset_peak()

    def peak(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MIB
        return peak_rss_mib()


def long_sample(n: int, device: Any) -> Any:
    """One sample of ``n`` random tokens, the loss on its second half (a prompt and a completion of
    equal length); shared with scripts/bench/gpu.py."""
    import torch

    from hpcrl.trainer.packing import PackedBatch

    g = torch.Generator().manual_seed(1)
    return PackedBatch(
        input_ids=torch.randint(3, VOCAB, (n,), generator=g),
        position_ids=torch.arange(n),
        seq_lens=torch.tensor([n]),
        loss_mask=torch.arange(n) >= n // 2,
        advantages=torch.randn(n, generator=g),
        inference_logprobs=torch.full((n,), -12.0),
    ).to(device)


def rl_loss(fwd: Any, batch: Any, n_loss: int) -> Any:
    """The default RL loss of a forward over ``batch`` (``n_loss`` loss tokens in the whole sample)."""
    from hpcrl.trainer.loss import LossParams, compute_loss

    return compute_loss(
        LossParams(),
        trainer_logprobs=fwd.logprobs,
        loss_mask=batch.loss_mask,
        num_loss_tokens=n_loss,
        inference_logprobs=batch.inference_logprobs,
        advantages=batch.advantages,
        entropy=fwd.entropy,
    ).loss


def one_step(
    model_dir: str, seq_len: int, column: str, chunk: int, device_kind: str, tensors: bool = False
) -> dict[str, Any]:
    """Run in a fresh process (rank of a process group for cp): build, then one measured step."""
    import torch

    from hpcrl.models.spec import load_model
    from hpcrl.trainer import parallel
    from hpcrl.trainer.packing import PackedBatch, forward_packed

    torch.manual_seed(0)
    cp = 2 if column.startswith("cp2") else 1
    chunk = 0 if column == "today" else chunk
    cuda = device_kind == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    group = None
    attn = None
    if cp > 1:
        from hpcrl.models.parallelize import make_cp_group
        from hpcrl.models.ring_attention import register_hf

        parallel.init_distributed(device)
        group = make_cp_group(cp)
        attn = register_hf()
    elif cuda:  # a world of 1: FSDP's mixed precision below still needs a process group
        parallel.init_distributed(device)
    model = load_model(
        model_dir,
        device=device,
        attn_impl=attn,
        activation_checkpointing=column in ("chunked_ac", "offload"),
        activation_offload=column == "offload",
    )
    # bf16 compute over fp32 master weights on GPU (what the trainer's precision does there); under
    # cp the embedding and head vocabulary-parallel (the trainer's default) unless cp2_gathered.
    from hpcrl.models.parallelize import parallelize as shard_model

    model = shard_model(
        model,
        param_dtype=torch.bfloat16 if cuda else None,
        force=cuda,
        cp=group,
        vocab_parallel=column == "cp2",
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def sample(n: int) -> PackedBatch:
        return long_sample(n, device)

    def step(batch: PackedBatch, meter: Meter | None = None) -> float:
        n_loss = int(batch.loss_mask.sum())
        if group is not None:
            from hpcrl.trainer.context_parallel import forward_cp, restrict

            batch = restrict(batch, group)
            fwd = forward_cp(model, batch, group, wanted=batch.loss_mask, chunk_tokens=chunk)
        else:
            fwd = forward_packed(model, batch, wanted=batch.loss_mask, chunk_tokens=chunk)
        after_fwd = meter.now() if meter else 0.0
        rl_loss(fwd, batch, n_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return after_fwd

    # A short warm-up step first: AdamW creates its state in the first step, and a trainer holds it
    # between steps, so the measured step is a steady-state one (its "before" includes that state)
    step(sample(256))
    batch = sample(seq_len)
    meter = Meter(device)
    meter.reset()
    before = meter.now()
    meter.reset()
    t0 = time.perf_counter()
    after_fwd = step(batch, meter)
    peak = meter.peak()  # synchronizes on CUDA: the time below includes the step's kernels
    step_s = time.perf_counter() - t0
    out = {
        "peak_mib": peak,
        "before_mib": before,
        "step_mib": peak - before,
        "saved_mib": after_fwd - before,  # what the forward keeps for the backward (activations)
        "step_s": step_s,
    }
    if tensors:  # one more step, every tensor counted (slower: every op passes a dispatch mode)
        from tensor_peak import TensorPeak, alive_in

        with TensorPeak(alive_in(model, opt), where=True) as tp:
            step(batch)
        out.update(tensor_peak_mib=tp.peak_mib, tensor_before_mib=tp.start_mib, tensor_top=tp.peak_top)
    return out


def _run_cell(
    model_dir: str, seq_len: int, column: str, chunk: int, device: str, tensors: bool = False
) -> dict[str, Any]:
    from hpcrl.net import free_port
    from hpcrl.runtime import rank_env

    world = 2 if column.startswith("cp2") else 1
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "2" if world == 1 else "1", "PYTHONPATH": str(REPO)}
        if world > 1 or device == "cuda":
            env.update(rank_env(rank, world, "127.0.0.1", port))
        args = [sys.executable, __file__, "--cell", model_dir, str(seq_len), column, str(chunk), device]
        args.append(str(int(tensors)))
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


def columns_for(device: str) -> tuple[list[str], dict[str, str]]:
    """The columns this device runs, and why the others are not run."""
    skip = {}
    if device == "cpu":
        skip["offload"] = "CUDA only"
    else:
        import torch

        if torch.cuda.device_count() < 2:
            skip["cp2"] = skip["cp2_gathered"] = "needs 2 GPUs"
    return [c for c in COLUMNS if c not in skip], skip


def _cell(c: dict[str, float] | None) -> str:
    if c is None:
        return "-"
    if "estimate" in c:
        return f"~{c['peak_mib']:.0f} / ~{c['step_mib']:.0f} (not run)"
    tensors = f" [{c['tensor_peak_mib']:.0f}]" if "tensor_peak_mib" in c else ""
    return f"{c['peak_mib']:.0f} / {c['step_mib']:.0f}{tensors} ({c['step_s']:.1f} s)"


RATIOS = (
    ("chunked/today (peak)", "chunked", "today", "peak_mib"),
    ("cp2/chunked (peak)", "cp2", "chunked", "peak_mib"),
    ("cp2/chunked (step)", "cp2", "chunked", "step_mib"),
    ("cp2/chunked (tensors)", "cp2", "chunked", "tensor_peak_mib"),
    ("cp2 gathered/chunked (tensors)", "cp2_gathered", "chunked", "tensor_peak_mib"),
)


def print_table(rows: dict, chunk: int, device: str, skip: dict[str, str]) -> None:
    """Each cell: peak / step increment MiB [tensor-level peak, with --tensors] (step time); ratios
    where both columns ran."""
    what = "process peak RSS" if device == "cpu" else "peak allocated"
    heads = [HEADS[c] + (f" {chunk}" if c == "chunked" else "") for c in COLUMNS]
    print(
        f"\nMiB: {what} / step increment (= peak - before the step) [tensor-level peak, --tensors], "
        f"step time; {device}"
    )
    print("seq_len | " + " | ".join(heads) + " | " + " | ".join(r[0] for r in RATIOS))
    print("---|" * (len(COLUMNS) + len(RATIOS)) + "---")
    for n, r in rows.items():
        cells = [_cell(r.get(c)) if c not in skip else f"({skip[c]})" for c in COLUMNS]
        ratios = []
        for _, a, b, key in RATIOS:
            ra, rb = r.get(a), r.get(b)
            ratios.append(
                "-"
                if ra is None or rb is None or key not in ra or key not in rb
                else f"{ra[key] / rb[key]:.2f}"
            )
        print(f"{n} | " + " | ".join(cells) + " | " + " | ".join(ratios))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--columns", default=",".join(COLUMNS), help="a subset of " + ",".join(COLUMNS))
    ap.add_argument("--chunk", type=int, default=256, help="logprobs_chunk_tokens of the chunked columns")
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=None,
        help="logprobs_chunk_mib (default: the trainer's); the chunk's positions are bounded as the trainer does",
    )
    ap.add_argument(
        "--tensors",
        action="store_true",
        help="also the tensor-level peak of each cell (one more step under a dispatch mode; CPU)",
    )
    ap.add_argument("--max-gib", type=float, default=8.0, help="do not run a today cell predicted above this")
    ap.add_argument(
        "--sweep-chunks", default="", help="e.g. 256,512,1024,2048: chunk sizes to time at --sweep-len"
    )
    ap.add_argument("--sweep-len", type=int, default=4096)
    args = ap.parse_args()
    if args.cell:
        model_dir, n, column, chunk, device, tensors = args.cell
        print(json.dumps(one_step(model_dir, int(n), column, int(chunk), device, tensors == "1")))
        return 0
    if args.tensors and args.device != "cpu":
        ap.error("--tensors counts CPU tensors: on CUDA the cells already report max_memory_allocated")
    from hpcrl.models.chunked import CHUNK_MIB, chunk_rows
    from hpcrl.models.resolve import resolve_model

    args.chunk = chunk_rows(args.chunk, VOCAB, CHUNK_MIB if args.chunk_mib is None else args.chunk_mib)
    model_dir = resolve_model("hpcrl/tiny-qwen3-151k")
    lens = [int(x) for x in args.lens.split(",")]
    run, skip = columns_for(args.device)
    asked = args.columns.split(",")
    if unknown := set(asked) - set(COLUMNS):
        ap.error(f"--columns: {sorted(unknown)} not among {','.join(COLUMNS)}")
    skip.update({c: "not asked" for c in COLUMNS if c not in asked and c not in skip})
    run = [c for c in run if c in asked]
    rows: dict[int, dict[str, dict[str, float] | None]] = {}
    today_slope = None  # MiB per kept token of the today column's step increment
    for n in lens:
        rows[n] = {}
        for col in run:
            if col == "today" and today_slope is not None and today_slope * n / 2 / 1024 > args.max_gib:
                rows[n][col] = None
                continue
            r = _run_cell(model_dir, n, col, args.chunk, args.device, args.tensors)
            rows[n][col] = r
            if col == "today":
                today_slope = r["step_mib"] / (n / 2)
            print(
                f"  {col:10s} seq {n:6d}: peak {r['peak_mib']:8.0f} MiB (before {r['before_mib']:.0f}, step "
                f"{r['step_mib']:.0f}, kept by the forward {r['saved_mib']:.0f}), {r['step_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
            for mib, what in r.get("tensor_top", [])[:8]:
                print(
                    f"      at the tensor-level peak {r['tensor_peak_mib']:.0f}: {mib:6.1f} {what}",
                    file=sys.stderr,
                )
        if "today" in run and rows[n]["today"] is None and "chunked" in run:
            base = rows[n]["chunked"]["before_mib"]  # type: ignore[index]
            step = today_slope * n / 2  # type: ignore[operator]
            rows[n]["today"] = {"peak_mib": base + step, "step_mib": step, "estimate": 1.0}
    print_table(rows, args.chunk, args.device, skip)
    if args.sweep_chunks:
        n = args.sweep_len
        print(
            f"\nchunk sweep at seq_len {n}: chunk | peak MiB | step increment MiB | tensor peak MiB | step s"
        )
        for c in [int(x) for x in args.sweep_chunks.split(",")]:
            r = _run_cell(model_dir, n, "chunked", c, args.device, args.tensors)
            t = f"{r['tensor_peak_mib']:.0f}" if "tensor_peak_mib" in r else "-"
            print(f"{c} | {r['peak_mib']:.0f} | {r['step_mib']:.0f} | {t} | {r['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
