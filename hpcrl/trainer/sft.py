"""`hpcrl sft`: supervised fine-tuning on a local dataset, with the RL trainer's model, FSDP,
optimizer step, checkpoints and weights layout (so SFT -> RL -> SFT needs no conversion).

    next batch_size rows (seeded epochs) -> this rank's share -> chat-template tokens + role masks
    -> pack into rows of <= seq_len -> forward/backward (loss mode "sft") -> optimizer step
    -> validation loss when due -> checkpoint when due -> metrics

Multi-rank: started under torchrun/srun (RANK/WORLD_SIZE or SLURM_* set) every process is one rank;
otherwise `deployment.num_trainer_ranks` > 1 (or several visible GPUs) makes `hpcrl sft` spawn the
ranks on this machine and supervise them (hpcrl.launch.sft, the launcher that calls `train`). Rows of a step go to ranks by
stride (row j of the step to rank j % world), so the split is deterministic and a resume on the same
world size sees the same rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hpcrl.config.schema import SFTConfig
from hpcrl.monitor import progress as role_progress
from hpcrl.monitor import watchdog
from hpcrl.monitor.logging import setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.monitor.wandb_sink import start_wandb_sink
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer import sft_data as sd
from hpcrl.trainer.checkpointer import Checkpointer
from hpcrl.trainer.context_parallel import restrict
from hpcrl.trainer.core import (
    Progress,
    StepResult,
    agreed_stop,
    common_metrics,
    forward_for,
    install_stop_handler,
    step_micro_batches,
)
from hpcrl.trainer.loss import LossParams
from hpcrl.trainer.packing import PackedBatch, dummy_micro_batch, split_micro_batches
from hpcrl.trainer.perf import count_params, perf_metrics
from hpcrl.trainer.setup import Training, build_training

log = logging.getLogger("hpcrl.trainer")

SFT_PARTS = ("trainer",)  # an SFT checkpoint has no orchestrator part
FINALIZE_TIMEOUT_S = 600.0


def train(cfg: SFTConfig, paths: RunPaths) -> int:
    """One rank's SFT loop; `paths`: the run directory its launcher prepared (hpcrl.launch.sft)."""
    from hpcrl.storage import WriteRefused

    try:
        return _train(cfg, paths)
    except WriteRefused as e:  # storage refused past storage_timeout_s (hpcrl.storage): one line
        log.error("sft trainer failed: %s", e)
        return 1


