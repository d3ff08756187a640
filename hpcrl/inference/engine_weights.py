"""The embedded engine's full weight updates (from tensors, a path, or a stream of parts arriving a
bucket at a time over the weight group) and delta syncs, mixed into HFEngine (hpcrl.inference.engine).

Every update holds `_update_lock` (one at a time) and writes the parameters under `_weights_lock`
(between two decode steps); the checksum it returns is of what landed in the parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.inference.errors import InvalidRequest, WeightSyncRefused
from hpcrl.inference.fp8 import fake_quant_params
from hpcrl.inference.loading import check_compatible, load_safetensors_dir, read_delta
from hpcrl.inference.protocol import APIError
from hpcrl.weights.checksum import state_dict_checksum
from hpcrl.weights.delta import Delta, apply_delta


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidRequest(f"unknown dtype {name!r} in a weight update")
    return dt


class EngineWeights:
    """Mixed into HFEngine: `self` has _params (HF name -> parameter view), _update_lock, _weights_lock,
    policy_step, checksum, _weight_names and the LoRA state (_lora_base, lora_adapters, lora_checksum)."""

    _params: dict[str, torch.Tensor]
    _update_lock: Any
    _weights_lock: Any
    _weight_names: list[str]
    _lora_base: dict[str, torch.Tensor]
    lora_adapters: dict[str, str]
    lora_checksum: str | None
    policy_step: int
    checksum: str
    quantization: str | None

    def update_weights(self, tensors: dict[str, torch.Tensor], step: int) -> str:
        """Copy `tensors` (HF names) into the model between two decode steps; return the loaded checksum.

        The checksum is computed from the model's own parameters after the copy, cast to each incoming
        tensor's dtype, so it equals the sender's checksum only if the bytes really landed.
        """
        check_compatible(self._params, tensors)
        with self._update_lock:
            with self._weights_lock:
                for name, t in tensors.items():
                    self._params[name].copy_(t)
                self.policy_step = int(step)
                self._lora_base.clear()  # a full update replaces any merged adapter
                self.lora_adapters.clear()
                self.lora_checksum = None
                if self.quantization is not None:  # verify what landed, then quantize (as vLLM does)
                    self.checksum = self._landed_checksum(tensors)
                    fake_quant_params(self._params, self.quantization)
            if self.quantization is None:
                self.checksum = self._landed_checksum(tensors)
            self._weight_names = list(tensors)
            return self.checksum

    def _landed_checksum(self, tensors: dict[str, torch.Tensor]) -> str:
        return state_dict_checksum({n: self._params[n].to(tensors[n].dtype) for n in tensors})

    def update_weights_streamed(
        self, layout: list[tuple[str, str, tuple[int, ...]]], step: int, receive: Any
    ) -> str:
        """A full update that arrives a bucket at a time (the collective transport): `receive(sink,
        rows)` receives large parts straight into `rows(name, row0, n)` (the parameter's own rows),
        hands every part to `sink`, which copies the small ones in (no staging copy of the policy), and
        returns the checksum of what landed (each part digested in the parameter it was written to). Generation waits meanwhile (the weights lock). A failure midway leaves the weights
        half written: the checksum says "unverified" and the server refuses to generate (sync_error)
        until a good update lands."""
        meta = {n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, d, s in layout}
        check_compatible(self._params, meta, finite=False)
        nonfinite: list[str] = []

        def rows(name: str, row0: int, n: int) -> torch.Tensor:
            p = self._params[name]
            return p if p.dim() == 0 else p[row0 : row0 + n]

        def sink(parts: list[tuple[str, int, torch.Tensor]]) -> list[torch.Tensor]:
            landed = []
            for name, row0, view in parts:
                dst = rows(name, row0, view.shape[0] if view.dim() else 1)
                if view.is_floating_point() and not nonfinite and not bool(torch.isfinite(view).all()):
                    nonfinite.append(name)
                if dst.data_ptr() != view.data_ptr():  # a large part landed in place already
                    dst.copy_(view)
                landed.append(dst if dst.dtype == view.dtype else view)
            return landed

        with self._update_lock, self._weights_lock:
            self.checksum = "unverified"  # until every part landed and verified
            checksum = receive(sink, rows)
            if nonfinite:
                raise WeightSyncRefused(
                    f"tensor {nonfinite[0]!r} holds NaN or inf values; the weights are unverified"
                )
            self.policy_step = int(step)
            self._lora_base.clear()  # a full update replaces any merged adapter
            self.lora_adapters.clear()
            self.lora_checksum = None
            fake_quant_params(self._params, self.quantization)  # each part was verified as it landed
            self.checksum = checksum
            self._weight_names = [n for n, _, _ in layout]
            return checksum

    def update_weights_from_path(self, path: str, step: int) -> str:
        """Full weights or a delta from a path. A sharded publish (manifest.json) streams: each tensor
        is assembled from its pieces (verified piece by piece, the policy checksum at the end) and
        copied into its parameter before the next is read, so the server holds one tensor beyond its
        parameters, not the policy; a failure midway leaves the weights unverified (refused)."""
        from hpcrl.inference import files
        from hpcrl.weights.manifest import assemble, is_sharded, read_manifest

        delta = read_delta(path)  # resolves `path`: a bad one is a 400 before anything is read
        if delta is not None:
            return self.apply_delta(delta, step)
        if not is_sharded(files.resolve(path, "path")):
            return self.update_weights(load_safetensors_dir(path), step)
        try:
            m = read_manifest(path)
        except (OSError, ValueError) as e:
            raise APIError(
                f"cannot load the sharded policy under {files.show(path)}: {e}", param="path"
            ) from e
        layout = [(n, e.dtype, tuple(e.shape)) for n, e in sorted(m.tensors.items())]

        def receive(sink: Any, rows: Any) -> str:
            try:
                for name, t in assemble(path, m):
                    sink([(name, 0, t)])
            except (OSError, ValueError) as e:
                raise APIError(
                    f"cannot load the sharded policy under {files.show(path)}: {e}", param="path"
                ) from e
            return m.checksum

        return self.update_weights_streamed(layout, step, receive)

    def apply_delta(self, delta: Delta, step: int) -> str:
        """Apply a delta sync to the served weights in place; return the checksum of the FULL result.

        Exact: changed elements are written with their new bits (the engine's dtype holds the sent
        dtype's values exactly, or equals it). Refused (nothing changes) unless the served weights are
        exactly the delta's base: same checksum, no LoRA merged in."""
        if self.lora_adapters:
            raise WeightSyncRefused(
                "a weight delta cannot apply on top of a merged LoRA adapter; send a full update"
            )
        if self.quantization is not None:
            raise WeightSyncRefused("a weight delta cannot apply to quantized weights; send a full update")
        with self._update_lock:
            if self.checksum != delta.base_checksum or set(self._weight_names) != set(delta.layout):
                raise WeightSyncRefused(
                    f"weight delta for step {step} applies to policy {delta.base_step} "
                    f"({delta.base_checksum[:20]}), this server holds step {self.policy_step} "
                    f"({self.checksum[:20]}): a full update is needed"
                )
            with self._weights_lock:
                try:
                    apply_delta(self._params, delta)
                except ValueError as e:  # some tensors may be written already: nothing verified is served
                    self.checksum = "unverified"
                    raise WeightSyncRefused(str(e)) from e
                self.policy_step = int(step)
            loaded = {n: self._params[n].to(_dtype_of(d)) for n, (d, _, _) in delta.layout.items()}
            self.checksum = state_dict_checksum(loaded)
            return self.checksum
