"""`hpcrl trainer`: one rank of the RL trainer.

    wait for batch N on the bus -> forward/backward over packed micro-batches -> optimizer step
    -> publish policy N (weights to inference + PolicyReady) -> checkpoint when due -> metrics
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Any

import numpy as np
import torch

from hpcrl import checkpoint
from hpcrl.bus import Bus, TrainBatch
from hpcrl.config.schema import CkptConfig, Config
from hpcrl.launch import placement
from hpcrl.monitor import watchdog
from hpcrl.monitor.logging import setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer.layout import key_cost_of
from hpcrl.trainer.loss import LossParams, add_stats, compute_loss, stack_stats, summarize, unstack_stats
from hpcrl.trainer.optim import clip_grad_norm, current_lr
from hpcrl.trainer.packing import (
    MASKED_KERNELS,
    PackedBatch,
    attention_kernel,
    dummy_micro_batch,
    forward_packed,
    micro_batches,
    row_micro_batches,
    with_shared_prefixes,
)
from hpcrl.trainer.publish import PolicyPublisher
from hpcrl.trainer.setup import Training, build_training, loss_params
from hpcrl.trainer.state import load_trainer_state, save_trainer_state

log = logging.getLogger("hpcrl.trainer")


def main(cfg: Config) -> int:
    setup_logging("trainer", (cfg.trainer.log or cfg.log).level)
    paths = RunPaths(cfg.output_dir)
    denv = parallel.dist_env()
    # From here on: a rendezvous, collective or step that never returns ends the process (exit 3).
    watchdog.start(f"trainer[{denv.rank}]", cfg.watchdog_s)
    watchdog.beat(f"joining the trainer group ({denv.world_size} rank(s)) and loading the model")
    placement.start_process(cfg, paths, "trainer", denv.rank, port=denv.master_port)  # before CUDA starts
    warm = cfg.ckpt.warm_start if cfg.ckpt is not None else None
    tr = build_training(cfg.trainer.model or cfg.model, cfg.trainer.optim, cfg.max_steps, cfg.seed + cfg.trainer.seed,
                        warm_start=warm)
    rank = tr.dist.rank
    start, progress = restore(cfg, paths, tr)
    bus = Bus(paths, role="trainer", rank=rank)
    publisher = make_publisher(cfg, paths, bus, rank, tr.precision.compute)
    publisher.publish(tr.model, start)  # policy `start` (0 = base weights): servers verify against it
    watchdog.beat(f"published policy {start}")
    metrics = Metrics.for_run(cfg, paths, "trainer", enabled=rank == 0)
    params = loss_params(cfg.trainer.loss, cfg.orchestrator.training_mode)
    stop = install_stop_handler()
    finalizers: list[threading.Thread] = []
    for step in range(start + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        batch, t_wait = wait_for_batch(bus, step, rank, cfg.trainer.batch_timeout_s, stop)
        if batch is None:  # stop requested while waiting: the last finished step is the checkpoint
            if step - 1 > start:
                maybe_checkpoint(cfg, paths, tr, step - 1, progress, finalizers, force=True)
            log.warning("stop requested while waiting for batch %d: checkpointed step %d, exiting", step, step - 1)
            break
        out = train_step(tr, batch, params, cfg.trainer.micro_batch_tokens, cfg.trainer.optim.max_norm,
                         share_prefix=cfg.trainer.share_prefix)
        t_pub = publisher.publish(tr.model, step)
        if rank == 0:
            bus.cleanup(before_step=step, keep=2)  # every rank has read its shard of `step` by now
        progress = advance(progress, out)
        t_ckpt = maybe_checkpoint(cfg, paths, tr, step, progress, finalizers, force=stop.is_set())
        maybe_save_adapter(cfg.ckpt, paths, tr, step, cfg.max_steps)
        metrics.log(step, step_metrics(out, t_wait, t_pub, t_ckpt, time.perf_counter() - t_step, progress)
                    | {"weights/sync_bytes": publisher.last_sync_bytes})
        if metrics.distributions_due(step):
            metrics.log_distribution(step, "entropy", out["entropies"].numpy())
        watchdog.beat(f"trained and published step {step}")
        if stop.is_set():
            log.warning("stop requested: checkpointed step %d, exiting", step)
            break
    for f in finalizers:
        f.join()
    bus.close()
    metrics.close()
    parallel.destroy_distributed()
    return 0


# ---------------------------------------------------------------------------------------------
def restore(cfg: Config, paths: RunPaths, tr: Training) -> tuple[int, dict[str, Any]]:
    progress = {"step": 0, "total_tokens": 0, "total_samples": 0, "skipped_updates": 0}
    return restore_state(cfg.ckpt, paths, tr, progress)


def restore_state(ckpt: CkptConfig | None, paths: RunPaths, tr: Training, progress: dict[str, Any]
                  ) -> tuple[int, dict[str, Any]]:
    """(step, progress) of `ckpt.resume_step` with model/optimizer/scheduler/RNG restored into `tr`;
    (0, `progress`) without one. Shared by the RL and SFT trainers."""
    if ckpt is None or ckpt.resume_step is None:
        return 0, progress
    step = checkpoint.resolve_resume_step(paths, ckpt.resume_step)
    progress = load_trainer_state(paths, step, tr.dist.rank, tr.dist.world_size, tr.model, tr.optimizer, tr.scheduler)
    log.info("resumed trainer state from %s", paths.checkpoint_dir(step))
    return step, progress


def make_publisher(cfg: Config, paths: RunPaths, bus: Bus, rank: int, dtype: str) -> PolicyPublisher:
    transport = resolve_transport(cfg.trainer.broadcast.transport)
    keep = cfg.orchestrator.max_async_level + 2
    group = None
    if transport == "collective" and rank == 0:
        from hpcrl.weights.rendezvous import num_servers, trainer_join_weight_group

        group = trainer_join_weight_group(paths, bus, num_servers(cfg), cfg.trainer.broadcast.timeout_s)
    b = cfg.trainer.broadcast
    return PolicyPublisher(paths, bus, rank, transport, keep, group, b.chunk_mb, dtype=dtype, delta=b.delta,
                           full_every=b.full_every)


def resolve_transport(name: str) -> str:
    if name != "auto":
        return name
    return "collective" if placement.use_cuda() else "filesystem"


def install_stop_handler() -> threading.Event:
    """SIGUSR2 (SLURM pre-timeout / preemption) and SIGTERM: checkpoint after this step, then exit."""
    ev = threading.Event()

    def handler(signum, _frame):
        log.warning("received signal %d: will checkpoint and stop after the current step", signum)
        if signum == signal.SIGTERM:  # SIGUSR2 leaves minutes before the time limit; SIGTERM leaves seconds
            from hpcrl.monitor.watchdog import arm_exit_deadline

            arm_exit_deadline("trainer")
        ev.set()

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, handler)
    return ev


def wait_for_batch(bus: Bus, step: int, rank: int, timeout: float, stop: threading.Event
                   ) -> tuple[TrainBatch | None, float]:
    """Wait in short slices so a stop signal (preemption) is honoured while idle; None if stopped.
    Collective over ranks: they agree on stopping, so none is left alone in a collective."""
    from hpcrl.bus import BusTimeout

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    while True:
        stopping = parallel.all_reduce(float(stop.is_set()), op="max") > 0
        watchdog.beat(f"waiting for batch {step}")  # waiting on the orchestrator is not a stall of ours
        if stopping:
            return None, time.perf_counter() - t0
        try:
            batch = bus.wait_batch(step, rank, timeout=min(2.0, max(0.01, deadline - time.monotonic())))
            return batch, time.perf_counter() - t0
        except BusTimeout:
            if time.monotonic() >= deadline:
                raise


def to_packed(batch: TrainBatch, device: torch.device) -> PackedBatch:
    def t(a: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if a is None else torch.as_tensor(np.asarray(a)).to(device=device, dtype=dtype)

    return PackedBatch(
        input_ids=t(batch.input_ids, torch.long), position_ids=t(batch.position_ids, torch.long),
        seq_lens=t(batch.seq_lens, torch.long), loss_mask=t(batch.loss_mask, torch.bool),
        advantages=t(batch.advantages, torch.float32), inference_logprobs=t(batch.inference_logprobs, torch.float32),
        temperatures=t(batch.temperatures, torch.float32), teacher_logprobs=t(batch.teacher_logprobs, torch.float32),
        ref_logprobs=t(batch.reference_logprobs, torch.float32),
    )


def train_step(tr: Training, batch: TrainBatch, params: LossParams, micro_tokens: int, max_norm: float,
               *, share_prefix: bool = True) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches, then one (finite-checked) optimizer step."""
    t0 = time.perf_counter()
    packed = to_packed(batch, tr.device)
    packed.validate()
    if attention_kernel(tr.model) in MASKED_KERNELS:  # CPU: rows of samples, shared prefixes
        if share_prefix:
            packed = with_shared_prefixes(packed, micro_tokens, key_cost_of(tr.model.config))
        mbs = row_micro_batches(packed, micro_tokens, key_cost_of(tr.model.config))
    else:  # varlen kernels: one packed row per micro-batch, in order
        mbs = micro_batches(packed, micro_tokens) if packed.num_samples else []
    out = step_micro_batches(tr, mbs, params, batch.total_loss_tokens, max_norm, batch.step, t0)
    tokens = int(parallel.all_reduce(float(len(batch.input_ids))))
    samples = int(parallel.all_reduce(float(len(batch.seq_lens))))
    return {**out, "tokens": tokens, "samples": samples}


