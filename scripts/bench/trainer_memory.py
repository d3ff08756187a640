"""Trainer memory at load: peak RSS per rank for 1 and 2 ranks, meta-device init against every rank
loading the whole model (the old path, ``build_training(meta_init=False)``), measured in the same run.

    python scripts/bench/trainer_memory.py [--preset medium]     (also the last table of trainer.py)

Every rank is a real process (gloo, torchrun-style environment) that runs the trainer's own
``build_training`` (load, FSDP2 sharding, AdamW) and then one RL ``train_step``. Columns, in MiB:
RSS after the imports (torch, transformers and the model's code: the floor; importing peaks higher
for a moment, so the peak is reset there), peak RSS while the model is loaded and sharded, RSS at that moment (what the
rank still holds), and peak RSS through one step (gradients, AdamW state and the gathered layers of
a forward come on top). The model is built locally
(hpcrl/models/tiny.py preset ``medium``, ~53 M parameters, 212 MB in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
MIB = 1024 * 1024


def peak_rss_mib() -> float:
    """Peak RSS since the process started or since the last ``reset_peak`` (VmHWM)."""
    return rss_mib("VmHWM")


def reset_peak() -> None:
    """Start the peak over from the current RSS (Linux >= 4.0), so the import spike does not hide the load."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_mib(kind: str = "VmRSS") -> float:
    """Current RSS (``VmRSS``), or only its anonymous part (``RssAnon``: memory the process owns, not
    pages of mapped files such as safetensors weights still mapped from the page cache)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {kind} in /proc/self/status")


def worker(model_dir: str, meta_init: bool, out: str) -> None:
    """One rank: build the trainer (load + shard + optimizer), one RL step; write what RSS did."""
    import numpy as np
    import torch
    import transformers

    from hpcrl.bus import TrainBatch
    from hpcrl.config.schema import OptimConfig, TrainerModelConfig
    from hpcrl.trainer import parallel
    from hpcrl.trainer.loss import LossParams
    from hpcrl.trainer.rl import train_step
    from hpcrl.trainer.setup import build_training

    # The floor includes the model's code: build it once on the meta device (no weights) so that
    # transformers' lazy imports are not counted as the load.
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    floor, imported = peak_rss_mib(), rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    tr = build_training(
        TrainerModelConfig(name=model_dir), OptimConfig(lr=1e-5), 10, seed=0, meta_init=meta_init
    )
    t_load = time.perf_counter() - t0
    built_peak, built_now, built_anon = peak_rss_mib(), rss_mib(), rss_mib("RssAnon")
    rng = np.random.default_rng(tr.dist.rank)
    lens = np.full(4, 64)
    mask = np.concatenate([np.arange(n) >= 16 for n in lens])
    batch = TrainBatch(
        step=1,
        rank=tr.dist.rank,
        world_size=tr.dist.world_size,
        input_ids=rng.integers(3, tr.model.config.vocab_size, size=int(lens.sum())),
        position_ids=np.concatenate([np.arange(n) for n in lens]),
        seq_lens=lens,
        loss_mask=mask,
        advantages=(rng.normal(size=mask.size) * mask).astype(np.float32),
        inference_logprobs=np.where(mask, -5.0, 0.0).astype(np.float32),
        policy_versions=np.zeros(4),
        temperatures=np.ones(4),
        env_names=["x"] * 4,
        example_ids=np.arange(4),
        rewards=np.zeros(4),
        total_loss_tokens=int(mask.sum()) * tr.dist.world_size,
    )
    train_step(tr, batch, LossParams(), 256, 1.0)
    res = {
        "rank": tr.dist.rank,
        "floor": floor,
        "imported": imported,
        "built_peak": built_peak,
        "built_now": built_now,
        "built_anon": built_anon,
        "step_peak": peak_rss_mib(),
        "load_s": t_load,
        "params": sum(p.numel() for p in tr.model.parameters()),
    }
    Path(out, f"rank{tr.dist.rank}.json").write_text(json.dumps(res))
    parallel.barrier()
    parallel.destroy_distributed()


def run_ranks(model_dir: Path, world: int, meta_init: bool, out: Path) -> list[dict]:
    from hpcrl.net import free_port
    from hpcrl.runtime import rank_env

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            **rank_env(rank, world, "127.0.0.1", port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    str(model_dir),
                    "meta" if meta_init else "full",
                    str(out),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        text = p.communicate(timeout=600)[0]
        if p.returncode != 0:
            raise SystemExit(f"memory worker failed:\n{text[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def memory_table(preset: str = "medium") -> None:
    from hpcrl.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="hpcrl-bench-mem-"))
    try:
        model_dir = build_tiny_model(root / "model", preset=preset)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / MIB
        runs = [
            ("1", "single rank (loads the model)", 1, False),
            ("2", "every rank loads the whole model (old path)", 2, False),
            ("2", "meta-device init (rank 0 reads, others on meta)", 2, True),
        ]
        rows = []
        for ranks, label, world, meta in runs:
            for r in run_ranks(model_dir, world, meta, root / f"{world}-{meta}"):
                rows.append((ranks, label, r))
        n = rows[0][2]["params"]
        print(
            f"\ntrainer memory at load: preset {preset} ({n / 1e6:.1f}M params, {size:.0f} MiB of fp32 "
            f"safetensors), CPU, gloo; RSS in MiB per rank\n"
        )
        print(
            "| ranks | init | rank | RSS after imports | peak during load+shard | RSS after load+shard | "
            "peak through 1 step | load s |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for ranks, label, r in rows:
            print(
                f"| {ranks} | {label} | {r['rank']} | {r['imported']:,.0f} | {r['built_peak']:,.0f} | "
                f"{r['built_now']:,.0f} ({r['built_anon']:,.0f}) | {r['step_peak']:,.0f} | {r['load_s']:.1f} |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "INIT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        model_dir, init, out = args.worker
        worker(model_dir, init == "meta", out)
        return 0
    memory_table(args.preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
