"""What the RL and SFT trainers share: typed progress and step results, the optimizer step over
micro-batches, the stop signal handler and the metrics every trainer step reports.

    micro-batches -> forward/backward (loss / global loss tokens) -> all-reduced stats
    -> finite check -> optimizer step (or skip on every rank) -> StepResult -> Progress.advance
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import torch

from hpcrl.trainer import parallel
from hpcrl.trainer.context_parallel import forward_cp, restrict
from hpcrl.trainer.env_stats import token_envs
from hpcrl.trainer.loss import LossParams, add_stats, compute_loss, stack_stats, summarize, unstack_stats
from hpcrl.trainer.moe_metrics import collect as collect_moe_metrics
from hpcrl.trainer.moe_metrics import take_aux_loss
from hpcrl.trainer.optim import clip_grad_norm, current_lr
from hpcrl.trainer.packing import ForwardOutput, PackedBatch, dummy_micro_batch, forward_packed
from hpcrl.trainer.setup import Training

log = logging.getLogger("hpcrl.trainer")

# Counter names SFT checkpoints used before RL and SFT shared one Progress: still read on resume.
LEGACY_PROGRESS_NAMES = {
    "num_samples": "total_samples",
    "num_tokens": "total_tokens",
    "num_truncated": "total_truncated",
}


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Counters saved with every trainer checkpoint (rank_R.json "progress"), summed over ranks."""

    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0
    total_truncated: int = 0  # SFT: samples cut at seq_len
    skipped_updates: int = 0  # non-finite loss or grad norm: the optimizer step was skipped
    data: dict[str, int] | None = None  # SFT: the data cursor after this step (the next rows to read)

    def advance(self, out: StepResult, *, truncated: int = 0, data: dict[str, int] | None = None) -> Progress:
        return msgspec.structs.replace(
            self,
            step=self.step + 1,
            total_tokens=self.total_tokens + out.tokens,
            total_samples=self.total_samples + out.samples,
            total_truncated=self.total_truncated + truncated,
            skipped_updates=self.skipped_updates + int(out.skipped),
            data=self.data if data is None else data,
        )

    def to_saved(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> Progress:
        """The progress of any trainer checkpoint, including SFT ones written with the old names."""
        renamed = {LEGACY_PROGRESS_NAMES.get(k, k): v for k, v in saved.items()}
        return msgspec.convert(renamed, cls)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as every rank saw it (stats and counts are summed over ranks)."""

    stats: dict[str, float]  # loss.summarize: loss, entropy, mismatch_kl, loss_tokens, ...
    grad_norm: float
    lr: float  # the learning rate this step used (before the scheduler moved on)
    skipped: bool  # non-finite loss or grad norm: weights unchanged
    time_fb: float  # seconds from the start of the step to the end of forward/backward
    micro_batches: int
    padding: float  # padded share of the forwarded slots
    slots_per_token: float
    entropies: torch.Tensor = field(repr=False)  # per loss token, for the entropy distribution
    moe: dict[str, float] = field(default_factory=dict)  # hpcrl.trainer.moe_metrics (MoE models)
    # RL: per loss token, the mismatch KL and the env index of KL and entropy tokens (env_stats)
    token_kl: torch.Tensor | None = field(default=None, repr=False)
    kl_envs: torch.Tensor | None = field(default=None, repr=False)
    entropy_envs: torch.Tensor | None = field(default=None, repr=False)
    env: dict[str, float] = field(default_factory=dict)  # hpcrl.trainer.env_stats: per-env KL / entropy
    zero_grad_ratio: float = float("nan")  # share of trainable parameters whose gradient was all zero
    tokens: int = 0  # tokens and samples of the whole step (every rank), set by the caller
    samples: int = 0

    def counted(self, tokens: int, samples: int) -> StepResult:
        return replace(self, tokens=tokens, samples=samples)


def step_micro_batches(
    tr: Training,
    mbs: list[PackedBatch],
    params: LossParams,
    num_loss_tokens: int | float,
    max_norm: float,
    step: int,
    t0: float,
    num_ce_tokens: int = 0,
) -> StepResult:
    """Forward/backward over this rank's micro-batches (loss normalised by the step's global
    loss-token count; echo's cross entropy by its global ce-token count, `num_ce_tokens`), then one
    optimizer step that is skipped - on every rank alike - when the loss or grad norm is not finite."""
    # FSDP: every rank must run the same number of forward/backward passes.
    n_mb = int(parallel.all_reduce(float(len(mbs)), op="max"))
    mbs = mbs + [dummy_micro_batch(tr.device) for _ in range(n_mb - len(mbs))]
    stats = None
    entropies: list[torch.Tensor] = []
    kls: list[torch.Tensor] = []
    kl_envs: list[torch.Tensor] = []
    ent_envs: list[torch.Tensor] = []
    tokens = slots = padding = 0
    for i, mb in enumerate(mbs):
        if tr.cp is not None:
            mb = restrict(mb, tr.cp)  # noqa: PLW2901 - the loss counts only the tokens this rank predicts
        fwd = forward_for(tr, mb, wanted=mb.trained())
        if tr.token_export is not None:  # trainer.enable_token_export
            tr.token_export.export(step, i, mb, fwd.logprobs, fwd.entropy)
        tokens, slots, padding = tokens + mb.num_tokens, slots + fwd.slots, padding + fwd.padding
        envs = token_envs(mb.env_index, mb.seq_lens, mb.loss_mask)
        if fwd.entropy is not None:
            entropies.append(fwd.entropy.detach()[mb.loss_mask.bool()].float().cpu())
            if envs is not None:
                ent_envs.append(envs)
        out = compute_loss(
            params,
            trainer_logprobs=fwd.logprobs,
            loss_mask=mb.loss_mask,
            num_loss_tokens=num_loss_tokens,
            inference_logprobs=mb.inference_logprobs,
            advantages=mb.advantages,
            entropy=fwd.entropy,
            teacher_logprobs=mb.teacher_logprobs,
            ref_logprobs=mb.ref_logprobs,
            seq_lens=mb.seq_lens,
            ce_weights=mb.ce_weights,
            num_ce_tokens=num_ce_tokens,
        )
        loss = out.loss
        aux = take_aux_loss(tr.model)  # MoE load balancing (trainer.model.moe_aux_loss_coef > 0)
        if aux is not None:  # weighted by this micro-batch's share of the step's loss tokens
            loss = loss + aux * (float(mb.loss_mask.sum()) / max(float(num_loss_tokens), 1.0))
        loss.backward()
        stats = add_stats(stats, out.stats)
        if out.token_kl is not None:
            kls.append(out.token_kl[mb.loss_mask.bool()].cpu())
            if envs is not None:
                kl_envs.append(envs)
    t_fb = time.perf_counter() - t0
    if tr.token_export is not None:
        tr.token_export.finish(step)
    zero_grads = zero_grad_ratio(tr.model)  # before optimizer_step zeroes the gradients
    grad_norm, summed, lr, ok = optimizer_step(tr, stats, max_norm, step)
    moe = collect_moe_metrics(tr.model)  # collective; {} without MoE layers
    return StepResult(
        stats=summarize(summed),
        grad_norm=grad_norm,
        lr=lr,
        skipped=not ok,
        time_fb=t_fb,
        micro_batches=n_mb,
        padding=padding / max(slots, 1),
        slots_per_token=slots / max(tokens, 1),
        entropies=torch.cat(entropies) if entropies else torch.zeros(0),
        moe=moe,
        token_kl=torch.cat(kls) if kls else None,
        kl_envs=torch.cat(kl_envs) if kl_envs and len(kl_envs) == len(kls) else None,
        entropy_envs=torch.cat(ent_envs) if ent_envs and len(ent_envs) == len(entropies) else None,
        zero_grad_ratio=zero_grads,
    )


def zero_grad_ratio(model: torch.nn.Module) -> float:
    """Collective: the share of trainable parameter elements whose gradient is exactly 0 this step
    (seed 001's `optim/zero_grad_ratio`: high means a dead path or a wrong loss mask)."""
    zero = total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "to_local"):  # FSDP2 DTensor: this rank's shard
            g = g.to_local()
        n = p.numel() if g is None else g.numel()
        total += n
        zero += n if g is None else int((g == 0).sum())
    counts = parallel.all_reduce(torch.tensor([float(zero), float(total)], dtype=torch.float64))
    return float(counts[0] / counts[1]) if float(counts[1]) > 0 else float("nan")


def forward_for(tr: Training, mb: PackedBatch, **kw: Any) -> ForwardOutput:
    """The packed forward of this trainer: this rank's time slice under cp, else the whole batch; a
    sample with images (vision-language SFT) through the model's own multimodal forward."""
    if getattr(mb, "mm", None) is not None:
        from hpcrl.trainer.sft_vlm import forward_multimodal

        return forward_multimodal(tr.model, mb, chunk_tokens=tr.logprobs_chunk, **kw)
    if tr.cp is not None:
        return forward_cp(tr.model, mb, tr.cp, chunk_tokens=tr.logprobs_chunk, **kw)
    return forward_packed(tr.model, mb, chunk_tokens=tr.logprobs_chunk, **kw)


def optimizer_step(
    tr: Training, stats: Any, max_norm: float, step: int
) -> tuple[float, dict[str, Any], float, bool]:
    """Clip, all-reduce the loss stats, step (only when finite), zero grads, advance the schedule.
    Returns (grad norm, summed stats, lr used, stepped)."""
    grad_norm = clip_grad_norm(tr.model.parameters(), max_norm if max_norm > 0 else None)
    summed = unstack_stats(parallel.all_reduce(stack_stats(stats)))
    ok = math.isfinite(grad_norm) and math.isfinite(float(summed["loss"]))
    if ok:
        tr.optimizer.step()
    else:
        log.error(
            "non-finite loss (%s) or grad norm (%s) at step %d: update skipped, weights unchanged",
            float(summed["loss"]),
            grad_norm,
            step,
        )
    tr.optimizer.zero_grad(set_to_none=True)
    lr = current_lr(tr.optimizer)
    tr.scheduler.step()
    return grad_norm, summed, lr, ok


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
    # `hpcrl run` starts trainer ranks with SIGUSR2 blocked (hpcrl.launch.local.spawn), so a stop
    # requested while this process was still importing waits for this handler instead of killing it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    return ev


def agreed_stop(stop: threading.Event) -> bool:
    """Whether any rank was asked to stop, the same answer on every rank (a collective): ranks get
    the signal one after another, and one rank saving while another waits for a batch would hang."""
    from hpcrl.trainer import parallel

    return parallel.all_reduce(float(stop.is_set()), op="max") > 0


def common_metrics(out: StepResult, progress: Progress, t_ckpt: float, t_step: float) -> dict[str, Any]:
    """The metrics both trainers log under the same names (each adds its own)."""
    return {
        "optim/grad_norm": out.grad_norm,
        "optim/lr": out.lr,
        "optim/skipped_updates": progress.skipped_updates,
        "time/forward_backward": out.time_fb,
        "time/save_ckpt": t_ckpt,
        "time/step": t_step,
        "perf/throughput": out.tokens / max(out.time_fb, 1e-9),
        "perf/peak_memory": peak_memory_gib(),
        "micro_batches": out.micro_batches,
        "perf/padding": out.padding,
    }


def peak_memory_gib() -> float:
    """Peak GPU memory, or on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB
