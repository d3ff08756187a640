"""`hpcrl sft`: supervised fine-tuning on a local dataset, with the RL trainer's model, FSDP,
optimizer step, checkpoints and weights layout (so SFT -> RL -> SFT needs no conversion).

    next batch_size rows (seeded epochs) -> this rank's share -> chat-template tokens + role masks
    -> pack into rows of <= seq_len -> forward/backward (loss mode "sft") -> optimizer step
    -> validation loss when due -> checkpoint when due -> metrics

Multi-rank: started under torchrun/srun (RANK/WORLD_SIZE or SLURM_* set) every process is one rank;
otherwise `deployment.num_trainer_ranks` > 1 (or several visible GPUs) makes this process spawn the
ranks on this machine and supervise them. Rows of a step go to ranks by stride (row j of the step to
rank j % world), so the split is deterministic and a resume on the same world size sees the same rows.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hpcrl import checkpoint
from hpcrl.config.schema import SFTConfig
from hpcrl.monitor.logging import setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer import sft_data as sd
from hpcrl.trainer.loss import LossParams
from hpcrl.trainer.packing import PackedBatch, dummy_micro_batch, forward_packed, split_micro_batches
from hpcrl.trainer.rl import (
    install_stop_handler,
    maybe_save_adapter,
    peak_memory_gib,
    restore_state,
    save_checkpoint,
    step_micro_batches,
)
from hpcrl.trainer.setup import Training, build_training

log = logging.getLogger("hpcrl.trainer")

CHILD_ENV = "HPCRL_SFT_CHILD"  # set on ranks this process spawned: they skip output-dir preparation
SFT_PARTS = ("trainer",)  # an SFT checkpoint has no orchestrator part
FINALIZE_TIMEOUT_S = 600.0


def main(cfg: SFTConfig) -> int:
    try:
        ranks = requested_ranks(cfg)
        if ranks > 1 and not launched_as_rank():
            setup_logging("sft", cfg.log.level)
            return launch_ranks(cfg, prepare(cfg), ranks)
        return train(cfg)
    except (ValueError, checkpoint.CheckpointError) as e:
        # User errors (data, template, resume step): one line, exit 2, as for config errors.
        log.debug("sft failed", exc_info=True)
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 2


def train(cfg: SFTConfig) -> int:
    paths = RunPaths(cfg.output_dir) if os.environ.get(CHILD_ENV) else prepare(cfg)
    if not launched_as_rank() and "MASTER_PORT" not in os.environ:
        # A lone rank still opens a (gloo/nccl) group: take a free port, not the fixed default that
        # another job on this machine may hold.
        from hpcrl.launch.local import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    env = parallel.dist_env()
    role = "sft" if env.world_size == 1 else f"sft[{env.rank}]"
    log_file = paths.log_file("trainer") if env.rank == 0 else paths.rank_log_file("trainer", env.rank)
    setup_logging(role, cfg.log.level, log_file=log_file)
    data = SFTData.from_config(cfg)  # before the model: a bad dataset fails in a second, not a minute
    warm = cfg.ckpt.warm_start if cfg.ckpt is not None else None
    tr = build_training(cfg.model, cfg.optim, cfg.max_steps, cfg.seed, warm_start=warm)
    data.tokenizer = tr.tokenizer
    start, progress = restore_state(cfg.ckpt, paths, tr, initial_progress(data.cursor))
    data.cursor.restore(progress["data"])
    rank, world = tr.dist.rank, tr.dist.world_size
    log.info("sft: %d training rows (%s), %d validation rows, steps %d..%d, %d rank(s)", len(data.train),
             data.train.source, len(data.val), start + 1, cfg.max_steps, world)
    metrics = Metrics(paths, "trainer", enabled=rank == 0)
    params = LossParams(mode="sft")
    stop = install_stop_handler()
    finalizers: list[threading.Thread] = []
    for step in range(start + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        batch = data.next_batch(rank, world, tr.device)
        out = step_micro_batches(tr, batch.micro_batches, params, batch.totals["loss_tokens"],
                                 cfg.optim.max_norm, step, time.perf_counter())
        progress = advance(progress, batch, out, data.cursor)
        val_loss, t_val = maybe_validate(cfg, data, tr, step)
        # The val loss is all-reduced: every rank reaches the same decision.
        reached = cfg.val.stop_at_loss > 0 and val_loss is not None and val_loss <= cfg.val.stop_at_loss
        t_ckpt = 0.0
        if cfg.ckpt is not None and (stop.is_set() or reached or checkpoint.is_due(step, cfg.max_steps, cfg.ckpt.interval)):
            t_ckpt = save_checkpoint(cfg.ckpt, paths, tr, step, progress, finalizers, SFT_PARTS, FINALIZE_TIMEOUT_S)
        maybe_save_adapter(cfg.ckpt, paths, tr, step, cfg.max_steps)
        m = metrics.log(step, step_metrics(out, batch, progress, data, val_loss, t_val, t_ckpt,
                                           time.perf_counter() - t_step))
        if rank == 0 and (step % cfg.log.console_interval == 0 or step == cfg.max_steps):
            log.info("step %d | loss %.4f%s | lr %.2e | grad norm %.3f | %.0f tok/s | epoch %.2f", step,
                     m["loss/mean"], "" if val_loss is None else f" | val {val_loss:.4f}", m["optim/lr"],
                     m["optim/grad_norm"], m["perf/throughput"], m["progress/epoch"])
        if stop.is_set():
            log.warning("stop requested: checkpointed step %d, exiting", step)
            break
        if reached:
            log.info("val loss %.4f <= val.stop_at_loss %g at step %d: done", val_loss, cfg.val.stop_at_loss, step)
            break
    for f in finalizers:
        f.join()
    metrics.close()
    parallel.destroy_distributed()
    return 0


def prepare(cfg: SFTConfig) -> RunPaths:
    from hpcrl.launch.prepare import prepare_output_dir

    return prepare_output_dir(cfg)


# ---------------------------------------------------------------------------------------------
# data for the loop
# ---------------------------------------------------------------------------------------------
@dataclass
class StepBatch:
    micro_batches: list[PackedBatch]
    totals: dict[str, int]  # summed over ranks: loss_tokens, tokens, samples, truncated, dropped
    packing_waste: float  # this rank's rows if padded to seq_len (we never pad; see docs/trainer.md)


@dataclass
class SFTData:
    train: sd.Rows
    val: sd.Rows
    cursor: sd.DataCursor
    role_mask: dict[str, bool]
    seq_len: int
    micro_tokens: int
    batch_size: int
    template_defaults: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    _val_cache: list[sd.TokenizedSample] | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> SFTData:
        rows = sd.load_rows(cfg.data.name, cfg.data.split, "data.name")
        val = sd.Rows([], source="")
        if cfg.val.interval > 0:
            if cfg.val.data is not None:
                val = sd.load_rows(cfg.val.data.name, cfg.val.data.split, "val.data.name")
            else:
                keep, held = sd.holdout_split(len(rows), cfg.val.fraction, cfg.data.seed)
                rows, val = rows.subset(keep), rows.subset(held)
            if len(val) == 0:
                raise ValueError("val: validation is on (val.interval > 0) but there are no validation rows; "
                                 "set val.fraction > 0 or val.data")
        if len(rows) == 0:
            raise ValueError(f"data.name: '{cfg.data.name}' has no rows")
        mask = {r: bool(getattr(cfg.loss_mask, r)) for r in sd.ROLES}
        if not any(mask.values()):
            raise ValueError("loss_mask: every role is off, nothing would be trained")
        cursor = sd.DataCursor(len(rows), cfg.data.seed, cfg.data.shuffle)
        switches = {"enable_thinking": cfg.data.enable_thinking, "reasoning_effort": cfg.data.reasoning_effort}
        return cls(rows, val, cursor, mask, cfg.data.seq_len or cfg.seq_len, cfg.micro_batch_tokens,
                   cfg.data.batch_size, {k: v for k, v in switches.items() if v is not None})

    def sample(self, rows: sd.Rows, i: int, where: str) -> sd.TokenizedSample:
        conv = sd.row_to_conversation(rows[i], where, self.template_defaults)
        return sd.truncate(sd.tokenize_conversation(self.tokenizer, conv, self.role_mask, where), self.seq_len)

    def next_batch(self, rank: int, world: int, device: torch.device) -> StepBatch:
        idx = self.cursor.take(self.batch_size)
        mine = [self.sample(self.train, int(i), f"{self.train.source} row {int(i)}") for i in idx[rank::world]]
        return self._batch(mine, device)

    def val_batch(self, rank: int, world: int, device: torch.device) -> StepBatch:
        if self._val_cache is None:  # the validation set is fixed: tokenize it once
            self._val_cache = [self.sample(self.val, i, f"{self.val.source or 'val'} row {i}")
                               for i in range(rank, len(self.val), world)]
        return self._batch(self._val_cache, device)

    def _batch(self, samples: list[sd.TokenizedSample], device: torch.device) -> StepBatch:
        kept = [s for s in samples if s.loss_mask.any()]  # nothing to learn (e.g. truncated away)
        mbs, waste = micro_batches_for(kept, self.seq_len, self.micro_tokens, device)
        local = [sum(int(s.loss_mask.sum()) for s in kept), sum(len(s) for s in kept), len(kept),
                 sum(s.truncated for s in samples), len(samples) - len(kept)]
        summed = parallel.all_reduce(torch.tensor(local, dtype=torch.float64))
        keys = ("loss_tokens", "tokens", "samples", "truncated", "dropped")
        return StepBatch(mbs, {k: int(v) for k, v in zip(keys, summed.tolist())}, waste)


def micro_batches_for(samples: list[sd.TokenizedSample], seq_len: int, micro_tokens: int,
                      device: torch.device) -> tuple[list[PackedBatch], float]:
    """Pack samples into rows of <= seq_len (first-fit decreasing); a micro-batch is a run of whole
    rows of <= max(micro_tokens, seq_len) tokens, forwarded by forward_packed (one packed row on
    varlen kernels, rows of samples on CPU), so no sample attends to another."""
    if not samples:
        return [], 0.0
    lengths = [len(s) for s in samples]
    rows = sd.pack_rows(lengths, seq_len)
    order = [i for r in rows for i in r]
    seq_lens = torch.tensor([lengths[i] for i in order], dtype=torch.long)
    packed = PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([samples[i].input_ids for i in order]).astype(np.int64)),
        position_ids=torch.cat([torch.arange(lengths[i]) for i in order]),
        seq_lens=seq_lens,
        loss_mask=torch.from_numpy(np.concatenate([samples[i].loss_mask for i in order])),
    ).to(device)
    packed.validate()
    row_lens = [sum(lengths[i] for i in r) for r in rows]
    first_sample = np.cumsum([0] + [len(r) for r in rows])  # index (in `order`) of each row's first sample
    mbs = [packed.slice_samples(int(first_sample[a]), int(first_sample[b]))
           for a, b in split_micro_batches(row_lens, max(micro_tokens, seq_len))]
    return mbs, sd.padding_waste(lengths, rows, seq_len)


# ---------------------------------------------------------------------------------------------
# validation, progress, metrics
# ---------------------------------------------------------------------------------------------
def maybe_validate(cfg: SFTConfig, data: SFTData, tr: Training, step: int) -> tuple[float | None, float]:
    if cfg.val.interval == 0 or step % cfg.val.interval != 0:
        return None, 0.0
    t0 = time.perf_counter()
    return validation_loss(tr, data), time.perf_counter() - t0


@torch.no_grad()
def validation_loss(tr: Training, data: SFTData) -> float:
    """Mean token cross-entropy over the whole validation set (all ranks), without a gradient."""
    batch = data.val_batch(tr.dist.rank, tr.dist.world_size, tr.device)
    mbs = list(batch.micro_batches)
    n_mb = int(parallel.all_reduce(float(len(mbs)), op="max"))  # FSDP: same number of forwards everywhere
    mbs += [dummy_micro_batch(tr.device) for _ in range(n_mb - len(mbs))]
    total = torch.zeros((), dtype=torch.float64)
    tr.model.eval()
    try:
        for mb in mbs:
            lp = forward_packed(tr.model, mb, compute_entropy=False, wanted=mb.loss_mask).logprobs
            total += -torch.where(mb.loss_mask, lp, torch.zeros_like(lp)).sum().double().cpu()
    finally:
        tr.model.train()
    return float(parallel.all_reduce(total)) / max(batch.totals["loss_tokens"], 1)


def initial_progress(cursor: sd.DataCursor) -> dict[str, Any]:
    return {"step": 0, "num_samples": 0, "num_tokens": 0, "num_truncated": 0, "skipped_updates": 0,
            "data": cursor.state()}


def advance(progress: dict[str, Any], batch: StepBatch, out: dict[str, Any], cursor: sd.DataCursor
            ) -> dict[str, Any]:
    """The progress dict saved with a checkpoint; `data` is the cursor AFTER this step's rows, so a
    resume continues with exactly the next ones (the epoch order is a pure function of seed+epoch)."""
    t = batch.totals
    return {**progress, "step": progress["step"] + 1, "num_samples": progress["num_samples"] + t["samples"],
            "num_tokens": progress["num_tokens"] + t["tokens"],
            "num_truncated": progress["num_truncated"] + t["truncated"],
            "skipped_updates": progress["skipped_updates"] + int(out["skipped"]), "data": cursor.state()}


def step_metrics(out: dict[str, Any], batch: StepBatch, progress: dict[str, Any], data: SFTData,
                 val_loss: float | None, t_val: float, t_ckpt: float, t_step: float) -> dict[str, Any]:
    t = batch.totals
    m: dict[str, Any] = {
        "loss/mean": out["stats"]["loss"],
        "progress/epoch": data.cursor.epochs_done,
        "progress/num_samples": progress["num_samples"], "progress/num_tokens": progress["num_tokens"],
        "optim/grad_norm": out["grad_norm"], "optim/lr": out["lr"],
        "optim/skipped_updates": progress["skipped_updates"],
        "perf/throughput": t["tokens"] / max(out["time_fb"], 1e-9), "perf/peak_memory": peak_memory_gib(),
        "time/step": t_step, "time/forward_backward": out["time_fb"], "time/save_ckpt": t_ckpt,
        "data/truncated": t["truncated"], "data/dropped": t["dropped"], "data/packing_waste": batch.packing_waste,
        "loss_tokens": t["loss_tokens"], "micro_batches": out["micro_batches"], "perf/padding": out["padding"],
    }
    if val_loss is not None:
        m["val/loss"], m["time/val"] = val_loss, t_val
    return m


# ---------------------------------------------------------------------------------------------
# ranks on this machine
# ---------------------------------------------------------------------------------------------
def requested_ranks(cfg: SFTConfig) -> int:
    d = cfg.deployment
    if d.num_trainer_ranks:
        return d.num_trainer_ranks
    if d.num_train_gpus:
        return d.num_train_gpus
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def launched_as_rank() -> bool:
    """torchrun, srun with several tasks, or our own spawner already set up the ranks."""
    return "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def launch_ranks(cfg: SFTConfig, paths: RunPaths, n: int) -> int:
    """Start n ranks of `hpcrl sft` on the resolved config and wait; when one fails, stop the rest."""
    from hpcrl.launch.local import free_port

    base = {**os.environ, CHILD_ENV: "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    if not torch.cuda.is_available():
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [sys.executable, "-m", "hpcrl.cli", "sft", "@", str(paths.configs_dir / "sft.toml")]
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]

    def forward(signum, _frame):  # SLURM's pre-timeout signal: every rank checkpoints and stops
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, forward)
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            code = failed[0].returncode
            log.error("sft rank %d exited with %d: stopping the others", procs.index(failed[0]), code)
            _stop(procs)
            break
        time.sleep(0.2)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
