"""One checksum of a set of named tensors, shared by the trainer (sender) and inference (receiver).

Both sides call `state_dict_checksum` on the same Hugging Face parameter names; equal strings mean the
server holds exactly the bytes the trainer published. Names, dtypes and shapes are hashed along with
the raw bytes, so a renamed, re-typed or reshaped tensor also changes the checksum.

xxh3-128 (~20 GB/s) is used when `xxhash` is importable (it comes with wandb, a dependency); sha256
(~1.7 GB/s) otherwise. The algorithm is the checksum's prefix, so a mismatch between two processes that
disagree on it is loud ("xxh3_128:..." != "sha256:...") rather than silently equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

try:
    import xxhash

    _ALGO = "xxh3_128"
except ImportError:  # pragma: no cover - xxhash ships with wandb
    xxhash = None
    _ALGO = "sha256"


def _hasher() -> Any:
    return xxhash.xxh3_128() if xxhash is not None else hashlib.sha256()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor (CPU copy only when needed); works for bf16 and 0-dim tensors."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def state_dict_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> str:
    """Checksum over (name, dtype, shape, bytes) of every tensor, in sorted name order.

    Order-independent in the input; the result looks like "xxh3_128:<32 hex digits>".
    """
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    items.sort(key=lambda kv: kv[0])
    h = _hasher()
    prev = None
    for name, t in items:
        if name == prev:
            raise ValueError(f"duplicate tensor name {name!r} in checksum input")
        prev = name
        dtype = str(t.dtype).removeprefix("torch.")
        h.update(f"{name}\0{dtype}\0{tuple(t.shape)}\n".encode())
        h.update(tensor_bytes(t))
    return f"{_ALGO}:{h.hexdigest()}"


def payload_bytes(named_tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a weight payload as sent: the one definition behind the `weights/sync_bytes` metric."""
    return sum(t.numel() * t.element_size() for t in named_tensors.values())