def step_micro_batches(tr: Training, mbs: list[PackedBatch], params: LossParams, num_loss_tokens: int | float,
                       max_norm: float, step: int, t0: float) -> dict[str, Any]:
    """The core of a step, shared by the RL and SFT trainers: forward/backward over this rank's
    micro-batches (loss normalised by the step's global loss-token count), then one optimizer step
    that is skipped - on every rank alike - when the loss or grad norm is not finite."""
    # FSDP: every rank must run the same number of forward/backward passes.
    n_mb = int(parallel.all_reduce(float(len(mbs)), op="max"))
    mbs += [dummy_micro_batch(tr.device) for _ in range(n_mb - len(mbs))]
    stats = None
    entropies: list[torch.Tensor] = []  # per loss token, for the entropy distribution (rank 0 logs it)
    tokens = slots = padding = 0
    for mb in mbs:
        fwd = forward_packed(tr.model, mb, wanted=mb.loss_mask)
        tokens, slots, padding = tokens + mb.num_tokens, slots + fwd.slots, padding + fwd.padding
        if fwd.entropy is not None:
            entropies.append(fwd.entropy.detach()[mb.loss_mask.bool()].float().cpu())
        out = compute_loss(params, trainer_logprobs=fwd.logprobs, loss_mask=mb.loss_mask,
                           num_loss_tokens=num_loss_tokens, inference_logprobs=mb.inference_logprobs,
                           advantages=mb.advantages, entropy=fwd.entropy, teacher_logprobs=mb.teacher_logprobs,
                           ref_logprobs=mb.ref_logprobs, seq_lens=mb.seq_lens)
        out.loss.backward()
        stats = add_stats(stats, out.stats)
    t_fb = time.perf_counter() - t0
    grad_norm = clip_grad_norm(tr.model.parameters(), max_norm if max_norm > 0 else None)
    summed = unstack_stats(parallel.all_reduce(stack_stats(stats)))
    ok = math.isfinite(grad_norm) and math.isfinite(float(summed["loss"]))
    if ok:
        tr.optimizer.step()
    else:
        log.error("non-finite loss (%s) or grad norm (%s) at step %d: update skipped, weights unchanged",
                  float(summed["loss"]), grad_norm, step)
    tr.optimizer.zero_grad(set_to_none=True)
    lr = current_lr(tr.optimizer)
    tr.scheduler.step()
    return {"stats": summarize(summed), "grad_norm": grad_norm, "lr": lr, "skipped": not ok,
            "time_fb": t_fb, "micro_batches": n_mb, "padding": padding / max(slots, 1),
            "slots_per_token": slots / max(tokens, 1),
            "entropies": torch.cat(entropies) if entropies else torch.zeros(0)}


def advance(progress: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    return {**progress, "step": progress["step"] + 1, "total_tokens": progress["total_tokens"] + out["tokens"],
            "total_samples": progress["total_samples"] + out["samples"],
            "skipped_updates": progress["skipped_updates"] + int(out["skipped"])}


def maybe_checkpoint(cfg: Config, paths: RunPaths, tr: Training, step: int, progress: dict[str, Any],
                     finalizers: list[threading.Thread], force: bool = False) -> float:
    """Trainer part + HF weights; COMPLETE is written (in the background) once the orchestrator's part
    is done too. Returns seconds spent."""
    c = cfg.ckpt
    if c is None or not (force or checkpoint.is_due(step, cfg.max_steps, c.interval)):
        return 0.0
    return save_checkpoint(c, paths, tr, step, progress, finalizers, checkpoint.PARTS,
                           cfg.orchestrator.policy_timeout_s)


def maybe_save_adapter(c: CkptConfig | None, paths: RunPaths, tr: Training, step: int, max_steps: int) -> bool:
    """LoRA: the adapter alone (peft format) under adapters/step_N every ``ckpt.adapter_interval``
    steps and at the final step (the hosted shape's ``[adapters] interval``). Collective under FSDP."""
    from hpcrl.trainer.model import is_peft_model, save_adapter

    if c is None or not c.adapter_interval or not is_peft_model(tr.model):
        return False
    if step % c.adapter_interval and step != max_steps:
        return False
    save_adapter(tr.model, paths.adapter_dir(step), write=tr.dist.rank == 0)
    return True


def save_checkpoint(c: CkptConfig, paths: RunPaths, tr: Training, step: int, progress: dict[str, Any],
                    finalizers: list[threading.Thread], parts: tuple[str, ...], timeout: float) -> float:
    """HF weights + this trainer's part; rank 0 writes COMPLETE in the background once every part in
    `parts` is done (RL: trainer and orchestrator; SFT: trainer only). Returns seconds spent."""
    t0 = time.perf_counter()
    rank, world = tr.dist.rank, tr.dist.world_size
    from hpcrl.trainer.model import export_hf, is_peft_model, save_adapter

    export_hf(tr.model, tr.tokenizer, paths.weights_dir(step), write=rank == 0, dtype=tr.precision.compute)
    if rank == 0 and c.save_adapter_separately and is_peft_model(tr.model):
        save_adapter(tr.model, paths.weights_dir(step) / "adapter")
    if c.weights_only:
        return time.perf_counter() - t0
    if rank == 0:
        checkpoint.begin_part(paths, step, "trainer", clear=True)
    parallel.barrier()
    save_trainer_state(paths, step, rank, world, tr.model, tr.optimizer, tr.scheduler, progress)
    checkpoint.mark_part_done(paths, step, "trainer", rank=rank)
    if rank == 0:
        with _FINALIZING_LOCK:
            _FINALIZING.add(step)
        th = threading.Thread(target=_finalize, args=(paths, step, world, c, parts, timeout), daemon=False)
        th.start()
        finalizers.append(th)
    return time.perf_counter() - t0


# Steps whose COMPLETE this process is still waiting to write: retention must not delete them.
_FINALIZING: set[int] = set()
_FINALIZING_LOCK = threading.Lock()


def _finalize(paths: RunPaths, step: int, world: int, c: CkptConfig, parts: tuple[str, ...], timeout: float) -> None:
    try:
        if checkpoint.finalize_when_ready(paths, step, parts, world, timeout) is None:
            return
        log.info("checkpoint step_%d complete", step)
        with _FINALIZING_LOCK:
            busy = _FINALIZING - {step}
            removed = checkpoint.apply_retention(paths, c.keep_last, c.keep_interval, in_progress=busy)
        for s in removed:
            import shutil

            shutil.rmtree(paths.weights_dir(s), ignore_errors=True)
    finally:
        with _FINALIZING_LOCK:
            _FINALIZING.discard(step)


def step_metrics(out: dict[str, Any], t_wait: float, t_pub: float, t_ckpt: float, t_step: float,
                 progress: dict[str, Any]) -> dict[str, Any]:
    s = out["stats"]
    m = {
        "loss/mean": s["loss"], "entropy/mean": s["entropy"], "mismatch_kl/mean": s["mismatch_kl"],
        "masked_advantage_positive/mean": s["masked_advantage_positive"],
        "masked_advantage_negative/mean": s["masked_advantage_negative"],
        "optim/grad_norm": out["grad_norm"], "optim/lr": out["lr"], "optim/skipped_updates": progress["skipped_updates"],
        "time/wait_for_batch": t_wait, "time/forward_backward": out["time_fb"], "time/broadcast": t_pub,
        "time/save_ckpt": t_ckpt, "time/step": t_step,
        "perf/throughput": out["tokens"] / max(out["time_fb"], 1e-9),
        "progress/total_tokens": progress["total_tokens"], "progress/total_samples": progress["total_samples"],
        "loss_tokens": s["loss_tokens"], "micro_batches": out["micro_batches"], "perf/padding": out["padding"],
        "perf/slots_per_token": out["slots_per_token"],
    }
    m["perf/peak_memory"] = peak_memory_gib()
    return m


def peak_memory_gib() -> float:
    """Peak GPU memory, or on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB
