"""TRL half of the e2e benchmark: GRPOTrainer on exactly what an hpcrl bench config describes.

    python scripts/bench/_trl_runner.py configs/bench/e2e_async0.toml --out DIR --steps N --budget-s S

Run as its own process by scripts/bench/e2e.py so torch's thread count, imports and memory are
isolated from the hpcrl runs. Every setting that defines the workload (model dir, env + args,
prompts per step, group size, max new tokens, temperature, lr, optimizer, clipping) is read from
the hpcrl config itself, so the two sides cannot drift apart.

Writes DIR/metrics.jsonl in hpcrl's record shape (role, step, time, metric keys), so e2e.py
summarises both systems with one function:
  orchestrator-like record per step, stamped when generation + scoring finished:
      reward/all/mean, time/generate, batch/samples
  trainer-like record per step, stamped when the optimizer step finished:
      time/step (whole step), time/wait_for_batch (= time/generate: TRL's trainer waits for its own
      generation), time/forward_backward (the rest: loss forward/backward + optimizer step)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="hpcrl bench config (TOML) that defines the workload")
    p.add_argument("--out", required=True, help="output dir (metrics.jsonl, TRL scratch)")
    p.add_argument("--steps", type=int, required=True, help="max optimizer steps")
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop once this many seconds passed since the end of step 1 (0 = off)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument(
        "--model-name", help="override model.name (e.g. an SFT-warmed weights dir), as hpcrl's flag"
    )
    # Anything else is an hpcrl config override (e.g. --trainer.optim.lr 5e-4), applied exactly as
    # `hpcrl run` applies it, so a sweep changes both sides the same way.
    args, args.overrides = p.parse_known_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hpcrl.launch.checks import load

    overrides = (["--model.name", args.model_name] if args.model_name else []) + args.overrides
    cfg = load([args.config, "--max-steps", str(args.steps), *overrides]).config
    o = cfg.orchestrator
    if len(o.train.env) != 1:
        raise SystemExit("the TRL runner supports exactly one [[orchestrator.train.env]]")

    # Threads before torch does any work: the comparison is at equal torch thread counts.
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.envs import load_environment
    from hpcrl.models.resolve import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = open(out / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed at exit

    def emit(record: dict[str, Any]) -> None:
        sink.write(json.dumps(record, separators=(",", ":")) + "\n")

    env_cfg = o.train.env[0]
    env = load_environment(env_cfg.id, **env_cfg.args)
    tasks = list(env.tasks("train", seed=o.seed))
    by_id = {t.example_id: t for t in tasks}
    dataset = Dataset.from_list([{"prompt": t.prompt, "example_id": t.example_id} for t in tasks])

    step_rewards: list[float] = []

    def env_reward(prompts, completions, example_id, **_: Any) -> list[float]:
        # The environment's own rubric on the completion messages, exactly what hpcrl's
        # orchestrator scores (state is empty for a single-turn env).
        rewards = [env.rubric.score(by_id[eid], list(c), {})[0] for eid, c in zip(example_id, completions)]
        step_rewards.append(sum(rewards) / len(rewards))
        return rewards

    s, opt, loss = o.train.sampling, cfg.trainer.optim, cfg.trainer.loss
    if s.top_k not in (-1, 0) or s.min_p or s.repetition_penalty != 1.0:
        raise SystemExit("the TRL runner maps temperature/top_p only; keep other sampling knobs at defaults")
    targs = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        seed=cfg.seed,
        max_steps=args.steps,
        per_device_train_batch_size=o.batch_size,  # completions per optimizer step (16 prompts x 8)
        gradient_accumulation_steps=1,
        num_generations=o.rollouts_per_example,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        learning_rate=opt.lr,
        # TRL's default is linear decay; hpcrl's "constant" warms up linearly first when asked to,
        # which in transformers' names is "constant_with_warmup".
        lr_scheduler_type="constant_with_warmup"
        if opt.scheduler == "constant" and opt.warmup_steps
        else opt.scheduler,
        warmup_steps=opt.warmup_steps,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.max_norm,
        # hpcrl's default loss: token-level sum over the step's loss tokens (= DAPO normalisation),
        # clip ratios eps_low/eps_high, no KL, group-mean baseline without std scaling.
        loss_type="dapo",
        epsilon=loss.eps_low,
        epsilon_high=loss.eps_high,
        beta=loss.kl_coef,
        scale_rewards="group" if o.advantage.std_normalize else "none",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    model_dir = resolve_model(cfg.model.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[env_reward], args=targs, train_dataset=dataset, processing_class=tokenizer
    )

    clock: dict[str, float] = {}
    # A private TRL method (hence the tight trl pin in the `bench` extra): the one place where a
    # step's generation + scoring happens, so timing it splits TRL's step like hpcrl's metrics do.
    generate_and_score = getattr(trainer, "_generate_and_score_completions", None)
    if generate_and_score is None:
        raise SystemExit("this TRL version has no GRPOTrainer._generate_and_score_completions; use trl 1.16")

    def timed_generate(*a: Any, **kw: Any) -> Any:
        # Instance-level wrapper: the same step structure, plus generation+scoring time per step.
        t0 = time.perf_counter()
        result = generate_and_score(*a, **kw)
        clock["gen"] = time.perf_counter() - t0
        emit(
            {
                "role": "orchestrator",
                "step": trainer.state.global_step + 1,
                "time": time.time(),
                "reward/all/mean": step_rewards[-1] if step_rewards else None,
                "time/generate": clock["gen"],
                "batch/samples": o.batch_size,
            }
        )
        return result

    trainer._generate_and_score_completions = timed_generate

    class Clock(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            clock["begin"] = time.perf_counter()
            clock["gen"] = 0.0

        def on_step_end(self, _args, state, control, **kw):
            t_step = time.perf_counter() - clock["begin"]
            now = time.time()
            emit(
                {
                    "role": "trainer",
                    "step": state.global_step,
                    "time": now,
                    "time/step": t_step,
                    "time/wait_for_batch": clock["gen"],
                    "time/forward_backward": t_step - clock["gen"],
                }
            )
            if state.global_step == 1:
                clock["t1"] = now
            elif args.budget_s > 0 and now - clock["t1"] >= args.budget_s:
                control.should_training_stop = True  # equal wall-clock budget as the hpcrl runs

    trainer.add_callback(Clock())
    trainer.train()
    sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
