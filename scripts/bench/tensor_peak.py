"""Tensor-level peak memory of CPU code: the bytes of every live tensor storage, counted as torch
allocates and frees them (a ``TorchDispatchMode`` sees every op's outputs; a weak reference on each
storage sees it die; ``UntypedStorage.resize_``, which FSDP2 uses to free and re-allocate its gathered
parameters, is wrapped). The CPU analogue of CUDA's ``max_memory_allocated``, without the process's
Python, torch and allocator overheads that RSS includes; torch's ``MemTracker`` works the same way.

    with TensorPeak(tensors_alive_before) as tp:
        step()
    tp.peak_mib, tp.peak_top   # the peak and the largest storages alive at that moment

Used by scripts/bench/long_seq.py (``--tensors``)."""

from __future__ import annotations

import traceback
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 1024 * 1024


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta" or not isinstance(t, torch.Tensor):
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # a subclass without storage
        return []


class TensorPeak(TorchDispatchMode):
    """Live storage bytes, their peak, and what was alive at the peak (``top`` largest, labelled by
    the op that made them and, with ``where``, the source line of our code that ran it)."""

    def __init__(self, alive: list[torch.Tensor] = (), top: int = 60, where: bool = False):
        super().__init__()
        self.info: dict[int, list] = {}  # id(storage) -> [bytes, label]
        self.refs: dict[int, weakref.ref] = {}
        self.now = 0
        self.peak = 0
        self.peak_top: list[tuple[float, str]] = []
        self.top = top
        self.where = where
        self._resize = torch.UntypedStorage.resize_
        for t in alive:
            self._add(t, "before the step")
        self.start = self.now

    def _add(self, t: torch.Tensor, label: str) -> None:
        for st in _storages(t):
            key = id(st)
            if key in self.info:
                continue
            self.info[key] = [st.nbytes(), label]
            self.now += st.nbytes()
            self.refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))

    def _free(self, key: int) -> None:
        info = self.info.pop(key, None)
        self.refs.pop(key, None)
        if info is not None:
            self.now -= info[0]

    def _label(self, func: Any, t: torch.Tensor) -> str:
        label = f"{func.__name__} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        if self.where:
            for fr in reversed(traceback.extract_stack(limit=40)):
                if ("hpcrl/" in fr.filename or "transformers/" in fr.filename or "fsdp" in fr.filename) and (
                    "tensor_peak" not in fr.filename
                ):
                    label += f" @ {fr.filename.rsplit('/', 2)[-2:][-1]}:{fr.lineno} {fr.name}"
                    break
        return label

    def _check_peak(self) -> None:
        if self.now > self.peak:
            self.peak = self.now
            big = sorted(self.info.values(), key=lambda v: -v[0])[: self.top]
            self.peak_top = [(b / MIB, lab) for b, lab in big]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                for st in _storages(t):
                    if id(st) not in self.info:
                        self._add(t, self._label(func, t))
                    elif self.info[id(st)][0] != st.nbytes():  # grown in place
                        self.now += st.nbytes() - self.info[id(st)][0]
                        self.info[id(st)][0] = st.nbytes()
        self._check_peak()
        return out

    def __enter__(self):
        mode = self
        orig = self._resize

        def resize_(st, size):
            r = orig(st, size)
            info = mode.info.get(id(st))
            if info is not None and info[0] != st.nbytes():
                mode.now += st.nbytes() - info[0]
                info[0] = st.nbytes()
                mode._check_peak()
            return r

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    @property
    def peak_mib(self) -> float:
        return self.peak / MIB

    @property
    def start_mib(self) -> float:
        return self.start / MIB


def alive_in(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a trainer holds between steps: parameters, buffers, gradients and optimizer state."""
    out: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out
