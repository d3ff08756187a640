"""Publishing policy N: weights to the inference servers (files or a collective), then PolicyReady.

Filesystem transport: rank 0 writes broadcasts/step_N/model.safetensors (atomic dir rename) and then
publishes PolicyReady(path, checksum); servers load it when the orchestrator tells them to.
Collective transport: rank 0 publishes PolicyReady(transport="collective", checksum) and then
broadcasts the tensors (HF names, chunked) over the weight group the servers joined; the
orchestrator has them call /update_weights, which receives. Either way the checksum is computed
over exactly the tensors sent, and every server's checksum of what it loaded is compared to it.
The tensors are in ``dtype``, the trainer's compute dtype (bf16 over fp32 master weights on GPU):
what inference runs, cast once here, so the checksum covers the bytes sent and not the master copy.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch

from hpcrl.bus import Bus, PolicyReady
from hpcrl.paths import RunPaths
from hpcrl.trainer.model import hf_named_tensors
from hpcrl.weights.checksum import state_dict_checksum

log = logging.getLogger("hpcrl.trainer")


class PolicyPublisher:
    def __init__(self, paths: RunPaths, bus: Bus, rank: int, transport: str, keep: int,
                 weight_group: Any = None, bucket_mb: float = 256, dtype: str | None = None):
        assert transport in ("filesystem", "collective"), transport
        self.paths = paths
        self.bus = bus
        self.rank = rank
        self.transport = transport
        self.keep = max(2, keep)
        self.group = weight_group
        self.bucket_mb = bucket_mb
        self.dtype = dtype

    def publish(self, model: torch.nn.Module, step: int) -> float:
        """Collective over trainer ranks (FSDP gathers). Returns seconds spent."""
        t0 = time.perf_counter()
        named = dict(hf_named_tensors(model, dtype=self.dtype))  # every rank iterates: shards are gathered
        if self.rank != 0:
            return time.perf_counter() - t0
        checksum = state_dict_checksum(named)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        nparams = sum(t.numel() for t in named.values())
        if self.transport == "filesystem":
            path = self._write_files(step, named)
            self.bus.publish_policy(PolicyReady(step=step, transport="filesystem", path=str(path), checksum=checksum,
                                                num_params=nparams, num_bytes=nbytes))
            self._clean_behind(step)
        else:
            from hpcrl.weights.collective import broadcast_weights

            self.bus.publish_policy(PolicyReady(step=step, transport="collective", path=None, checksum=checksum,
                                                num_params=nparams, num_bytes=nbytes))
            broadcast_weights(self.group, named, step, bucket_mb=self.bucket_mb, checksum=checksum)
        dt = time.perf_counter() - t0
        log.info("policy %d published (%s, %.1f MB, %.2fs, checksum %s)", step, self.transport, nbytes / 1e6, dt,
                 checksum[:12])
        return dt

    def _write_files(self, step: int, named: dict[str, torch.Tensor]):
        from safetensors.torch import save_file

        from hpcrl.trainer.model import atomic_dir

        final = self.paths.broadcast_dir(step)
        with atomic_dir(final) as tmp:  # the server never sees a half-written broadcast
            save_file({k: v.contiguous() for k, v in named.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
        return final

    def _clean_behind(self, step: int) -> None:
        """Keep the newest `keep` broadcasts: the orchestrator may still load a slightly older one."""
        for s in RunPaths.steps_in(self.paths.broadcasts_dir):
            if s <= step - self.keep:
                shutil.rmtree(self.paths.broadcast_dir(s), ignore_errors=True)
