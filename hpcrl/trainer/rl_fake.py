"""`hpcrl trainer` with [trainer.data.fake] (prime-rl's FakeDataLoader): the RL trainer alone, on made-up
batches, to measure it. No orchestrator, no bus, no weight broadcast, no checkpoint: each step trains
this rank's rows of seeded random tokens with the real model, loss and optimizer, and logs the step's
metrics (loss, throughput, MFU, memory) to metrics.jsonl like a real run (and to W&B with [wandb]:
alone, the trainer owns the W&B run).

make this rank's batch N (a pure function of seed, step, rank) -> forward/backward + optimizer step
-> metrics
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np

from hpcrl.bus import TrainBatch
from hpcrl.config.schema import Config
from hpcrl.monitor import watchdog
from hpcrl.monitor.logging import setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.monitor.wandb_sink import WRITER_ENV, start_wandb_sink
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer.core import Progress, agreed_stop, install_stop_handler
from hpcrl.trainer.perf import count_params
from hpcrl.trainer.rl import PerfInfo, log_step, start_rank, train_step
from hpcrl.trainer.setup import loss_params

log = logging.getLogger("hpcrl.trainer")
ENV = "fake"


def rows_of_rank(batch_size: int, rank: int, world: int) -> int:
    """prime-rl's batch_size is over all data-parallel ranks: rank r trains its share (the first
    batch_size % world ranks one more)."""
    q, r = divmod(batch_size, world)
    return q + (1 if rank < r else 0)


def sample_lengths(rng: np.random.Generator, seq_len: int, generate_samples: bool) -> list[int]:
    """One row: a single sample of seq_len tokens, or (generate_samples) samples of random lengths in
    [1, seq_len / 8) packed until the row holds seq_len tokens (the last one cut to fit)."""
    if not generate_samples:
        return [seq_len]
    out: list[int] = []
    top = max(2, seq_len // 8)
    while (left := seq_len - sum(out)) > 0:
        out.append(min(int(rng.integers(1, top)), left))
    return out


def fake_batch(
    step: int, rank: int, world: int, rows: int, seq_len: int, vocab: int, generate_samples: bool, seed: int
) -> TrainBatch:
    """This rank's batch of `step`: `rows` rows of seq_len uniform random token ids. Every token but a
    sample's first is trained; advantages are standard normal per token (prime-rl's); the sampler's
    logprobs are a uniform sampler's, -log(vocab), so the importance ratio starts near 1 for an
    untrained model. `total_loss_tokens` is this rank's count (the caller sums it over ranks)."""
    rng = np.random.default_rng([seed, step, rank])
    lens = [n for _ in range(rows) for n in sample_lengths(rng, seq_len, generate_samples)]
    t = sum(lens)
    starts = np.cumsum([0] + lens[:-1])
    position_ids = np.arange(t) - np.repeat(starts, lens)
    loss_mask = position_ids > 0
    logp = np.where(loss_mask, -math.log(vocab), 0.0)
    n = len(lens)
    return TrainBatch(
        step=step,
        rank=rank,
        world_size=world,
        input_ids=rng.integers(0, vocab, size=t),
        position_ids=position_ids,
        seq_lens=np.asarray(lens),
        loss_mask=loss_mask,
        advantages=np.where(loss_mask, rng.standard_normal(t), 0.0),
        inference_logprobs=logp,
        policy_versions=np.full(n, step - 1),
        temperatures=np.ones(n),
        env_names=[ENV] * n,
        example_ids=np.arange(n) + (step * world + rank) * n,
        rewards=np.zeros(n),
        total_loss_tokens=int(loss_mask.sum()),
    )


def main(cfg: Config) -> int:
    setup_logging("trainer", (cfg.trainer.log or cfg.log).level)
    fake = cfg.trainer.data.fake
    assert fake is not None, "rl_fake.main runs with [trainer.data.fake]"
    stop = install_stop_handler()
    paths = RunPaths(cfg.output_dir)
    tr = start_rank(cfg, paths)
    rank, world = tr.dist.rank, tr.dist.world_size
    rows = rows_of_rank(fake.batch_size, rank, world)
    if rows == 0:
        raise ValueError(
            f"trainer.data.fake.batch_size = {fake.batch_size} is below the {world} trainer ranks: every "
            "rank needs a row"
        )
    vocab = int(tr.model.config.vocab_size)
    metrics = Metrics.for_run(cfg, paths, "trainer", enabled=rank == 0)
    os.environ[WRITER_ENV] = "trainer"  # alone: the trainer owns the W&B run ([wandb] / --wandb)
    sink = start_wandb_sink(cfg, paths, "trainer") if rank == 0 else None
    params = loss_params(cfg.trainer.loss, "rl")  # made-up advantages; no reference logprobs (prime-rl's)
    perf = PerfInfo(world, count_params(tr.model), cfg.trainer.peak_tflops)
    progress = Progress()
    log.info(
        "fake data: %d row(s) of %d tokens per rank per step (%s), no orchestrator, no weight broadcast",
        rows,
        cfg.seq_len,
        "packed samples" if fake.generate_samples else "one sample per row",
    )
    for step in range(1, cfg.max_steps + 1):
        if agreed_stop(stop):
            log.warning("stop requested: exiting after step %d", step - 1)
            break
        t_step = time.perf_counter()
        seed = cfg.seed + cfg.trainer.seed
        batch = fake_batch(step, rank, world, rows, cfg.seq_len, vocab, fake.generate_samples, seed)
        batch.total_loss_tokens = int(parallel.all_reduce(float(batch.total_loss_tokens)))
        out = train_step(
            tr,
            batch,
            params,
            cfg.trainer.micro_batch_tokens,
            cfg.trainer.optim.max_norm,
            share_prefix=cfg.trainer.share_prefix,
            env_names=[ENV],
        )
        progress = progress.advance(out)
        times = {"time/wait_for_batch": 0.0, "time/broadcast": 0.0, "time/save_ckpt": 0.0}
        log_step(metrics, step, out, progress, times | {"time/step": time.perf_counter() - t_step}, 0, perf)
        watchdog.beat(f"trained fake step {step}")
    metrics.close()
    if sink is not None:
        sink.close()
    parallel.destroy_distributed()
    return 0