def _train(cfg: SFTConfig, paths: RunPaths) -> int:
    stop = install_stop_handler()  # first: a stop asked for during start-up is honoured after step 1
    tr, data = start_rank(cfg, paths)
    ckpt = Checkpointer(
        cfg.ckpt,
        paths,
        tr,
        cfg.max_steps,
        parts=SFT_PARTS,
        finalize_timeout_s=FINALIZE_TIMEOUT_S,
        storage_timeout_s=cfg.storage_timeout_s,
        role="sft trainer",
    )
    start, progress = ckpt.restore(Progress(data=data.cursor.state()))
    if progress.data is not None:
        data.cursor.restore(progress.data)
    rank, world = tr.dist.rank, tr.dist.world_size
    share = data_share(tr)
    log.info(
        "sft: %d training rows (%s), %d validation rows, steps %d..%d, %d rank(s)",
        len(data.train),
        data.train.source,
        len(data.val),
        start + 1,
        cfg.max_steps,
        world,
    )
    metrics = Metrics.for_run(cfg, paths, "trainer", enabled=rank == 0)
    sink = start_wandb_sink(cfg, paths, "trainer") if rank == 0 else None  # --wandb: one W&B run
    params = LossParams(mode="sft")
    num_params = count_params(tr.model)
    evals = online_evals(cfg, paths, rank, start, tr)  # [eval]: the starting weights first
    stopping = False
    for step in range(start + 1, cfg.max_steps + 1):
        t_step = time.perf_counter()
        batch = data.next_batch(share[0], share[1], tr.device, copies=share[2])
        out = step_micro_batches(
            tr,
            batch.micro_batches,
            params,
            batch.totals["loss_tokens"],
            cfg.optim.max_norm,
            step,
            time.perf_counter(),
        )
        out = out.counted(batch.totals["tokens"], batch.totals["samples"])
        progress = progress.advance(out, truncated=batch.totals["truncated"], data=data.cursor.state())
        role_progress.step(step, f"trained step {step}")
        watchdog.beat(f"trained step {step}")
        val_loss, t_val = maybe_validate(cfg, data, tr, step)
        # The val loss is all-reduced: every rank reaches the same decision.
        reached = cfg.val.stop_at_loss > 0 and val_loss is not None and val_loss <= cfg.val.stop_at_loss
        if evals is not None and evals.check_failed():  # rank 0's: ends the run as a stop request does
            stop.set()
        stopping = agreed_stop(stop)  # read once: the checkpoint and the exit must agree
        t_ckpt = ckpt.maybe_save(step, progress, force=stopping or reached)
        ckpt.maybe_save_adapter(step)
        if evals is not None:
            evals.maybe_start(tr, step)
        m = metrics.log(
            step,
            step_metrics(out, batch, progress, data, val_loss, t_val, t_ckpt, time.perf_counter() - t_step)
            | perf_metrics(out.tokens / max(out.time_fb, 1e-9), world, num_params, cfg.peak_tflops),
        )
        log_console(cfg, rank, step, m, val_loss)
        if stopping:
            why = "an online eval failed" if evals is not None and evals.error else "stop requested"
            log.warning("%s: %s, exiting", why, ckpt.stop_summary(step))
            break
        if reached:
            log.info(
                "val loss %.4f <= val.stop_at_loss %g at step %d: done", val_loss, cfg.val.stop_at_loss, step
            )
            break
    watchdog.stop()  # the steps are over: the checkpoint's finaliser and the evals have their own bounds
    ckpt.close()
    if evals is not None:
        evals.close(stopping)
    metrics.close()
    if sink is not None:
        sink.close(wait_for_step=progress.step)
    parallel.destroy_distributed()
    if evals is not None and evals.error:  # the last line: the run failed because its eval did
        log.error("sft: %s", evals.error)
        return 1
    return 0


def online_evals(cfg: SFTConfig, paths: RunPaths, rank: int, start: int, tr: Training) -> Any:
    """[eval]: prime-rl's online evaluation (hpcrl.trainer.sft_eval), its step-`start` one started."""
    if cfg.eval is None:
        return None
    from hpcrl.trainer.sft_eval import OnlineEvals

    evals = OnlineEvals(cfg, paths, rank, start)
    evals.maybe_start(tr, start)
    return evals


def data_share(tr: Training) -> tuple[int, int, int]:
    """(share, shares, copies): which slice of each batch this rank reads. Under cp the ranks of a cp
    group read the same rows (each trains its time slice of them), so there are world / cp shares and
    the rank-summed totals count every row cp times."""
    if tr.cp is None:
        return tr.dist.rank, tr.dist.world_size, 1
    return tr.dist.rank // tr.cp.size, tr.dist.world_size // tr.cp.size, tr.cp.size


def start_rank(cfg: SFTConfig, paths: RunPaths) -> tuple[Training, SFTData]:
    """Logging, process group, dataset (before the model: a bad dataset fails in a second, not a
    minute), then model, optimizer and scheduler."""
    env = parallel.dist_env()
    role = "sft" if env.world_size == 1 else f"sft[{env.rank}]"
    log_file = paths.log_file("trainer") if env.rank == 0 else paths.rank_log_file("trainer", env.rank)
    setup_logging(role, cfg.log.level, log_file=log_file)
    # logs/progress/trainer_<rank>.json, refreshed by a thread: `hpcrl status` names a frozen rank
    # ("unresponsive") as it names a frozen RL role; a stall is named in the log (hpcrl.monitor.progress)
    role_progress.start(f"trainer_{env.rank}", paths.progress_dir, paths.stalls_dir, cfg.stall_warning_s)
    # a rank that stops moving (a hung collective, a frozen process) ends itself past watchdog_s, as an
    # RL trainer does: the run ends in one line instead of waiting forever (hpcrl.monitor.watchdog)
    watchdog.start(role, cfg.watchdog_s)
    watchdog.beat("loading the data and the model")
    data = SFTData.from_config(cfg)
    warm = cfg.ckpt.warm_start if cfg.ckpt is not None else None
    tr = build_training(
        cfg.model,
        cfg.optim,
        cfg.max_steps,
        cfg.seed,
        warm_start=warm,
        dist_timeout_s=cfg.dist_timeout_seconds,
    )
    data.tokenizer = tr.tokenizer
    data.renderer = sft_renderers(cfg, tr.tokenizer)
    if cfg.model.vlm is not None:  # images: hpcrl.trainer.sft_vlm
        data.vision = sft_vision(cfg, tr)
        if data.renderer is not None:
            log.info("model.vlm: samples render through the tokenizer's chat template, not a typed renderer")
            data.renderer = None
    return tr, data


