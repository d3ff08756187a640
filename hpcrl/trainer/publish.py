"""Publishing policy N: weights to the inference servers (files or a collective), then PolicyReady.

Filesystem transport: rank 0 writes broadcasts/step_N/model.safetensors (atomic dir rename) and then
publishes PolicyReady(path, checksum); servers load it when the orchestrator tells them to.
Collective transport: rank 0 publishes PolicyReady(transport="collective", checksum) and then
broadcasts the tensors (HF names, chunked) over the weight group the servers joined; the
orchestrator has them call /update_weights, which receives. Either way the checksum is computed
over exactly the tensors sent, and every server's checksum of what it loaded is compared to it.
Once the orchestrator reports a dead server (RunPaths.weights_fallback_file) rank 0 switches to
files for good: see hpcrl.orchestrator.policy.
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
                 weight_group: Any = None, bucket_mb: float = 256):
        assert transport in ("filesystem", "collective"), transport
        self.paths = paths
        self.bus = bus
        self.rank = rank
        self.transport = transport
        self.keep = max(2, keep)
        self.group = weight_group
        self.bucket_mb = bucket_mb
        self.last_bytes = 0
        self.base_sent = False

    def publish(self, model: torch.nn.Module, step: int) -> float:
        """Collective over trainer ranks (FSDP gathers). Returns seconds spent; `last_bytes` is what
        travelled (metric weights/sync_bytes)."""
        from hpcrl.trainer.model import is_peft_model

        # The first policy of a process goes in full (merged): the servers' base must be this trainer's
        # base (a warm start changes it); after that only the adapter changes.
        if is_peft_model(model) and self.transport == "filesystem" and self.base_sent:
            return self._publish_adapter(model, step)
        self.base_sent = True
        t0 = time.perf_counter()
        named = dict(hf_named_tensors(model))  # every rank iterates: shards are gathered
        if self.rank != 0:
            return time.perf_counter() - t0
        if self.transport == "collective" and self.paths.weights_fallback_file.exists():
            # A server died (the orchestrator says so): the group has a dead member and cannot take
            # in its restarted process, so every later policy travels as files.
            log.warning("a server of the weight group died: publishing policies as files from step %d on", step)
            self.transport = "filesystem"
            self._drop_group()
        checksum = state_dict_checksum(named)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        self.last_bytes = nbytes
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
            try:
                broadcast_weights(self.group, named, step, bucket_mb=self.bucket_mb, checksum=checksum)
            except RuntimeError as e:  # a receiver died mid-broadcast (gloo/NCCL: connection closed)
                log.warning("weight broadcast of policy %d failed (%s): publishing it and every later policy "
                            "as files", step, str(e).splitlines()[0][:200])
                self.transport = "filesystem"
                self._drop_group()  # survivors waiting for the rest of this broadcast fail at once
                path = self._write_files(step, named)  # same tensors, same checksum; replaces the message
                self.bus.publish_policy(PolicyReady(step=step, transport="filesystem", path=str(path),
                                                    checksum=checksum, num_params=nparams, num_bytes=nbytes))
                self._clean_behind(step)
        dt = time.perf_counter() - t0
        log.info("policy %d published (%s, %.1f MB, %.2fs, checksum %s)", step, self.transport, nbytes / 1e6, dt,
                 checksum[:12])
        return dt

    def _drop_group(self) -> None:
        from hpcrl.weights.collective import destroy_group

        if self.group is not None:
            destroy_group(self.group)
            self.group = None  # the last reference: gloo closes its connections

    def _publish_adapter(self, model: torch.nn.Module, step: int) -> float:
        """LoRA: only the adapter travels (peft format, what /load_lora_adapter reads in vLLM and the
        embedded engine); the checksum is over the tensors as written, which is what a server reports."""
        from safetensors.torch import load_file

        from hpcrl.trainer.model import save_adapter

        t0 = time.perf_counter()
        path = save_adapter(model, self.paths.broadcast_dir(step), write=self.rank == 0)  # collective under FSDP
        if self.rank != 0:
            return time.perf_counter() - t0
        tensors = load_file(str(path / "adapter_model.safetensors"))
        checksum = state_dict_checksum(tensors)
        self.last_bytes = sum(f.stat().st_size for f in path.iterdir())
        self.bus.publish_policy(PolicyReady(
            step=step, transport="filesystem", path=str(path), checksum=checksum, adapter=True,
            num_params=sum(t.numel() for t in tensors.values()), num_bytes=self.last_bytes))
        self._clean_behind(step)
        dt = time.perf_counter() - t0
        log.info("policy %d published (LoRA adapter, %.3f MB, %.2fs, checksum %s)", step, self.last_bytes / 1e6, dt,
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
