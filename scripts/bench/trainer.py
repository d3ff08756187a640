"""Trainer benchmark: is our train step as fast as a plain training loop, and how much do we pad?

    python scripts/bench/trainer.py [--preset small|tiny] [--samples 64] [--repeats 5] [--memory on|off|only]

1. Throughput. The real RL `train_step` of hpcrl/trainer/rl.py (TrainBatch -> packed micro-batches ->
   forward_packed -> RL loss -> backward -> clip -> AdamW, with its finite checks and stats) and the
   SFT step of hpcrl/trainer/sft.py (rows packed by first-fit decreasing -> the same step core),
   against a bare loop written plainly below as a Hugging Face loop would: the same micro-batches
   of whole samples, right-padded to the longest with a 2D mask, cross-entropy, backward, AdamW.
   Then a GRPO-shaped batch (prompts x completions sharing each prompt) through `train_step` with
   `share_prefix` off and on: the speed-up of computing each prompt once per group. Runs are interleaved (one of each per repeat, rotating which goes
   first) so load drifts hit all alike; medians after warmup. On CPU the ratio uses process CPU
   time, because on a shared machine wall time mostly measures the neighbours (wall is printed too).
   Target: ours / bare >= 0.9.
2. Padding waste on the same kind of batch: our RL micro-batches (one packed row with varlen
   kernels: nothing padded; rows as wide as the longest sample with sdpa/eager on CPU); our SFT rows if they were padded into a [rows, T] tensor, T = the longest row (dynamic
   shapes) or T = seq_len (static shapes); and naive right-padding of every sample to the longest
   sample. Target <= 5 %.
3. Memory at load (scripts/bench/trainer_memory.py): peak RSS per rank for 1 and 2 ranks, meta-device
   init against every rank loading the whole model, with a ~53 M-parameter model (``--memory only``).

Everything is built locally (tiny Qwen3-style model, no hub); CPU by default, CUDA when present.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def make_batch(rng: np.random.Generator, n: int, lo: int, hi: int, vocab: int):
    """A realistic RL TrainBatch: n samples of lo..hi tokens, the last ~70 % of each is completion."""
    from hpcrl.bus import TrainBatch

    lens = rng.integers(lo, hi + 1, size=n)
    ids, pos, mask, adv, lp = [], [], [], [], []
    for L in lens:
        p = max(1, int(L * 0.3))
        ids.append(rng.integers(3, vocab, size=L))
        pos.append(np.arange(L))
        m = np.zeros(L, dtype=bool)
        m[p:] = True
        mask.append(m)
        adv.append(np.full(L, rng.normal(), dtype=np.float32) * m)
        lp.append(np.where(m, -rng.random(L) * 3, 0.0).astype(np.float32))
    cat = np.concatenate
    loss_tokens = int(sum(m.sum() for m in mask))
    return TrainBatch(
        step=1,
        rank=0,
        world_size=1,
        input_ids=cat(ids),
        position_ids=cat(pos),
        seq_lens=lens,
        loss_mask=cat(mask),
        advantages=cat(adv),
        inference_logprobs=cat(lp),
        policy_versions=np.zeros(n),
        temperatures=np.ones(n),
        env_names=["bench"] * n,
        example_ids=np.arange(n),
        rewards=np.zeros(n),
        total_loss_tokens=loss_tokens,
    )


def make_group_batch(
    rng: np.random.Generator, prompts: int, group: int, prompt_len: int, lo: int, hi: int, vocab: int
):
    """A GRPO-shaped TrainBatch: ``prompts`` prompts x ``group`` completions of lo..hi tokens each."""
    from hpcrl.bus import TrainBatch

    ids, mask, lens = [], [], []
    for _ in range(prompts):
        prompt = rng.integers(3, vocab, size=prompt_len)
        for _ in range(group):
            n = int(rng.integers(lo, hi + 1))
            ids.append(np.concatenate([prompt, rng.integers(3, vocab, size=n)]))
            mask.append(np.arange(prompt_len + n) >= prompt_len)
            lens.append(prompt_len + n)
    m = np.concatenate(mask)
    k = len(lens)
    return TrainBatch(
        step=1,
        rank=0,
        world_size=1,
        input_ids=np.concatenate(ids),
        position_ids=np.concatenate([np.arange(n) for n in lens]),
        seq_lens=np.array(lens),
        loss_mask=m,
        advantages=(rng.normal(size=m.size) * m).astype(np.float32),
        inference_logprobs=np.where(m, -rng.random(m.size) * 3, 0.0).astype(np.float32),
        policy_versions=np.zeros(k),
        temperatures=np.ones(k),
        env_names=["bench"] * k,
        example_ids=np.arange(k),
        rewards=np.zeros(k),
        total_loss_tokens=int(m.sum()),
    )


def bare_step(model, opt, batch, micro_tokens: int, device) -> None:
    """A plain training step as a Hugging Face loop writes it, without any hpcrl helper: greedy
    micro-batches of whole samples, each right-padded to its longest sample with a 2D mask."""
    import torch
    import torch.nn.functional as F

    lens = [int(x) for x in batch.seq_lens]
    ids = torch.as_tensor(batch.input_ids, dtype=torch.long, device=device)
    mask = torch.as_tensor(batch.loss_mask, device=device)
    n_loss = int(mask.sum())
    offsets = np.concatenate([[0], np.cumsum(lens)])
    start = 0
    while start < len(lens):  # greedy micro-batches of whole samples, <= micro_tokens
        end, used = start, 0
        while end < len(lens) and (used == 0 or used + lens[end] <= micro_tokens):
            used += lens[end]
            end += 1
        width = max(lens[start:end])
        x = torch.zeros(end - start, width, dtype=torch.long, device=device)
        attn = torch.zeros_like(x)
        trained = torch.zeros(end - start, width, dtype=torch.bool, device=device)
        for r, s in enumerate(range(start, end)):
            x[r, : lens[s]] = ids[offsets[s] : offsets[s + 1]]
            attn[r, : lens[s]] = 1
            trained[r, : lens[s]] = mask[offsets[s] : offsets[s + 1]]
        logits = model(input_ids=x, attention_mask=attn, use_cache=False).logits.float()
        # the logits at column c predict column c + 1
        keep = trained[:, 1:]
        loss = F.cross_entropy(logits[:, :-1][keep], x[:, 1:][keep], reduction="sum") / n_loss
        loss.backward()
        start = end
    opt.step()
    opt.zero_grad(set_to_none=True)


def row_padding(lens: list[int], micro_tokens: int, key_cost: float | None) -> float:
    """Padding of the CPU row layout (hpcrl/trainer/layout.py) over the RL micro-batches of ``lens``,
    as `train_step` lays them out (``key_cost`` None: the old rows exactly as wide as the longest)."""
    import torch

    from hpcrl.trainer.layout import row_layout
    from hpcrl.trainer.packing import PackedBatch, row_micro_batches

    t = sum(lens)
    batch = PackedBatch(
        input_ids=torch.arange(t),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.zeros(t, dtype=torch.bool),
    )
    slots = pad = 0
    for mb in row_micro_batches(batch, micro_tokens, key_cost):
        lay = row_layout(mb.seq_lens, None, key_cost, width=mb.row_width)
        slots, pad = slots + lay.rows * lay.width, pad + lay.padding
    return pad / slots


def padding_table(
    rng: np.random.Generator,
    n: int,
    lo: int,
    hi: int,
    seq_lens: list[int],
    trials: int,
    micro_tokens: int,
    key_cost: float,
):
    from hpcrl.trainer.sft_data import pack_rows, padding_waste

    naive, fixed, longest = [], {s: [] for s in seq_lens}, {s: [] for s in seq_lens}
    rows_cpu, rows_longest = [], []
    for _ in range(trials):
        lens = rng.integers(lo, hi + 1, size=n).tolist()
        naive.append(1 - sum(lens) / (n * max(lens)))
        rows_cpu.append(row_padding(lens, micro_tokens, key_cost))
        rows_longest.append(row_padding(lens, micro_tokens, None))
        for s in seq_lens:
            rows = pack_rows(lens, s)
            fixed[s].append(padding_waste(lens, rows, s))
            longest[s].append(padding_waste(lens, rows))
    med = statistics.median
    out = [
        ("hpcrl RL micro-batches, varlen kernel (GPU flash-attention: one packed row)", "0.0 %", ""),
        (
            "hpcrl RL micro-batches, sdpa/eager (CPU: row width chosen per batch, layout.choose_width)",
            f"{100 * med(rows_cpu):.1f} %",
            "",
        ),
        ("  before: rows exactly as wide as the longest sample", f"{100 * med(rows_longest):.1f} %", ""),
    ]
    out += [
        (f"hpcrl SFT rows, seq_len {s}", f"{100 * med(longest[s]):.1f} %", f"{100 * med(fixed[s]):.1f} %")
        for s in seq_lens
    ]
    out.append(("baseline: right-pad each sample to the longest sample", f"{100 * med(naive):.1f} %", ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--sft-seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--memory",
        choices=["on", "off", "only"],
        default="on",
        help="the memory table at load (trainer_memory.py: 1 and 2 ranks, meta init vs every rank loading)",
    )
    ap.add_argument(
        "--group-shape",
        default="16x8x56x4-16",
        help="GRPO batch for the shared-prefix table: PROMPTSxGROUPxPROMPT_LENxMIN-MAX completion tokens",
    )
    args = ap.parse_args(argv)
    if args.memory == "only":
        return memory_part()

    os.environ.setdefault("HPCRL_CACHE", str(Path(tempfile.gettempdir()) / "hpcrl-bench-cache"))
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        os.environ.pop(v, None)
    from hpcrl.launch.local import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from hpcrl.config.schema import OptimConfig, TrainerModelConfig
    from hpcrl.trainer import sft_data as sd
    from hpcrl.trainer.core import step_micro_batches
    from hpcrl.trainer.layout import key_cost_of
    from hpcrl.trainer.loss import LossParams
    from hpcrl.trainer.rl import train_step
    from hpcrl.trainer.setup import build_training
    from hpcrl.trainer.sft import micro_batches_for

    optim = OptimConfig(lr=1e-4, max_norm=1.0)
    tr = build_training(TrainerModelConfig(name=f"hpcrl/{args.preset}-qwen3"), optim, 1000, seed=0)
    vocab = tr.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    batch = make_batch(rng, args.samples, args.min_len, args.max_len, vocab)
    n_tok, n_loss = len(batch.input_ids), batch.total_loss_tokens
    sft_samples = []
    off = 0
    for L in batch.seq_lens.tolist():
        sft_samples.append(sd.TokenizedSample(batch.input_ids[off : off + L], batch.loss_mask[off : off + L]))
        off += L

    bare_model = copy.deepcopy(tr.model)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    rl_params, sft_params = LossParams(mode="rl"), LossParams(mode="sft")
    sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)

    def run_rl() -> None:
        train_step(tr, batch, rl_params, args.micro_batch_tokens, optim.max_norm)

    def run_sft() -> None:
        mbs, _ = micro_batches_for(sft_samples, args.sft_seq_len, args.micro_batch_tokens, tr.device)
        step_micro_batches(tr, mbs, sft_params, n_loss, optim.max_norm, 1, time.perf_counter())

    def run_bare() -> None:
        bare_step(bare_model, bare_opt, batch, args.micro_batch_tokens, tr.device)

    n_prompts, group, prompt_len, span = args.group_shape.split("x")
    lo, hi = (int(x) for x in span.split("-"))
    grpo = make_group_batch(rng, int(n_prompts), int(group), int(prompt_len), lo, hi, vocab)

    def run_grpo_full() -> None:
        train_step(tr, grpo, rl_params, args.micro_batch_tokens, optim.max_norm, share_prefix=False)

    def run_grpo_shared() -> None:
        train_step(tr, grpo, rl_params, args.micro_batch_tokens, optim.max_norm, share_prefix=True)

    paths = [
        ("bare", run_bare),
        ("rl", run_rl),
        ("sft", run_sft),
        ("grpo_full", run_grpo_full),
        ("grpo_shared", run_grpo_shared),
    ]
    wall: dict[str, list[float]] = {k: [] for k, _ in paths}
    cpu: dict[str, list[float]] = {k: [] for k, _ in paths}
    t_start = time.perf_counter()
    for i in range(args.warmup + args.repeats):
        k = i % len(paths)
        for name, fn in paths[k:] + paths[:k]:  # rotate the order: no path always runs first
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            if i >= args.warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    # On a shared CPU, wall time mostly measures the neighbours; process CPU time is what the step
    # itself costs, so the ratio uses it (on CUDA, wall time: the GPU does the work).
    basis = wall if tr.device.type == "cuda" else cpu
    med = {k: statistics.median(v) for k, v in basis.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    tps = {k: n_tok / v for k, v in med.items()}
    n_params = sum(p.numel() for p in tr.model.parameters())

    print(
        f"\ntrainer benchmark: preset {args.preset} ({n_params / 1e6:.2f}M params), {args.samples} samples of "
        f"{args.min_len}-{args.max_len} tokens ({n_tok} tokens, {n_loss} trained), micro_batch_tokens "
        f"{args.micro_batch_tokens}; torch {torch.__version__} on {tr.device} ({torch.get_num_threads()} threads); "
        f"median of {args.repeats} after {args.warmup} warmup ({time.perf_counter() - t_start:.0f} s)\n"
    )
    unit = "GPU wall" if tr.device.type == "cuda" else "CPU"
    print(f"| step | median {unit} s | median wall s | tokens/s ({unit}) | vs bare |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "bare": "bare forward+backward+AdamW (plain loop in this script)",
        "rl": "hpcrl RL `train_step` (rl.py)",
        "sft": "hpcrl SFT step (packed rows + shared step core)",
    }
    for k in ("bare", "rl", "sft"):
        print(
            f"| {labels[k]} | {med[k]:.3f} | {med_wall[k]:.3f} | {tps[k]:,.0f} | {tps[k] / tps['bare']:.2f} |"
        )
    g_tok = len(grpo.input_ids)
    print(
        f"\nGRPO-shaped batch ({n_prompts} prompts x {group} completions, {prompt_len}-token prompts, {lo}-{hi} "
        f"completion tokens: {g_tok} tokens), RL `train_step` with and without shared prefixes:\n"
    )
    print(f"| train_step | median {unit} s | median wall s | tokens/s ({unit}) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for k, label in (
        ("grpo_full", "share_prefix = false (every sample in full)"),
        ("grpo_shared", "share_prefix = true (each prompt computed once per group)"),
    ):
        print(
            f"| {label} | {med[k]:.3f} | {med_wall[k]:.3f} | {g_tok / med[k]:,.0f} | "
            f"{med['grpo_full'] / med[k]:.2f}x |"
        )
    print(
        f"\n| packing ({args.samples} samples of {args.min_len}-{args.max_len} tokens, median of 200 batches) "
        f"| padded to longest row | padded to seq_len |"
    )
    print("|---|---:|---:|")
    for label, a, b in padding_table(
        np.random.default_rng(args.seed + 1),
        args.samples,
        args.min_len,
        args.max_len,
        [256, 512, 1024],
        200,
        args.micro_batch_tokens,
        key_cost_of(tr.model.config),
    ):
        print(f"| {label} | {a} | {b} |")
    from hpcrl.trainer import parallel

    parallel.destroy_distributed()
    return memory_part() if args.memory == "on" else 0


def memory_part() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer_memory import memory_table

    memory_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