def sft_vision(cfg: SFTConfig, tr: Training) -> Any:
    """[model.vlm]: the image processor and image token the samples are built with (saved with
    every weights export, beside the tokenizer)."""
    from hpcrl.trainer.sft_data import locate_rows
    from hpcrl.trainer.sft_vlm import VisionData

    local = locate_rows(cfg.data.name, "data.name")[1] if cfg.data.type == "sft" else None
    base = None if local is None else (local if local.is_dir() else local.parent)
    vision = VisionData(tr.model_path, tr.tokenizer, base, cfg.model.trust_remote_code)
    tr.tokenizer.hpcrl_image_processor = vision.processor
    return vision


def sft_renderers(cfg: SFTConfig, tokenizer: Any) -> Any:
    """[renderer] -> the renderers the SFT samples are built with, or None for the tokenizer's own
    template (hpcrl's incremental rendering, which refuses templates that rewrite history)."""
    from hpcrl.render.select import typed_renderers

    return typed_renderers(tokenizer, cfg.renderer, cfg.model.name or "", "renderer")


def log_console(cfg: SFTConfig, rank: int, step: int, m: dict[str, Any], val_loss: float | None) -> None:
    if rank == 0 and (step % cfg.log.console_interval == 0 or step == cfg.max_steps):
        log.info(
            "step %d | loss %.4f%s | lr %.2e | grad norm %.3f | %.0f tok/s | epoch %.2f",
            step,
            m["loss/mean"],
            "" if val_loss is None else f" | val {val_loss:.4f}",
            m["optim/lr"],
            m["optim/grad_norm"],
            m["perf/throughput"],
            m["progress/epoch"],
        )


# ---------------------------------------------------------------------------------------------
# data for the loop
# ---------------------------------------------------------------------------------------------
@dataclass
class StepBatch:
    micro_batches: list[PackedBatch]
    totals: dict[str, int]  # summed over ranks: loss_tokens, tokens, samples, truncated, dropped
    packing_waste: float  # this rank's rows if padded to seq_len (we never pad; see docs/trainer.md)
    subset_ratios: dict[str, float] = field(default_factory=dict)  # progress/<subset>/ratio_*


