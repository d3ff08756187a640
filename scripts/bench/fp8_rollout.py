"""FP8 rollout on CPU: the demo task with the embedded engine sampling from emulated block-wise FP8
weights (inference.quantization = fp8_per_block, hpcrl.inference.fp8) against the same run in the
model dtype, and FP8 with token-level TIS (trainer.loss.use_tis, cap 2). docs/fp8.md holds the figures.

    python scripts/bench/fp8_rollout.py [--rl-steps 60] [--async-level 0] [--out outputs/bench-fp8]
                                        [--only NAME,NAME] [--reuse-sft]

Steps: SFT warm-up of the tiny model as scripts/demo.sh does it (RL from random init learns little),
then one `hpcrl run configs/demo/rl.toml` per variant from the SFT weights, eval off. Printed per
variant: the trainer/sampler mismatch KL (mean of mismatch_kl/all/mean over the steps, and at step 1),
the share of tokens TIS truncated, and the train reward (mean of the first and of the last 10 steps).
With --async-level 0 (default) every sample comes from the trainer's current policy, so the mismatch
KL is the sampler's numerics alone (FP8 vs the trainer), not policy lag.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "model dtype": [],
    "fp8_per_block": ["--inference.quantization", "fp8_per_block"],
    "fp8_per_block + TIS 2": ["--inference.quantization", "fp8_per_block", "--trainer.loss.use-tis"],
    # a cap inside the ratios this mismatch produces (|log r| up to ~0.4 here), so TIS really truncates
    "fp8_per_block + TIS 1.1": [
        "--inference.quantization",
        "fp8_per_block",
        "--trainer.loss.use-tis",
        "--trainer.loss.tis-clip",
        "1.1",
    ],  # fmt: skip
    "mxfp8": ["--inference.quantization", "mxfp8"],
}
WINDOW = 10


def summarize(records: list[dict], window: int = WINDOW) -> dict[str, float]:
    """Pure: metrics.jsonl records -> the figures printed (unit-tested in tests/unit/test_fp8_bench.py)."""
    by_step: dict[int, dict] = {}
    for r in records:
        if "step" in r:
            by_step.setdefault(int(r["step"]), {}).update(r)
    steps = sorted(s for s, r in by_step.items() if "reward/all/mean" in r)
    kl = [by_step[s]["mismatch_kl/all/mean"] for s in sorted(by_step) if "mismatch_kl/all/mean" in by_step[s]]
    tis = [
        by_step[s].get("mismatch/tis_truncated", 0.0)
        for s in sorted(by_step)
        if "mismatch_kl/all/mean" in by_step[s]
    ]
    reward = [by_step[s]["reward/all/mean"] for s in steps]
    return {
        "steps": float(len(steps)),
        "kl_mean": statistics.fmean(kl) if kl else float("nan"),
        "kl_step1": kl[0] if kl else float("nan"),
        "tis_truncated": statistics.fmean(tis) if tis else 0.0,
        "reward_first": statistics.fmean(reward[:window]) if reward else float("nan"),
        "reward_last": statistics.fmean(reward[-window:]) if reward else float("nan"),
    }


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        rc = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"fp8_rollout: {' '.join(cmd[:3])} failed (exit {rc}); see {log}")


def sft_weights(out: Path, steps: int | None) -> Path:
    bin_ = Path(sys.executable).parent
    data = out / "sft-data" / "train.jsonl"
    _run([sys.executable, "-m", "hpcrl.trainer.sft_data", "make-demo", str(data), "--task", "reverse-text-demo",
          "--n", "2000", "--seed", "0"], out / "sft-data.log")  # fmt: skip
    extra = ["--max-steps", str(steps)] if steps else []
    _run([str(bin_ / "hpcrl"), "sft", "configs/demo/sft.toml", "--clean-output-dir", "true", "--output-dir",
          str(out / "sft"), "--data.name", str(data), *extra], out / "sft.log")  # fmt: skip
    return max((out / "sft" / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def rl(
    out: Path, name: str, flags: list[str], weights: Path, steps: int, async_level: int
) -> dict[str, float]:
    run_dir = out / name.replace(" ", "_").replace("+", "").replace("__", "_").replace(".", "")
    cmd = [str(Path(sys.executable).parent / "hpcrl"), "run", "configs/demo/rl.toml", "--clean-output-dir",
           "--output-dir", str(run_dir), "--model.name", str(weights), "--max-steps", str(steps),
           "--orchestrator.max-async-level", str(async_level), "--orchestrator.eval.interval", "100000",
           "--no-orchestrator.eval.eval-base-model", *flags]  # fmt: skip
    t0 = time.monotonic()
    _run(cmd, out / f"{run_dir.name}.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return summarize(records) | {"wall_s": time.monotonic() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rl-steps", type=int, default=60)
    p.add_argument(
        "--sft-steps", type=int, default=None, help="default: configs/demo/sft.toml's stop_at_loss"
    )
    p.add_argument("--async-level", type=int, default=0)
    p.add_argument("--out", default="outputs/bench-fp8")
    p.add_argument("--only", default="", help=f"comma-separated variants of: {', '.join(VARIANTS)}")
    p.add_argument("--reuse-sft", action="store_true", help="start from <out>/sft's weights if present")
    args = p.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = [v.strip() for v in args.only.split(",") if v.strip()]
    unknown = [v for v in only if v not in VARIANTS]
    if unknown:
        p.error(f"--only: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    t0 = time.monotonic()
    found = sorted((out / "sft" / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    weights = found[-1] if args.reuse_sft and found else sft_weights(out, args.sft_steps)
    print(f"SFT warm-up: {weights} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(
        f"RL: {args.rl_steps} steps each, max_async_level {args.async_level}, reward over first/last {WINDOW} steps"
    )
    print(f"{'variant':24} {'mismatch KL':>12} {'KL step 1':>10} {'TIS trunc':>9} {'reward first':>12} "
          f"{'last':>6} {'wall s':>7}")  # fmt: skip
    for name, flags in VARIANTS.items():
        if only and name not in only:
            continue
        s = rl(out, name, flags, weights, args.rl_steps, args.async_level)
        print(f"{name:24} {s['kl_mean']:12.2e} {s['kl_step1']:10.2e} {s['tis_truncated']:9.2%} "
              f"{s['reward_first']:12.3f} {s['reward_last']:6.3f} {s['wall_s']:7.0f}", flush=True)  # fmt: skip
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
