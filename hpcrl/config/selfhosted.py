"""Seed 004's self-hosted prime-rl example shape, translated to the native shape.

    model_name = "..."; num_gpus = 8; tensor_parallel_size = 4
    max_steps, batch_size, rollouts_per_example, learning_rate
    [env] (one table: id, args), [sampling], [wandb]

Unlike the hosted shape this trains all weights (no LoRA: prime-rl's self-hosted default). The GPUs of
one node are split between trainer and inference, and a note says how: inference gets half of them,
rounded down to whole tensor-parallel replicas (at least one replica), the trainer the rest.
[deployment] num_train_gpus / num_infer_gpus, when given, choose the split instead.
"""

from __future__ import annotations

from typing import Any

from hpcrl.config.dicts import deep_merge
from hpcrl.errors import ConfigError

MARKERS = ("model_name", "num_gpus", "tensor_parallel_size")
ORCHESTRATOR_KEYS = ("batch_size", "rollouts_per_example", "max_async_level", "max_off_policy_steps")
SEQ_LEN = 2048  # the shape has no seq_len: prime-rl's default, or the sampling budget when larger


def is_self_hosted(d: dict[str, Any]) -> bool:
    """The shape's own keys; a single [env] table alone is the hosted shape's one env (LoRA)."""
    return any(k in d for k in MARKERS)


def gpu_split(num_gpus: int, tp: int) -> tuple[int, int]:
    """(trainer GPUs, inference GPUs) of one node: inference half, in whole replicas of tp."""
    if tp > num_gpus - 1:
        raise ConfigError(
            "tensor_parallel_size",
            f"{tp} leaves no GPU of num_gpus = {num_gpus} for the trainer (at most {num_gpus - 1})",
        )
    infer = max(tp, (num_gpus // 2) // tp * tp)
    return num_gpus - infer, infer


def _int(d: dict[str, Any], key: str, default: int) -> int:
    v = d.pop(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(key, f"expected a positive integer, got {v!r}")
    return v


def translate(d: dict[str, Any], source: str, notes: list[str]) -> dict[str, Any]:
    d = dict(d)
    out: dict[str, Any] = {}
    orch: dict[str, Any] = dict(d.pop("orchestrator", None) or {})
    if "model_name" in d:
        if "model" in d:
            raise ConfigError("model_name", "conflicts with model (set one)")
        out["model"] = {"name": d.pop("model_name")}
    elif "model" in d:
        m = d.pop("model")
        out["model"] = {"name": m} if isinstance(m, str) else m
    for key in ORCHESTRATOR_KEYS:
        if key in d:
            orch[key] = d.pop(key)
    train: dict[str, Any] = dict(orch.pop("train", None) or {})
    if "env" in d:
        env = d.pop("env")
        envs = [env] if isinstance(env, dict) else env
        if not isinstance(envs, list) or not all(isinstance(e, dict) for e in envs):
            raise ConfigError("env", "expected an [env] table (id, args) or [[env]] tables")
        train["env"] = [dict(e) for e in envs]
    if "sampling" in d:
        sampling = d.pop("sampling")
        if not isinstance(sampling, dict):
            raise ConfigError("sampling", "expected a table ([sampling])")
        train["sampling"] = sampling
    orch["train"] = train
    out["orchestrator"] = orch
    if "learning_rate" in d:
        out["trainer"] = {"optim": {"lr": d.pop("learning_rate")}}
    if any(k in d for k in ("num_gpus", "tensor_parallel_size")):
        num_gpus = _int(d, "num_gpus", 2)
        tp = _int(d, "tensor_parallel_size", 1)
        dep = d.get("deployment") if isinstance(d.get("deployment"), dict) else {}
        if "num_train_gpus" in dep or "num_infer_gpus" in dep:
            notes.append(f"{source}: num_gpus = {num_gpus}: split as [deployment] says")
        else:
            n_train, n_infer = gpu_split(num_gpus, tp)
            out["deployment"] = {"num_train_gpus": n_train, "num_infer_gpus": n_infer}
            notes.append(
                f"{source}: num_gpus = {num_gpus} split: {n_train} trainer GPU(s), {n_infer} inference GPU(s) "
                f"({n_infer // tp} server(s) x tensor_parallel_size {tp}); set [deployment] num_train_gpus / "
                "num_infer_gpus to choose"
            )
        out["inference"] = {"parallel": {"tp": tp}}
    if "seq_len" not in d:
        max_tokens = train.get("sampling", {}).get("max_tokens", 0)
        out["seq_len"] = max(SEQ_LEN, max_tokens if isinstance(max_tokens, int) else 0)
        notes.append(f"{source}: seq_len not set (the self-hosted example has none): using {out['seq_len']}")
    notes.append(f"{source}: self-hosted prime-rl example shape detected; translated to the native shape")
    return deep_merge(out, d)