@dataclass
class SFTData:
    train: sd.Rows
    val: sd.Rows
    cursor: sd.DataCursor
    role_mask: dict[str, bool]
    seq_len: int
    micro_tokens: int
    batch_size: int
    batch_unit: str = "samples"  # data.batch_unit: what batch_size counts
    template_defaults: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    renderer: Any = (
        None  # hpcrl.orchestrator.renderer_client.Renderers for a typed [renderer]; None: the template
    )
    fake: dict[str, Any] | None = (
        None  # data.type = fake: (length, input_ids, seed) of hpcrl.trainer.sft_fake
    )
    vision: Any = None  # [model.vlm]: hpcrl.trainer.sft_vlm.VisionData
    _val_cache: list[sd.TokenizedSample] | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> SFTData:
        fake = cfg.data.type == "fake"
        if fake:
            from hpcrl.trainer.sft_fake import fake_rows

            rows = fake_rows()
        else:
            rows = sd.load_rows(cfg.data.name, cfg.data.split, "data.name")
        val = sd.Rows([], source="")
        if cfg.val.interval > 0:
            if cfg.val.data is not None:
                val = sd.load_rows(cfg.val.data.name, cfg.val.data.split, "val.data.name")
            else:
                keep, held = sd.holdout_split(len(rows), cfg.val.fraction, cfg.data.seed)
                rows, val = rows.subset(keep), rows.subset(held)
            if len(val) == 0:
                raise ValueError(
                    "val: validation is on (val.interval > 0) but there are no validation rows; "
                    "set val.fraction > 0 or val.data"
                )
        if len(rows) == 0:
            raise ValueError(f"data.name: '{cfg.data.name}' has no rows")
        mask = {r: bool(getattr(cfg.loss_mask, r)) for r in sd.ROLES}
        if not any(mask.values()):
            raise ValueError("loss_mask: every role is off, nothing would be trained")
        cursor = sd.DataCursor(len(rows), cfg.data.seed, cfg.data.shuffle and not fake)
        switches = {
            "enable_thinking": cfg.data.enable_thinking,
            "reasoning_effort": cfg.data.reasoning_effort,
        }
        return cls(
            rows,
            val,
            cursor,
            mask,
            cfg.data.seq_len or cfg.seq_len,
            cfg.micro_batch_tokens,
            cfg.data.batch_size,
            cfg.data.batch_unit,
            {k: v for k, v in switches.items() if v is not None},
            fake={"length": cfg.data.length, "input_ids": cfg.data.input_ids, "seed": cfg.data.seed}
            if fake
            else None,
        )

    def sample(self, rows: sd.Rows, i: int, where: str) -> sd.TokenizedSample:
        if self.fake is not None:
            from hpcrl.trainer.sft_fake import fake_sample

            return fake_sample(int(rows[i]), self.seq_len, len(self.tokenizer), **self.fake)
        conv = sd.row_to_conversation(rows[i], where, self.template_defaults)
        if self.vision is not None:  # image parts -> placeholders + pixel tensors
            return self.vision.sample(conv, self.role_mask, self.seq_len, where)
        if (
            self.renderer is not None
        ):  # a typed renderer: its training-sample builder (hpcrl.trainer.sft_render)
            from hpcrl.trainer.sft_render import tokenize_with_renderer

            renderer = self.renderer.get(conv.template_kwargs)
            return sd.truncate(tokenize_with_renderer(renderer, conv, self.role_mask), self.seq_len)
        return sd.truncate(
            sd.tokenize_conversation(self.tokenizer, conv, self.role_mask, where), self.seq_len
        )

    def next_batch(self, rank: int, world: int, device: torch.device, copies: int = 1) -> StepBatch:
        """Share ``rank`` of ``world`` of the next batch_size rows; ``copies``: ranks reading each
        share (cp), whose rank-summed totals count it that many times."""
        if self.batch_unit == "tokens":
            rows = self._token_budget_rows()[rank::world]
            mine = [s for _, s in rows]
            return self._batch(mine, device, copies, [self.train.subset_of(i) for i, _ in rows])
        idx = self.cursor.take(self.batch_size)
        mine = [
            self.sample(self.train, int(i), f"{self.train.source} row {int(i)}") for i in idx[rank::world]
        ]
        return self._batch(mine, device, copies, [self.train.subset_of(int(i)) for i in idx[rank::world]])

    def _token_budget_rows(self) -> list[tuple[int, sd.TokenizedSample]]:
        """data.batch_unit = tokens: the next rows until their tokens (after truncation to seq_len)
        reach batch_size, at least one. Every rank tokenizes every row of the step (the same rows in
        the same order, so they agree on where the step ends and the cursor stays one)."""
        out: list[tuple[int, sd.TokenizedSample]] = []
        tokens = 0
        while tokens < self.batch_size:
            i = int(self.cursor.take(1)[0])
            s = self.sample(self.train, i, f"{self.train.source} row {i}")
            out.append((i, s))
            tokens += len(s)
        return out

    def val_batch(self, rank: int, world: int, device: torch.device, copies: int = 1) -> StepBatch:
        if self._val_cache is None:  # the validation set is fixed: tokenize it once
            self._val_cache = [
                self.sample(self.val, i, f"{self.val.source or 'val'} row {i}")
                for i in range(rank, len(self.val), world)
            ]
        return self._batch(self._val_cache, device, copies)

    def _batch(
        self,
        samples: list[sd.TokenizedSample],
        device: torch.device,
        copies: int = 1,
        subsets: list[int] | None = None,
    ) -> StepBatch:
        kept = [s for s in samples if s.loss_mask.any()]  # nothing to learn (e.g. truncated away)
        images = [s for s in kept if getattr(s, "mm", None)]  # one sample with images per micro-batch
        text = [s for s in kept if not getattr(s, "mm", None)]
        mbs, waste = micro_batches_for(text, self.seq_len, self.micro_tokens, device)
        if images:
            from hpcrl.trainer.sft_vlm import micro_batches

            mbs += micro_batches(images, self.vision.image_id, device)
        local = [
            sum(int(s.loss_mask.sum()) for s in kept),
            sum(len(s) for s in kept),
            len(kept),
            sum(s.truncated for s in samples),
            len(samples) - len(kept),
        ]
        summed = parallel.all_reduce(torch.tensor(local, dtype=torch.float64))
        keys = ("loss_tokens", "tokens", "samples", "truncated", "dropped")
        totals = {k: int(v) // copies for k, v in zip(keys, summed.tolist())}
        return StepBatch(mbs, totals, waste, self._subset_ratios(samples, subsets, totals))

    def _subset_ratios(
        self, samples: list[sd.TokenizedSample], subsets: list[int] | None, totals: dict[str, int]
    ) -> dict[str, float]:
        """Collective when the data has subsets: progress/<subset>/ratio_{samples,tokens}, this
        step's share of each subset among the trained samples and their tokens."""
        names = self.train.subsets[0] if self.train.subsets is not None else None
        if names is None or subsets is None:
            return {}
        counts = torch.zeros(len(names), 2, dtype=torch.float64)
        for s, k in zip(samples, subsets):
            if s.loss_mask.any() and k >= 0:
                counts[k] += torch.tensor([1.0, float(len(s))], dtype=torch.float64)
        counts = parallel.all_reduce(counts)
        n, t = max(float(counts[:, 0].sum()), 1.0), max(float(counts[:, 1].sum()), 1.0)
        out = {}
        for name, (ns, nt) in zip(names, counts.tolist()):
            out[f"progress/{name}/ratio_samples"] = ns / n
            out[f"progress/{name}/ratio_tokens"] = nt / t
        return out


def micro_batches_for(
    samples: list[sd.TokenizedSample], seq_len: int, micro_tokens: int, device: torch.device
) -> tuple[list[PackedBatch], float]:
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
    mbs = [
        packed.slice_samples(int(first_sample[a]), int(first_sample[b]))
        for a, b in split_micro_batches(row_lens, max(micro_tokens, seq_len))
    ]
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
    rank, world, copies = data_share(tr)
    batch = data.val_batch(rank, world, tr.device, copies=copies)
    mbs = list(batch.micro_batches)
    n_mb = int(parallel.all_reduce(float(len(mbs)), op="max"))  # FSDP: same number of forwards everywhere
    mbs += [dummy_micro_batch(tr.device) for _ in range(n_mb - len(mbs))]
    total = torch.zeros((), dtype=torch.float64)
    tr.model.eval()
    try:
        for mb in mbs:
            if tr.cp is not None:  # each rank sums the tokens it predicts: the group's sum counts each once
                mb = restrict(mb, tr.cp)  # noqa: PLW2901
            lp = forward_for(tr, mb, compute_entropy=False, wanted=mb.loss_mask).logprobs
            total += -torch.where(mb.loss_mask, lp, torch.zeros_like(lp)).sum().double().cpu()
    finally:
        tr.model.train()
    return float(parallel.all_reduce(total)) / max(batch.totals["loss_tokens"], 1)


def step_metrics(
    out: StepResult,
    batch: StepBatch,
    progress: Progress,
    data: SFTData,
    val_loss: float | None,
    t_val: float,
    t_ckpt: float,
    t_step: float,
) -> dict[str, Any]:
    t = batch.totals
    m: dict[str, Any] = {
        "loss/mean": out.stats["loss"],
        **common_metrics(out, progress, t_ckpt, t_step),
        "progress/epoch": data.cursor.epochs_done,
        "progress/num_samples": progress.total_samples,
        "progress/num_tokens": progress.total_tokens,
        "data/truncated": t["truncated"],
        "data/dropped": t["dropped"],
        "data/packing_waste": batch.packing_waste,
        "loss_tokens": t["loss_tokens"],
        "optim/zero_grad_ratio": out.zero_grad_ratio,
        **batch.subset_ratios,
        **out.moe,  # MoE: also logged as seed 001's max_vio/mean, routing_confidence/mean (aliases)
    }
    if val_loss is not None:
        m["val/loss"], m["time/val"] = val_loss, t_val
    return m
