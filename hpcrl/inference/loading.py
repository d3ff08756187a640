"""Reading weight updates from disk: full safetensors checkpoints and LoRA adapters (no pickle)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.inference.protocol import APIError

if TYPE_CHECKING:
    import torch


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF directory (`*.safetensors`) or of one `.safetensors` file, on CPU."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.exists():
        raise APIError(f"weights path {path!r} does not exist", param="path")
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise APIError(f"weights path {path!r} holds no .safetensors file", param="path")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # corrupt / truncated file: a client error, not a crash
            raise APIError(f"cannot read {f}: {e}", param="path") from e
        for k, v in tensors.items():
            if k in out:
                raise APIError(f"tensor {k!r} appears in more than one file under {path!r}", param="path")
            out[k] = v
    return out


def check_compatible(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Refuse an update that names unknown parameters or has other shapes: nothing is loaded then."""
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise APIError(
            f"{len(unknown)} tensor name(s) are not parameters of the served model, e.g. {unknown[:3]}",
            param="path",
        )
    bad = [
        (k, tuple(t.shape), tuple(params[k].shape))
        for k, t in tensors.items()
        if tuple(t.shape) != tuple(params[k].shape)
    ]
    if bad:
        k, got, want = bad[0]
        raise APIError(f"shape mismatch for {k!r}: update has {got}, model has {want}", param="path")
    if not tensors:
        raise APIError("the weight update holds no tensors", param="path")
    check_finite(tensors, "path")


def check_finite(tensors: dict[str, torch.Tensor], param: str) -> None:
    """NaN/inf weights would poison every sample silently: refuse them before anything is replaced."""
    import torch

    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise APIError(f"tensor {k!r} holds NaN or inf values; refused (nothing was loaded)", param=param)


def read_adapter(path: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter dir: (adapter_config.json as a dict, the adapter's tensors), refused with a
    client error when either is missing or unreadable. Both LoRA routes read adapters through here."""
    p = Path(path)
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file():
        raise APIError(f"LoRA path {path!r} has no adapter_config.json", param="lora_path")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, RecursionError) as e:
        raise APIError(f"bad adapter_config.json under {path!r}: {e}", param="lora_path") from e
    if not isinstance(cfg, dict):
        raise APIError(f"bad adapter_config.json under {path!r}: not a JSON object", param="lora_path")
    return cfg, load_safetensors_dir(str(p / "adapter_model.safetensors"))


def load_lora_delta(
    path: str, params: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read a PEFT LoRA adapter dir; return ({base param name: delta W}, raw adapter tensors)."""
    cfg, raw = read_adapter(path)
    return lora_deltas(cfg, raw, params, where=repr(path)), raw


def lora_deltas(
    cfg: dict[str, object],
    raw: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    *,
    where: str = "the adapter",
) -> dict[str, torch.Tensor]:
    """{base param name: delta W} of a PEFT adapter (its config and tensors, from a dir or a broadcast).

    The server merges base + delta (never cumulative), so loading adapter k replaces adapter k-1.
    """
    try:
        r = int(cfg["r"])  # type: ignore[call-overload]
        alpha = float(cfg.get("lora_alpha", r))  # type: ignore[arg-type]
        if r < 1 or alpha != alpha or abs(alpha) == float("inf"):
            raise ValueError(f"r = {r}, lora_alpha = {alpha}: need r >= 1 and a finite alpha")
    except (ValueError, KeyError, TypeError) as e:
        raise APIError(f"bad adapter config of {where}: {e}", param="lora_path") from e
    check_finite(raw, "lora_path")
    scale = alpha / (r**0.5 if cfg.get("use_rslora") else r)
    deltas: dict[str, torch.Tensor] = {}
    for key, a in raw.items():
        if ".lora_A." not in key:
            continue
        b = raw.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise APIError(f"LoRA tensor {key!r} has no lora_B partner", param="lora_path")
        # PEFT names: base_model.model.<hf module>.lora_A.weight -> <hf module>.weight
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        name = f"{module}.weight"
        if name not in params:
            raise APIError(f"LoRA targets {name!r}, which the served model does not have", param="lora_path")
        want = tuple(params[name].shape)
        if (
            a.ndim != 2
            or b.ndim != 2
            or a.shape[0] != r
            or b.shape[1] != r
            or (b.shape[0], a.shape[1]) != want
        ):
            raise APIError(
                f"LoRA pair for {name!r} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}; rank {r} "
                f"and the model's {want} need A ({r}, {want[-1]}), B ({want[0]}, {r})",
                param="lora_path",
            )
        deltas[name] = (b.float() @ a.float()) * scale
    if not deltas:
        raise APIError(f"LoRA adapter {where} holds no lora_A/lora_B pairs", param="lora_path")
    return deltas
