"""Reading weight updates from disk: full safetensors checkpoints and LoRA adapters (no pickle)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hpcrl.inference import files
from hpcrl.inference.protocol import APIError

if TYPE_CHECKING:
    import torch

    from hpcrl.weights.delta import Delta


def load_safetensors_dir(path: str, param: str = "path") -> dict[str, torch.Tensor]:
    """All tensors of a HF directory (`*.safetensors`) or of one `.safetensors` file, on CPU. Every
    file is checked to be a regular file first (a FIFO would block the reader), and any failure to
    resolve or read is a 400 naming `param` (hpcrl.inference.files)."""
    from safetensors.torch import load_file

    p = files.resolve(path, param)
    if p.is_dir() and _sharded(p):
        return load_sharded_dir(str(p), param)
    if p.is_dir():
        try:
            found = sorted(p.glob("*.safetensors"))
        except OSError as e:
            raise files.fail(param, path, f"cannot be listed: {e.strerror}") from None
    else:
        found = [p]
    if not found:
        raise APIError(f"weights path {files.show(path)} holds no .safetensors file", param=param)
    out: dict[str, torch.Tensor] = {}
    for f in found:
        files.regular_file(f, param)
        try:
            tensors = load_file(str(f))
        except Exception as e:  # corrupt / truncated / unreadable file: a client error, not a crash
            raise APIError(f"cannot read {files.show(f)}: {e}", param=param) from e
        for k, v in tensors.items():
            if k in out:
                raise APIError(
                    f"tensor {k!r} appears in more than one file under {files.show(path)}", param=param
                )
            out[k] = v
    return out


def _sharded(p: os.PathLike[str]) -> bool:
    from hpcrl.weights.manifest import is_sharded

    return is_sharded(p)


def load_sharded_dir(path: str, param: str = "path") -> dict[str, torch.Tensor]:
    """A policy written by the sharded publish (hpcrl.weights.manifest), assembled tensor by tensor and
    verified piece by piece; a missing manifest (the publish did not complete), a missing or corrupt
    piece is a 400 and nothing is loaded."""
    from hpcrl.weights.manifest import assemble

    try:
        return dict(assemble(path))
    except (OSError, ValueError) as e:
        raise APIError(f"cannot load the sharded policy under {files.show(path)}: {e}", param=param) from e


def check_compatible(
    params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], *, finite: bool = True
) -> None:
    """Refuse an update that names unknown parameters or has other shapes: nothing is loaded then.
    `finite` False: `tensors` are only the layout (meta tensors); the values are checked as they land."""
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
    check_floating(tensors, "path", want=params)
    if finite:
        check_finite(tensors, "path")


def check_floating(
    tensors: dict[str, torch.Tensor], param: str, want: dict[str, torch.Tensor] | None = None
) -> None:
    """Weights are floating point: an integer or bool tensor (cast into a float parameter without a
    word) is a corrupt or wrong file. With `want`, only where the model's own parameter is floating."""
    for k, t in tensors.items():
        if not t.is_floating_point() and (want is None or want[k].is_floating_point()):
            raise APIError(
                f"tensor {k!r} has dtype {str(t.dtype).removeprefix('torch.')}, not a floating-point "
                "type; refused (nothing was loaded)",
                param=param,
            )


def check_finite(tensors: dict[str, torch.Tensor], param: str) -> None:
    """NaN/inf weights would poison every sample silently: refuse them before anything is replaced."""
    import torch

    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise APIError(f"tensor {k!r} holds NaN or inf values; refused (nothing was loaded)", param=param)


def read_adapter(path: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter dir: (adapter_config.json as a dict, the adapter's tensors), refused with a
    client error when either is missing, unreadable or holds a bad number. Both LoRA routes (both
    backends) read adapters through here."""
    p = files.directory(path, "lora_path")
    cfg = files.read_json_object(p / "adapter_config.json", "lora_path")
    files.adapter_numbers(cfg, files.show(p / "adapter_config.json"))
    return cfg, load_safetensors_dir(str(p / "adapter_model.safetensors"), param="lora_path")


def read_delta(path: str) -> Delta | None:
    """The weight delta under a /update_weights `path`, or None for full weights; every failure to
    read it (unreadable file, corrupt header, a manifest number out of range) is a 400."""
    from hpcrl.weights.delta import DELTA_FILE, read_delta_dir

    p = files.resolve(path, "path")
    if p.is_dir() and _sharded(p):  # every trainer rank's delta of its own pieces, merged per tensor
        from hpcrl.weights.sharded_delta import read_sharded_delta

        try:
            return read_sharded_delta(str(p))
        except (OSError, ValueError) as e:
            raise APIError(f"bad sharded weight delta under {files.show(path)}: {e}", param="path") from e
    if p.is_dir() and os.path.lexists(p / DELTA_FILE):
        files.regular_file(p / DELTA_FILE, "path")
    try:
        return read_delta_dir(str(p))
    except (OSError, ValueError, OverflowError) as e:
        raise APIError(f"bad weight delta under {files.show(path)}: {e}", param="path") from e
    except Exception as e:  # safetensors' own error type: a corrupt or truncated header
        raise APIError(f"cannot read the weight delta under {files.show(path)}: {e}", param="path") from e


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
    r, alpha, rslora = files.adapter_numbers(cfg, f"the adapter config of {where}")
    check_floating(raw, "lora_path")
    check_finite(raw, "lora_path")
    scale = alpha / (r**0.5 if rslora else r)
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
    check_finite(deltas, "lora_path")  # finite factors can still overflow once scaled and multiplied
    return deltas
