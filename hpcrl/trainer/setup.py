"""Build what both trainers (RL and SFT) need from the config: device, model, optimizer, scheduler."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.config.schema import LossConfig, OptimConfig, TrainerModelConfig
from hpcrl.errors import ConfigError
from hpcrl.models import registry
from hpcrl.models.chunked import chunk_rows
from hpcrl.models.embeddings import base_model, lm_head
from hpcrl.trainer import model as model_lib
from hpcrl.trainer import optim as optim_lib
from hpcrl.trainer import parallel, precision
from hpcrl.trainer.context_parallel import CPGroup, make_cp_group
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
) -> Training:
    """Distributed init, model (sharded with FSDP2 when world > 1 or mixed precision), optimizer and
    scheduler. ``meta_init = False`` makes every rank read the whole model (the old path, kept for the
    memory benchmark's baseline)."""
    from hpcrl.models.resolve import resolve_model

    env = parallel.dist_env()
    device = parallel.device_for(env.local_rank)
    parallel.init_distributed(device)
    if device.type == "cpu":
        # Same numerics on every run of the same config: needed for bitwise-identical resumes.
        # The eager switch alone: torch.use_deterministic_algorithms also imports torch._inductor
        # to set its config (about 2 s of CPU per rank at start-up), and hpcrl never compiles.
        torch._C._set_deterministic_algorithms(True, warn_only=True)
    cp = make_cp_group(model_cfg.cp) if model_cfg.cp > 1 else None
    seed_everything(seed, env.rank)
    prec = precision.of_model(model_cfg, on_gpu=device.type == "cuda")
    path = resolve_model(model_cfg.name or "", field="trainer.model.name")
    model = build_model(path, model_cfg, prec, device, warm_start, meta_init=meta_init, cp=cp)
    tokenizer = model_lib.load_tokenizer(path, trust_remote_code=model_cfg.trust_remote_code)
    optimizer = optim_lib.build_optimizer(
        model,
        optim_cfg.type,
        lr=optim_cfg.lr,
        weight_decay=optim_cfg.weight_decay,
        betas=(optim_cfg.betas[0], optim_cfg.betas[1]),
        eps=optim_cfg.eps,
    )
    scheduler = optim_lib.build_scheduler(
        optimizer,
        optim_cfg.scheduler,
        warmup_steps=optim_cfg.warmup_steps,
        total_steps=max(total_steps, optim_cfg.warmup_steps + 1),
        min_lr_ratio=optim_cfg.min_lr_ratio,
    )
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
    """The trainable model, sharded. Over several ranks with ``meta_init``, only rank 0 reads the
    weights (into CPU memory): the others build the model on the meta device, every rank shards it
    (FSDP2), and rank 0 broadcasts one tensor at a time, each rank keeping its rows. Rank 0 then drops
    its whole copy, so no rank holds more than one model plus its shard at any moment."""
    lora = None
    if model_cfg.lora is not None:
        lc = model_cfg.lora
        lora = model_lib.LoraParams(
            rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, target_modules=tuple(lc.target_modules)
        )
    registry.refuse_lora_on_custom(model_cfg.impl, lora is not None)  # before a warm start drops `lora` below
    from_rank0 = meta_init and parallel.get_world_size() > 1
    on_meta = from_rank0 and not parallel.is_rank0()
    model = model_lib.load_model(
        path,
        dtype=prec.master,
        device="cpu" if from_rank0 else device,
        attn_impl=attn_impl_for(model_cfg),
        activation_checkpointing=model_cfg.activation_checkpointing,
        # On CPU the activations are in CPU memory already (the dry run says so in one line)
        activation_offload=model_cfg.activation_offload and device.type == "cuda",
        lora=None if warm_start else lora,
        trust_remote_code=model_cfg.trust_remote_code,
        meta=on_meta,
        # LoRA (also when a warm start applies it after loading) runs on transformers' model (peft)
        impl=model_cfg.impl if lora is None else "hf",
    )
    if warm_start:
        # Into the base model, before LoRA wraps it: the weights dir holds HF names (a LoRA run's are
        # merged), and the new adapter starts at zero on top of them. Meta ranks get it from rank 0.
        if not on_meta:
            load_warm_start(model, warm_start)
        if lora is not None:
            model = model_lib.apply_lora(model, lora)
    whole = parallel.local_tensors(model) if from_rank0 and not on_meta else {}
    experts = apply_moe_options(model, model_cfg, device, prec)
    model = shard_model(
        model,
        param_dtype=model_lib.parse_dtype(prec.compute),
        reduce_dtype=model_lib.parse_dtype(prec.reduce),
        force=prec.mixed or bool(experts),
        experts=experts,
        cp=cp,
        vocab_parallel=model_cfg.vocab_parallel,
    )
    if from_rank0:
        if on_meta:
            model.to_empty(device=device)
        parallel.fill_from_rank0(model, whole)  # consumes rank 0's whole copy, tensor by tensor
    return model


def apply_moe_options(
    model: torch.nn.Module, model_cfg: TrainerModelConfig, device: torch.device, prec: precision.Precision
) -> set:
    """Expert parallelism (trainer.model.ep) on the custom implementation; returns the expert
    parameters FSDP must leave alone (empty without EP)."""
    if model_cfg.ep == 1:
        return set()
    spec = registry.family_of(model)
    if spec is None:
        raise ConfigError(
            "trainer.model.ep",
            f"{model_cfg.ep} needs the custom implementation of a MoE model "
            f"(impl = 'custom' or 'auto'; this run uses transformers')",
        )
    dtypes = model_lib.parse_dtype(prec.compute), model_lib.parse_dtype(prec.reduce)
    return spec.apply_ep(model, model_cfg.ep, device, *dtypes)


def shard_model(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    force: bool = False,
    experts: set | None = None,
    cp: CPGroup | None = None,
    vocab_parallel: bool = True,
) -> torch.nn.Module:
    """FSDP2 over all ranks (:func:`parallel.apply_fsdp`), the ``experts`` left to expert
    parallelism, and under ``cp`` with ``vocab_parallel`` the input embedding and LM head split over
    the vocabulary within each cp group (:mod:`hpcrl.trainer.vocab_parallel`; said in one line when
    the model's layers cannot be). Collective."""
    vocab: set = set()
    if cp is not None and vocab_parallel:
        from hpcrl.trainer import vocab_parallel as vp

        why = vp.supported(model)
        if why is None:
            vocab = vp.parameters(model)
        else:
            log.info("trainer.model.vocab_parallel: off, %s; FSDP gathers the embedding and head whole", why)
    ignored = (experts or set()) | vocab
    model = parallel.apply_fsdp(
        model, param_dtype=param_dtype, reduce_dtype=reduce_dtype, force=force, ignored_params=ignored or None
    )
    if vocab and cp is not None:
        vs = vp.shard(model, cp.size, cp.rank, cp.group, param_dtype)
        log.info(
            "vocab-parallel embedding and LM head: %d of %d rows per rank within the cp group (FSDP "
            "leaves them alone)",
            vs.dp * vs.block,
            vs.vocab,
        )
    return model


def attn_impl_for(model_cfg: TrainerModelConfig) -> str | None:
    """The attention implementation to load the model with: ring attention under cp."""
    if model_cfg.cp > 1 and model_cfg.cp_mode == "ulysses":
        from hpcrl.models import ulysses

        return ulysses.register_hf()
    if model_cfg.cp > 1:
        from hpcrl.models.ring_attention import register_hf

        return register_hf()
    return None if model_cfg.attn == "auto" else model_cfg.attn


def load_warm_start(model: torch.nn.Module, path: str) -> None:
    """Initialise weights from an HF weights dir (e.g. weights/step_N of an earlier run) or a checkpoint
    step dir without one (its sharded trainer state, read under HF names: hpcrl.trainer.export)."""
    from hpcrl.trainer.export import read_weights

    state = read_weights(path)
    if getattr(model, "hpcrl_family", None) is not None:
        from hpcrl.models.custom import load_hf_into

        load_hf_into(model, state, "ckpt.warm_start")
        log.info("warm start from %s", path)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise ValueError(
            f"ckpt.warm_start: weights do not match the model (missing {real_missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    log.info("warm start from %s", path)


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
    )
