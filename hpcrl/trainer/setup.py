"""Build what both trainers (RL and SFT) need from the config: device, model, optimizer, scheduler."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.config.schema import LossConfig, OptimConfig, TrainerModelConfig
from hpcrl.models import spec as model_spec
from hpcrl.models.chunked import chunk_rows
from hpcrl.models.embeddings import base_model, lm_head
from hpcrl.models.parallelize import CPGroup, make_cp_group
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.trainer import memory_savers, parallel, precision
from hpcrl.trainer import optim as optim_lib
from hpcrl.trainer.loss import LossParams

log = logging.getLogger("hpcrl.trainer")


@dataclass
class Training:
    """Everything a training loop mutates."""

    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    model_path: str
    dist: parallel.DistEnv
    precision: precision.Precision  # compute / master / reduce dtypes; the published policy is in compute
    router_replay: bool = False  # MoE on the custom implementation with trainer.model.router_replay
    logprobs_chunk: int = 0  # positions per LM-head chunk (chunked.chunk_rows; 0 = off)
    cp: CPGroup | None = None  # context-parallel group (trainer.model.cp > 1)
    # a fresh LR schedule over N steps (ckpt.skip_scheduler: the resumed run's remaining steps)
    make_scheduler: Callable[[int], torch.optim.lr_scheduler.LambdaLR] | None = None
    token_export: Any = None  # hpcrl.trainer.token_export.TokenExporter (trainer.enable_token_export)


def _vocab(model: torch.nn.Module) -> int:
    """Rows of the LM head's weight (the global shape: FSDP's DTensor reports it too)."""
    head = lm_head(model)
    return int(head.weight.shape[0]) if head is not None else int(base_model(model).config.vocab_size)


def _chunk(model: torch.nn.Module, model_cfg: TrainerModelConfig, cp: CPGroup | None) -> int:
    """Positions per logprob chunk (0: off), bounded by logprobs_chunk_mib. A vocabulary-parallel head
    always chunks (DEFAULT_CHUNK when chunking is off) and its buffer has a rank's vocab / cp columns,
    so the same bytes hold cp times the rows."""
    from hpcrl.models.chunked import DEFAULT_CHUNK, vocab_parallel

    tokens, v = model_cfg.logprobs_chunk_tokens, _vocab(model)
    if cp is not None and vocab_parallel(model):
        tokens, v = tokens or DEFAULT_CHUNK, -(-v // cp.size)
    return chunk_rows(tokens, v, model_cfg.logprobs_chunk_mib)


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def build_training(
    model_cfg: TrainerModelConfig,
    optim_cfg: OptimConfig,
    total_steps: int,
    seed: int,
    warm_start: str | None = None,
    meta_init: bool = True,
    dist_timeout_s: float = 3600.0,
) -> Training:
    """Distributed init and the cp groups, the model (its family spec builds and parallelizes it:
    :func:`build_model`), optimizer and scheduler. ``meta_init = False`` makes every rank read the whole model (the old path, kept for the
    memory benchmark's baseline). ``dist_timeout_s``: trainer.dist_timeout_seconds."""
    from hpcrl.models.resolve import resolve_model

    env = parallel.dist_env()
    device = parallel.device_for(env.local_rank)
    parallel.init_distributed(device, timeout_s=dist_timeout_s)
    if device.type == "cpu":
        # Same numerics on every run of the same config: needed for bitwise-identical resumes.
        # The eager switch alone: torch.use_deterministic_algorithms also imports torch._inductor
        # to set its config (about 2 s of CPU per rank at start-up), needed only with trainer.model.compile.
        torch._C._set_deterministic_algorithms(True, warn_only=True)
    cp = make_cp_group(model_cfg.cp) if model_cfg.cp > 1 else None
    seed_everything(seed, env.rank)
    prec = precision.of_model(model_cfg, on_gpu=device.type == "cuda")
    path = resolve_model(model_cfg.name or "", field="trainer.model.name")
    model = build_model(path, model_cfg, prec, device, warm_start, meta_init=meta_init, cp=cp)
    tokenizer = load_tokenizer(path, trust_remote_code=model_cfg.trust_remote_code)
    optimizer = optim_lib.optimizer_from_config(model, optim_cfg)
    if model_cfg.optim_cpu_offload or model_cfg.full_offload is not None:
        memory_savers.offload_optimizer_state(optimizer)
        log.info("optimizer state in host memory between steps (%s)", "trainer.model.optim_cpu_offload"
                 if model_cfg.optim_cpu_offload else "trainer.model.full_offload")  # fmt: skip

    base_lrs = [g["lr"] for g in optimizer.param_groups]  # this config's, whatever a checkpoint says

    def make_scheduler(steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        for g, lr in zip(optimizer.param_groups, base_lrs, strict=True):
            g["initial_lr"] = lr
        return optim_lib.build_scheduler(
            optimizer,
            optim_cfg.scheduler,
            warmup_steps=optim_cfg.warmup_steps,
            total_steps=max(steps, optim_cfg.warmup_steps + 1),
            min_lr_ratio=optim_cfg.min_lr_ratio,
        )

    scheduler = make_scheduler(total_steps)
    n = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s: %.2fM parameters on %s (world size %d), %s",
        path,
        n / 1e6,
        device,
        env.world_size,
        prec.describe(),
    )
    from hpcrl.trainer import moe_metrics

    is_moe = bool(moe_metrics.moe_layers(model))
    moe_metrics.set_aux_coef(model, model_cfg.moe_aux_loss_coef)
    replay = is_moe and model_cfg.router_replay
    if is_moe:
        log.info("MoE: router replay %s, ep %d, load-balancing loss coef %g",
                 "on" if replay else "off", model_cfg.ep, model_cfg.moe_aux_loss_coef)  # fmt: skip
    if cp is not None:
        log.info(
            "context parallel: cp %d, this rank is %d of cp group %s (%s attention; one packed row per "
            "micro-batch, trainer.share_prefix does not apply)",
            cp.size,
            cp.rank,
            list(cp.members),
            model_cfg.cp_mode,
        )
    return Training(
        model,
        tokenizer,
        optimizer,
        scheduler,
        device,
        path,
        env,
        prec,
        router_replay=replay,
        logprobs_chunk=_chunk(model, model_cfg, cp),
        cp=cp,
        make_scheduler=make_scheduler,
    )


def build_model(
    path: str,
    model_cfg: TrainerModelConfig,
    prec: precision.Precision,
    device: torch.device,
    warm_start: str | None = None,
    meta_init: bool = True,
    cp: CPGroup | None = None,
) -> torch.nn.Module:
    """The trainable model, parallelized, through its family spec's one construction path
    (:func:`hpcrl.models.spec.build`: build on meta or rank 0, warm start, ep, cp, FSDP2,
    vocab-parallel, fill from rank 0). The trainer only passes its process layout and dtypes."""
    mesh = model_spec.Mesh(device, parallel.get_world_size(), parallel.get_rank(), cp)
    dtypes = model_spec.Dtypes(prec.master, prec.compute, prec.reduce, mixed=prec.mixed)
    from hpcrl.trainer.export import read_weights  # an HF weights dir or a checkpoint step dir

    def prepare(model: torch.nn.Module) -> None:  # before FSDP: what it shards are the wrapped layers
        if getattr(model_cfg, "vlm", None) is not None:  # before AC wraps the blocks
            _swap_vl_moe(model, model_cfg)
        for line in memory_savers.prepare_model(model, model_cfg):
            log.info("%s", line)
        vlm = getattr(model_cfg, "vlm", None)  # sft's [model.vlm]: resolve, freeze the vision encoder
        if vlm is not None:
            from hpcrl.trainer.sft_vlm import prepare_model

            for line in prepare_model(model, vlm):
                log.info("%s", line)
            ac = model_cfg.ac
            if ac is not None and ac.mode == "full" and not vlm.freeze_vision_encoder:
                line = memory_savers.checkpoint_vision_blocks(model, ac.freq)
                if line:
                    log.info("%s", line)

    model = model_spec.build(
        model_cfg,
        path,
        mesh,
        dtypes,
        warm_start=warm_start,
        meta_init=meta_init,
        read_weights=read_weights,
        prepare=prepare,
    )
    vlm = getattr(model_cfg, "vlm", None)
    if vlm is not None and not vlm.freeze_vision_encoder and mesh.world > 1:
        from hpcrl.trainer.sft_vlm import reduce_unused_grads

        reduce_unused_grads(model, mesh.world)
    return model


def _swap_vl_moe(model: torch.nn.Module, model_cfg: TrainerModelConfig) -> None:
    """[model.vlm] with ep > 1 or LoRA on "experts": the language model's MoE blocks become hpcrl's
    expert-parallel MoE (hpcrl.models.vlm_moe), which the spec's parallelize then shards over the
    ep groups, and the stacked experts get their LoRA there (peft cannot wrap them)."""
    from hpcrl.errors import ConfigError
    from hpcrl.models.vlm_moe import MODEL_TYPES, add_expert_lora, swap_moe_blocks

    lora = model_cfg.lora
    expert_lora = lora is not None and "experts" in lora.target_modules
    if model_cfg.ep == 1 and not expert_lora:
        return
    n = swap_moe_blocks(base_model(model), "model.ep" if model_cfg.ep > 1 else "model.lora.target_modules")
    if n == 0 and model_cfg.ep > 1:
        mt = getattr(getattr(base_model(model), "config", None), "model_type", "?")
        raise ConfigError(
            "model.ep",
            f"> 1 with [vlm] needs a vision-language MoE ({', '.join(MODEL_TYPES)}); {mt!r} has no MoE blocks",
        )
    log.info("[vlm]: %d MoE blocks of the language model on hpcrl's MoE (ep %d)", n, model_cfg.ep)
    if expert_lora and n:
        assert lora is not None
        add_expert_lora(base_model(model), lora.rank, lora.alpha, lora.dropout, seed=0)
        log.info("[vlm]: LoRA (rank %d) on the stacked experts of %d MoE blocks", lora.rank, n)


def loss_params(loss: LossConfig, mode: str) -> LossParams:
    return LossParams(
        type=loss.type,
        mode=mode,
        eps_low=loss.eps_low,
        eps_high=loss.eps_high,
        max_log_ratio=loss.max_log_ratio,
        kl_coef=loss.kl_coef,
        entropy_coef=loss.entropy_coef,
        kl_estimator=loss.kl_estimator,
        kl_target="inference",
        use_tis=loss.use_tis,
        tis_clip=loss.tis_clip,
        token_mask_low=loss.token_mask_low,
        token_mask_high=loss.token_mask_high,
        sequence_mask_low=loss.sequence_mask_low,
        sequence_mask_high=loss.sequence_mask_high,
        geo_mask_low=loss.geo_mask_low,
        geo_mask_high=loss.geo_mask_high,
    )
