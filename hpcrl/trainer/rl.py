"""`hpcrl trainer`: one rank of the RL trainer.

wait for batch N on the bus -> forward/backward over packed micro-batches -> optimizer step
-> publish policy N (weights to inference + PolicyReady) -> checkpoint when due -> metrics
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from hpcrl import checkpoint, runtime
from hpcrl.bus import Bus, TrainBatch
from hpcrl.config.schema import Config
from hpcrl.fileio import refused_write
from hpcrl.monitor import progress as role_progress
from hpcrl.monitor import watchdog
from hpcrl.monitor.logging import setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.monitor.wandb_sink import start_wandb_sink
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer.checkpointer import Checkpointer
from hpcrl.trainer.context_parallel import merge_batches
from hpcrl.trainer.core import (
    Progress,
    StepResult,
    agreed_stop,
    common_metrics,
    install_stop_handler,
    step_micro_batches,
)
from hpcrl.trainer.env_stats import env_metrics
from hpcrl.trainer.layout import key_cost_of
from hpcrl.trainer.loss import LossParams
from hpcrl.trainer.packing import (
    MASKED_KERNELS,
    PackedBatch,
    attention_kernel,
    micro_batches,
    row_micro_batches,
    with_shared_prefixes,
)
from hpcrl.trainer.perf import count_params, perf_metrics
from hpcrl.trainer.publish import PolicyPublisher
from hpcrl.trainer.rl_vlm import image_token_id, split_vision
from hpcrl.trainer.samples import trainer_sample_rows
from hpcrl.trainer.setup import Training, build_training, loss_params

log = logging.getLogger("hpcrl.trainer")


def main(cfg: Config) -> int:
    setup_logging("trainer", (cfg.trainer.log or cfg.log).level)
    try:
        return _main(cfg)
    except OSError as e:  # a write the filesystem refused (disk full, not writable): one line
        if (why := refused_write(e)) is None:
            raise
        log.info("the refused write", exc_info=True)
        log.error("trainer failed: %s", why)
        return 1


def _main(cfg: Config) -> int:
    stop = install_stop_handler()  # first: a stop asked for during start-up is honoured at batch 1
    paths = RunPaths(cfg.output_dir)
    tr = start_rank(cfg, paths)
    ckpt = Checkpointer(
        cfg.ckpt,
        paths,
        tr,
        cfg.max_steps,
        parts=checkpoint.PARTS,
        finalize_timeout_s=cfg.orchestrator.policy_timeout_s,
        storage_timeout_s=cfg.storage_timeout_s,
    )
    start, progress = ckpt.restore(Progress())
    bus = Bus(paths, role="trainer", rank=tr.dist.rank, storage_timeout_s=cfg.storage_timeout_s)
    publisher = make_publisher(cfg, paths, bus, tr.dist.rank, tr.precision.compute)
    publisher.publish(tr.model, start)  # policy `start` (0 = base weights): servers verify against it
    watchdog.beat(f"published policy {start}")
    metrics = Metrics.for_run(cfg, paths, "trainer", enabled=tr.dist.rank == 0)
    # HPCRL_WANDB_WRITER=trainer: rank 0 owns the one W&B run (else a no-op handle)
    sink = start_wandb_sink(cfg, paths, "trainer") if tr.dist.rank == 0 else None
    finished = False
    params = loss_params(cfg.trainer.loss, cfg.orchestrator.algo.loss_mode)
    env_names = [
        e.name or e.id.rsplit("/", 1)[-1] for e in cfg.orchestrator.train.env
    ]  # as metrics name them
    if cfg.trainer.enable_token_export:
        from hpcrl.trainer.token_export import TokenExporter

        tr.token_export = TokenExporter.for_rank(paths, tr, params, env_names)
    perf = PerfInfo(tr.dist.world_size, count_params(tr.model), cfg.trainer.peak_tflops)
    for step in range(start + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        batch, t_wait = wait_for_batch(bus, step, tr, cfg.trainer.batch_timeout_s, stop)
        if batch is None:  # stop requested while waiting: the last finished step is the checkpoint
            if step - 1 > start:
                ckpt.maybe_save(step - 1, progress, force=True)
            summary = ckpt.stop_summary(step - 1)
            log.warning("stop requested while waiting for batch %d: %s, exiting", step, summary)
            announce_stop(bus, tr.dist.rank, summary)
            break
        out = train_step(
            tr,
            batch,
            params,
            cfg.trainer.micro_batch_tokens,
            cfg.trainer.optim.max_norm,
            share_prefix=cfg.trainer.share_prefix,
            env_names=env_names,
        )
        if metrics.samples_due(step):  # trainer.wandb.log_extras.samples: what rank 0 trained
            metrics.log_samples(step, trainer_sample_rows(batch, tr.tokenizer, step))
        t_pub = publisher.publish(tr.model, step)
        if tr.dist.rank == 0:
            bus.cleanup(before_step=step, keep=2)  # every rank has read its shard of `step` by now
        progress = progress.advance(out)
        stopping = agreed_stop(stop)  # read once: the checkpoint and the exit must agree
        t_ckpt = ckpt.maybe_save(step, progress, force=stopping)
        ckpt.maybe_save_adapter(step)
        log_step(
            metrics,
            step,
            out,
            progress,
            {
                "time/wait_for_batch": t_wait,
                "time/broadcast": t_pub,
                "time/save_ckpt": t_ckpt,
                "time/step": time.perf_counter() - t_step,
            },
            publisher.last_sync_bytes,
            perf,
        )
        watchdog.beat(f"trained and published step {step}")
        role_progress.step(step, f"trained and published step {step}")
        if stopping:
            log.warning("stop requested: %s, exiting", ckpt.stop_summary(step))
            announce_stop(bus, tr.dist.rank, ckpt.stop_summary(step))
            break
    else:
        finished = True
    ckpt.close()
    bus.close()
    metrics.close()
    if sink is not None:  # after a normal finish: wait for the orchestrator's last records too
        sink.close(wait_for_step=cfg.max_steps if finished else None)
    parallel.destroy_distributed()
    return 0


# ---------------------------------------------------------------------------------------------
def start_rank(cfg: Config, paths: RunPaths) -> Training:
    """Join the trainer group under the watchdog and build model, optimizer and scheduler."""
    denv = parallel.dist_env()
    # From here on: a rendezvous, collective or step that never returns ends the process (exit 3).
    watchdog.start(f"trainer[{denv.rank}]", cfg.watchdog_s)
    role_progress.start(f"trainer_{denv.rank}", paths.progress_dir, paths.stalls_dir, cfg.stall_warning_s)
    watchdog.beat(f"joining the trainer group ({denv.world_size} rank(s)) and loading the model")
    runtime.start_process(cfg, paths, "trainer", denv.rank, port=denv.master_port)  # before CUDA starts
    warm = cfg.ckpt.warm_start if cfg.ckpt is not None else None
    return build_training(
        cfg.trainer.model or cfg.model,
        cfg.trainer.optim,
        cfg.max_steps,
        cfg.seed + cfg.trainer.seed,
        warm_start=warm,
        dist_timeout_s=cfg.trainer.dist_timeout_seconds,
    )


def make_publisher(cfg: Config, paths: RunPaths, bus: Bus, rank: int, dtype: str) -> PolicyPublisher:
    transport = runtime.weight_transport(cfg)
    keep = cfg.orchestrator.max_async_level + 2
    group = None
    if transport == "collective":  # every trainer rank is a sender of the weight group
        from hpcrl.weights.rendezvous import num_servers, trainer_join_weight_group

        world = parallel.dist_env().world_size

        def share(address: object) -> object:
            import torch.distributed as dist

            box = [address]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            return box[0]

        group = trainer_join_weight_group(
            paths, bus, num_servers(cfg), cfg.trainer.broadcast.timeout_s, rank, world, share
        )
    b = cfg.trainer.broadcast
    return PolicyPublisher(
        paths,
        bus,
        rank,
        transport,
        keep,
        group,
        b.chunk_mb,
        dtype=dtype,
        delta=b.delta,
        full_every=b.full_every,
        sharded=b.sharded,
        shard_bucket_mb=b.bucket_mb,
        resume_lag=cfg.orchestrator.max_async_level,
        storage_timeout_s=cfg.storage_timeout_s,
    )


def announce_stop(bus: Bus, rank: int, summary: str) -> None:
    """Rank 0, stopping: tell the orchestrator on the bus that nothing more comes, so a drain that
    waits for this trainer's checkpoint (after SIGUSR2 it has no deadline of its own) ends now. Its
    checkpoint directory exists by now, so the orchestrator still writes its part first."""
    from hpcrl.bus import Shutdown

    if rank == 0:
        bus.publish_control(Shutdown(reason=f"trainer stopped: {summary}", origin="trainer"))


def wait_for_batch(
    bus: Bus, step: int, tr: Training, timeout: float, stop: threading.Event
) -> tuple[TrainBatch | None, float]:
    """Wait in short slices so a stop signal (preemption) is honoured while idle; None if stopped.
    Collective over ranks: they agree on stopping, so none is left alone in a collective. Under cp
    a rank reads every shard of its cp group and trains their union (context_parallel)."""
    ranks = tr.cp.members if tr.cp is not None else (tr.dist.rank,)
    got: dict[int, TrainBatch] = {}
    from hpcrl.bus import BusTimeout

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    while True:
        stopping = parallel.all_reduce(float(stop.is_set()), op="max") > 0
        watchdog.beat(f"waiting for batch {step}")  # waiting on the orchestrator is not a stall of ours
        role_progress.waiting(
            f"batch {step} from the orchestrator ({bus.paths.rollout_file(step, ranks[0])})", "orchestrator"
        )
        if stopping:
            return None, time.perf_counter() - t0
        try:
            for r in ranks:
                if r not in got:
                    got[r] = bus.wait_batch(step, r, timeout=min(2.0, max(0.01, deadline - time.monotonic())))
        except BusTimeout:
            if time.monotonic() >= deadline:
                raise
        # Every rank leaves together: a rank that returned while another's wait slice timed out would
        # start the step's collectives (FSDP all-gathers) against that rank's next all-reduce here.
        if parallel.all_reduce(float(len(got) < len(ranks)), op="max") == 0:
            role_progress.done()
            return merge_batches([got[r] for r in ranks]), time.perf_counter() - t0


def to_packed(
    batch: TrainBatch, device: torch.device, replay: bool = False, env_names: list[str] | None = None
) -> PackedBatch:
    """``replay``: carry the batch's routed experts (MoE router replay on a custom model);
    ``env_names``: the trainer's env order, for per-env metrics (a sample of another env gets -1)."""
    index = {n: i for i, n in enumerate(env_names or [])}

    def t(a: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if a is None else torch.as_tensor(np.asarray(a)).to(device=device, dtype=dtype)

    return PackedBatch(
        input_ids=t(batch.input_ids, torch.long),
        position_ids=t(batch.position_ids, torch.long),
        seq_lens=t(batch.seq_lens, torch.long),
        loss_mask=t(batch.loss_mask, torch.bool),
        advantages=t(batch.advantages, torch.float32),
        inference_logprobs=t(batch.inference_logprobs, torch.float32),
        temperatures=t(batch.temperatures, torch.float32),
        teacher_logprobs=t(batch.teacher_logprobs, torch.float32),
        ref_logprobs=t(batch.reference_logprobs, torch.float32),
        ce_weights=t(batch.ce_weights, torch.float32),
        routed_experts=t(batch.route_ids(), torch.long)
        if replay and batch.routed_experts is not None
        else None,
        env_index=torch.tensor([index.get(n, -1) for n in batch.env_names], dtype=torch.long)
        if env_names is not None
        else None,
    )


def train_step(
    tr: Training,
    batch: TrainBatch,
    params: LossParams,
    micro_tokens: int,
    max_norm: float,
    *,
    share_prefix: bool = True,
    env_names: list[str] | None = None,
) -> StepResult:
    """Forward/backward over this rank's micro-batches, then one (finite-checked) optimizer step."""
    t0 = time.perf_counter()
    packed = to_packed(batch, tr.device, replay=tr.router_replay, env_names=env_names)
    packed.validate()
    packed, vision = split_vision(packed, batch, image_token_id(tr.model), tr.device)  # [model.vlm]
    if vision and not packed.num_samples:  # images only: no text micro-batch
        mbs = []
    elif tr.cp is not None:  # context parallel: one packed row per micro-batch, split along time
        mbs = micro_batches(packed, micro_tokens) if packed.num_samples else []
    elif attention_kernel(tr.model) in MASKED_KERNELS:  # CPU: rows of samples, shared prefixes
        if share_prefix:
            packed = with_shared_prefixes(packed, micro_tokens, key_cost_of(tr.model.config))
        mbs = row_micro_batches(packed, micro_tokens, key_cost_of(tr.model.config))
    else:  # varlen kernels: one packed row per micro-batch, in order
        mbs = micro_batches(packed, micro_tokens) if packed.num_samples else []
    out = step_micro_batches(
        tr,
        [*mbs, *vision],
        params,
        batch.total_loss_tokens,
        max_norm,
        batch.step,
        t0,
        num_ce_tokens=batch.total_ce_tokens,
    )
    # Under cp every rank of a group holds the group's union of shards: count it once per group.
    cp = 1 if tr.cp is None else tr.cp.size
    tokens = int(parallel.all_reduce(float(len(batch.input_ids)))) // cp
    samples = int(parallel.all_reduce(float(len(batch.seq_lens)))) // cp
    kl = out.token_kl if out.token_kl is not None else torch.zeros(0)
    by_env = env_metrics(kl, out.kl_envs, out.entropies, out.entropy_envs, env_names or [])  # collective
    return replace(out.counted(tokens, samples), env=by_env)


@dataclass(frozen=True)
class PerfInfo:
    """What perf/throughput_per_gpu and perf/mfu need besides the step (hpcrl.trainer.perf)."""

    world_size: int
    num_params: int
    peak_tflops: float | None


def log_step(
    metrics: Metrics,
    step: int,
    out: StepResult,
    progress: Progress,
    times: dict[str, float],
    sync_bytes: int,
    perf: PerfInfo | None = None,
) -> None:
    extra: dict[str, Any] = {"weights/sync_bytes": sync_bytes}
    if perf is not None:
        tokens_per_s = out.tokens / max(out.time_fb, 1e-9)
        extra |= perf_metrics(tokens_per_s, perf.world_size, perf.num_params, perf.peak_tflops)
    metrics.log(step, step_metrics(out, progress, times) | extra)
    if metrics.distributions_due(step):
        metrics.log_distribution(step, "entropy", out.entropies.numpy())


def step_metrics(out: StepResult, progress: Progress, times: dict[str, float]) -> dict[str, Any]:
    s = out.stats
    return (
        common_metrics(out, progress, times["time/save_ckpt"], times["time/step"])
        | times
        | {
            "loss/mean": s["loss"],
            "masked_advantage_positive/mean": s["masked_advantage_positive"],
            "masked_advantage_negative/mean": s["masked_advantage_negative"],
            # rollout mismatch correction (hpcrl.trainer.loss): fractions of the step's loss tokens
            "mismatch/token_masked": s["token_masked_fraction"],
            "mismatch/sequence_masked": s["seq_masked_fraction"],
            "mismatch/tis_truncated": s["tis_truncated_fraction"],
            "progress/total_tokens": progress.total_tokens,
            "progress/total_samples": progress.total_samples,
            "loss_tokens": s["loss_tokens"],
            **out.moe,
            **out.env,
            "optim/zero_grad_ratio": out.zero_grad_ratio,
            "perf/slots_per_token": out.slots_per_token,
        }
        | _ce_metrics(s)
    )


def _ce_metrics(s: dict[str, float]) -> dict[str, float]:
    """echo's cross entropy on env-provided tokens (hpcrl.trainer.loss.ce_loss), in steps that have it."""
    if not s.get("ce_tokens"):
        return {}
    return {"loss/ce": s["ce_loss"], "loss/ce_nll": s["ce_nll"], "ce_tokens": s["ce_tokens"]}
