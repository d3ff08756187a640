"""MoE benchmark: hpcrl's own Qwen3-MoE (impl custom) against transformers', expert parallelism, and
router replay. One run of each; printed tables.

    python scripts/bench/moe.py [--part step|ep|replay|decompose|bitwise|all] [--steps 12]

1. step: one training step (forward + backward + AdamW over 8 x 128 tokens, fp32 on CPU / bf16 on
   CUDA) of the tiny (8 experts) and small (16 experts) MoE, custom vs transformers: tokens/s (median
   of 5 after 2 warmups; on CPU one thread's process CPU time) and peak memory (CUDA: max allocated; CPU: the process's peak RSS, each case
   in its own process).
2. ep: the custom model's train step on 2 gloo ranks with ep = 2 against 1 rank with ep = 1 (same
   global batch), step time and the all-to-all bytes each rank sent, against the ideal for uniform
   routing: tokens x k x (ep-1)/ep x hidden x 4 bytes, twice (dispatch + combine).
3. replay (`--backend vllm` on a GPU node with vLLM: the engine whose kernels the target is about):
   two `hpcrl run`s of the tiny MoE (1 trainer rank, same seed and length) with
   trainer.model.router_replay on and off: mean mismatch KL, rewards, replay hit rate. Synchronous
   (max_async_level = 0: policy lag, which replay cannot remove, stays out of the KL), inference and
   trainer both in bf16 (as GPU RL runs). Target: replay's mismatch KL <= 0.1x the run without. Two
   runs diverge, so their KLs differ by more than routing: then (3b) the same-weights decomposition
   (part 4) at the off run's final weights, which separates the routing part from the numerics floor.
4. decompose: one batch sampled by the embedded engine (bf16) from the tiny and small MoE, and the
   trainer's logprobs of those tokens on the same weights, fp32 and bf16, with routing free, the
   completion's routes replayed, and every token's (scripts/bench/moe_decompose.py); also the tiny
   / small / deep (48 layers x 128 experts, top-8) MoE, and the engine's own model scoring its
   samples in one full forward (the decode-vs-full part no trainer change can remove).
5. bitwise: the custom model against transformers' in bf16 with transformers' routes replayed:
   KL, largest logprob difference, share of bit-identical logprobs (1.000 = the trainer computes
   exactly what the embedded engine's model computes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
BATCH, SEQ = 8, 128


def _model_dir(preset: str) -> Path:
    from hpcrl.models.resolve import resolve_model

    return Path(resolve_model(f"hpcrl/{preset.replace('-moe', '')}-qwen3-moe"))


def one_step(impl: str, preset: str) -> dict:
    """Runs in its own process (peak memory is per process)."""
    import torch

    from hpcrl.models.spec import load_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if dev == "cuda" else "float32"
    if dev == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread: wall time on a shared machine measures neighbours
    clock = time.perf_counter if dev == "cuda" else time.process_time
    model = load_model(_model_dir(preset), dtype, dev, attn_impl="sdpa", impl=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (BATCH, SEQ), generator=g).to(dev)
    times = []
    for i in range(7):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(clock() - t0)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {"tokens_per_s": BATCH * SEQ / statistics.median(times), "peak_mib": peak, "device": dev}


def part_step() -> None:
    print("\n1. training step, custom vs transformers (8 x 128 tokens)")
    print(f"{'model':<10} {'impl':<8} {'tokens/s':>10} {'peak MiB':>10}")
    for preset in ("tiny-moe", "small-moe"):
        for impl in ("custom", "hf"):
            out = subprocess.run(
                [sys.executable, __file__, "--part", "_one", "--impl", impl, "--preset", preset],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{preset:<10} {impl:<8} {r['tokens_per_s']:>10.0f} {r['peak_mib']:>10.0f}  ({r['device']})"
            )


def ep_worker(out: str) -> None:
    import torch

    from hpcrl.models import parallelize as mp
    from hpcrl.models.qwen3.parallelize import apply_ep
    from hpcrl.models.spec import load_model
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.moe_metrics import collect

    env = par.init_distributed(torch.device("cpu"))
    model = load_model(_model_dir("small-moe"), "float32", "cpu", impl="custom")
    ep = env.world_size
    experts = apply_ep(model, ep, torch.device("cpu")) if ep > 1 else set()
    model = mp.apply_fsdp(model, ignored_params=experts or None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (BATCH, SEQ), generator=g)
    per = BATCH // env.world_size
    mine = ids[env.rank * per : (env.rank + 1) * per]
    times, a2a = [], []
    for i in range(6):
        par.barrier()
        t0 = time.perf_counter()
        logits = model(input_ids=mine).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten(), reduction="sum"
        )
        (loss / (BATCH * (SEQ - 1))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        par.barrier()
        stats = collect(model)
        if i >= 1:
            times.append(time.perf_counter() - t0)
            a2a.append(stats["moe/a2a_bytes"] / env.world_size)
    if par.is_rank0():
        cfg = model.config
        layers = len([1 for _ in model.moe_layers()])
        tokens = per * SEQ
        ideal = tokens * cfg.num_experts_per_tok * (ep - 1) / ep * cfg.hidden_size * 4 * 2 * layers
        Path(out).write_text(
            json.dumps({"step_s": statistics.median(times), "a2a": statistics.median(a2a), "ideal": ideal})
        )
    par.barrier()
    par.destroy_distributed()


def part_ep() -> None:
    from hpcrl.net import free_port
    from hpcrl.runtime import rank_env

    print("\n2. expert parallelism, small MoE (16 experts, top-2, 4 layers), 8 x 128 tokens per step")
    print(f"{'setup':<16} {'step s':>8} {'a2a MB/rank':>12} {'ideal MB':>10}")
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "r.json"
            port = free_port()
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--part", "_ep", "--out", str(out)],
                    env={
                        **os.environ,
                        **rank_env(r, world, "127.0.0.1", port),
                        "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": str(REPO),
                    },
                )  # fmt: skip
                for r in range(world)
            ]
            for p in procs:
                assert p.wait(timeout=600) == 0
            r = json.loads(out.read_text())
        print(
            f"ep={world} ({world} rank) {r['step_s']:>8.3f} {r['a2a'] / 1e6:>12.3f} {r['ideal'] / 1e6:>10.3f}"
        )


SETTINGS = {
    # [orchestrator] lines, [model] lines (inference), [trainer.model] lines. Synchronous: the KL is only
    # engine vs trainer, no policy lag (which replay cannot remove: routes of an older policy).
    # Both in bf16, as GPU RL runs (vLLM bf16, trainer bf16 compute): different kernels, same weights.
    "sync bf16": ("max_async_level = 0\n", 'dtype = "bfloat16"\n', 'dtype = "bfloat16"\n'),
    # (An fp32 trainer beside a bf16 engine is no run setting: the policy is published in the trainer's
    # compute dtype and the server's checksum of it in bf16 would not match; part 4 measures that pair.)
}


def _run(
    steps: int, d: Path, orch: str, model: str, trainer_model: str, replay: bool, backend: str = "hf"
) -> Path:
    from tests.conftest import rl_toml

    cfg = d / "cfg.toml"
    tables = f'[trainer.optim]\nlr = 1e-2\n[ckpt]\nweights_only = true\n[inference]\nbackend = "{backend}"\n'
    text = rl_toml(steps, seq_len=64, model="hpcrl/tiny-qwen3-moe", max_tokens=8, top="seed = 3\n",
                   orchestrator=orch, tables=tables)  # fmt: skip
    text = text.replace('id = "reverse-text"', 'id = "tests.integration.short_env"')
    # [trainer.model] states its dtype: a role's own model section does not inherit [model]'s
    text += f"[trainer.model]\nrouter_replay = {str(replay).lower()}\n{trainer_model}"
    cfg.write_text(text.replace("[orchestrator]\n", model + "[orchestrator]\n", 1))
    out = d / "run"
    done = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        check=False, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"run failed (replay {replay}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return out


def part_replay(steps: int, backend: str = "hf") -> None:
    from scripts.bench.moe_decompose import decompose, print_table

    print(
        f"\n3. router replay on vs off: tiny MoE, {steps} steps, 1 trainer rank, same seed, {backend} engine"
    )
    print(
        f"{'setting':<15} {'replay':<7} {'mismatch KL':>12} {'reward 1-3':>11} {'reward last 3':>14} {'hit rate':>9}"
    )
    floors = []
    for name, (orch, model, trainer_model) in SETTINGS.items():
        kls = {}
        for replay in (True, False):
            with tempfile.TemporaryDirectory() as d:
                out = _run(steps, Path(d), orch, model, trainer_model, replay, backend)
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                if not replay:  # the off run's last weights: the same-weights decomposition below
                    last = max((out / "weights").glob("step_*"), key=lambda p: int(p.name[5:]))
                    dtype = "bfloat16" if "bfloat16" in trainer_model else "float32"
                    floors.append((name, last.name, decompose(str(last), dtypes=(dtype,))))
            kl = [r["mismatch_kl/mean"] for r in rows if "mismatch_kl/mean" in r]
            rew = {r["step"]: r["reward/all/mean"] for r in rows if "reward/all/mean" in r}
            hit = [r["moe/replay_hit_rate"] for r in rows if "moe/replay_hit_rate" in r]
            kls[replay] = statistics.mean(kl)
            first = statistics.mean(rew[s] for s in (1, 2, 3))
            last3 = statistics.mean(rew[s] for s in range(steps - 2, steps + 1))
            h = f"{statistics.mean(hit):.3f}" if hit else "-"
            on = "on" if replay else "off"
            print(f"{name:<15} {on:<7} {kls[replay]:>12.3g} {first:>11.3f} {last3:>14.3f} {h:>9}")
        ratio = kls[True] / kls[False] if kls[False] else float("nan")
        print(f"{name:<15} replay / no replay mismatch KL (raw, two runs): {ratio:.3f} (target <= 0.1)")
    # Two runs diverge (different updates), so their KLs differ by more than routing. The routing
    # part is measured on one batch at the off run's final weights: trainer logprobs with free routes,
    # with the completion's routes replayed, and with every token's (the numerics floor: what is left
    # when the trainer computes every token with the engine's experts).
    for name, step, rows in floors:
        print_table(f"3b. {name}: the off run's weights/{step}, one batch, routing free vs replayed", rows)


def part_decompose() -> None:
    import torch

    from scripts.bench.moe_decompose import decompose, print_table

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # both roles on it: the device's own kernels
    for preset in ("tiny-moe", "small-moe", "deep-moe"):
        title = f"4. mismatch KL decomposition, {preset} on {dev} (engine bf16; same weights, same sampled tokens)"
        print_table(title, decompose(str(_model_dir(preset)), device=dev))


def part_bitwise() -> None:
    import torch

    from scripts.bench.moe_decompose import bitwise

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\n5. custom vs transformers, bf16 on {dev}, transformers' routes replayed (one full forward each)"
    )
    print(f"{'model':<10} {'KL(hf || custom)':>17} {'max |d logprob|':>16} {'bit-identical':>14}")
    for preset in ("tiny-moe", "small-moe", "deep-moe"):
        r = bitwise(str(_model_dir(preset)), dev)
        print(f"{preset:<10} {r['kl']:>17.3g} {r['max_abs']:>16.3g} {r['equal']:>14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--part",
        default="all",
        choices=["all", "step", "ep", "replay", "decompose", "bitwise", "_one", "_ep"],
    )
    ap.add_argument("--impl", default="custom")
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=12)
    # replay: the inference engine the runs sample with. vllm (a GPU node with vLLM installed) is where
    # the target is meant: its fused MoE kernels route differently from the trainer's; the embedded hf
    # engine computes what the bf16 trainer computes (docs/trainer.md), so its runs leave replay little.
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    a = ap.parse_args()
    if a.part == "_one":
        print(json.dumps(one_step(a.impl, a.preset)))
        return
    if a.part == "_ep":
        ep_worker(a.out)
        from hpcrl.trainer.parallel import hard_exit

        hard_exit(0)
    if a.part in ("all", "step"):
        part_step()
    if a.part in ("all", "ep"):
        part_ep()
    if a.part in ("all", "replay"):
        part_replay(a.steps, a.backend)
    if a.part in ("all", "decompose"):
        part_decompose()
    if a.part in ("all", "bitwise"):
        part_bitwise()


if __name__ == "__main__":
    main()
