"""The vLLM backend's weight transfer, inside every vLLM GPU worker: `--worker-extension-cls
hpcrl.inference.vllm_worker.HpcrlWorkerExtension` mixes these methods into the worker, and the API
server reaches them with `engine_client.collective_rpc(name, args=...)`, which runs between engine
steps, so an update lands between decode steps as with the hf backend. Weights come from a path
(full or delta, read through hpcrl.inference.loading) or over the trainer's weight group.
"""

from typing import Any


class HpcrlWorkerExtension:
    """Mixed into vLLM's GPU worker (`self` is the worker: WORKER_ATTRS exist there)."""

    def hpcrl_worker_rank(self) -> int:
        """This worker's rank in its server (0 .. tp x pp - 1): the router counts receivers with it."""
        return self.rank  # type: ignore[attr-defined]

    def hpcrl_init_broadcaster(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        timeout: float,
        join_timeout: float | None = None,
    ) -> None:
        from hpcrl.weights.collective import init_group

        backend = "nccl" if self.device.type == "cuda" else "gloo"  # type: ignore[attr-defined]
        # Every worker of this server (one per tensor-parallel rank) joins with its own rank:
        # the group counts them all (hpcrl.weights.rendezvous.group_layout).
        self._hpcrl_group = init_group(
            host,
            port,
            world_size,
            rank_offset + self.rank,  # type: ignore[attr-defined]
            backend=backend,
            timeout_s=timeout,
            join_timeout_s=join_timeout,
        )

    def _hpcrl_load(self, tensors: dict[str, Any], keep_base: bool) -> str:
        """Load full weights (HF names). With `keep_base` (the server was started for delta sync:
        trainer.broadcast.delta) keep them as the base of later deltas, where they arrived: host memory
        from a path, the worker's device from a broadcast; else they are dropped once loaded."""
        from hpcrl.weights.checksum import state_dict_checksum

        self._hpcrl_model().load_weights(
            weights=list(tensors.items())
        )  # vLLM maps HF names onto fused params
        self._hpcrl_full = tensors if keep_base else None  # type: ignore[attr-defined]
        self._hpcrl_checksum = state_dict_checksum(tensors)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def _hpcrl_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _hpcrl_apply_delta(self, delta: Any) -> str:
        """Apply a delta sync. vLLM fuses (qkv_proj, gate_up_proj) and shards parameters, so the delta is
        applied to this worker's copy of the last full HF-named weights (bit-exact: new bits written
        where they changed), the touched tensors are loaded through vLLM's own `load_weights` (a copy
        into the fused slices, exact as for a full load), and the checksum is over the whole copy.
        The cost: one unsharded copy of the weights per worker (host memory for filesystem syncs, device
        memory for broadcasts) — fine for 7B, not for 70B at tp=8: keep delta off there."""
        from hpcrl.weights.checksum import state_dict_checksum
        from hpcrl.weights.delta import apply_delta

        full = getattr(self, "_hpcrl_full", None)
        if full is None and getattr(self, "_hpcrl_checksum", None) is not None:
            raise RuntimeError(
                "weight delta refused: this server keeps no base for deltas (started without "
                "trainer.broadcast.delta / --delta-base): a full update is needed"
            )
        if full is None or getattr(self, "_hpcrl_checksum", None) != delta.base_checksum:
            raise RuntimeError(
                f"weight delta applies to policy {delta.base_step}; this worker holds another "
                "(or no) policy: a full update is needed"
            )
        touched = apply_delta(full, delta)
        self._hpcrl_model().load_weights(weights=[(n, full[n]) for n in touched])
        self._hpcrl_checksum = state_dict_checksum(full)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def _hpcrl_load_sharded(self, path: str, keep_base: bool) -> str:
        """A sharded publish (hpcrl.weights.manifest): vLLM's `load_weights` takes the assembled tensors
        one at a time (each verified piece by piece; the policy checksum once the last is in), so the
        worker holds one tensor at a time on the host; with `keep_base` (delta sync) the tensors are
        kept as the base of later deltas (tp x P of host memory per server)."""
        from hpcrl.weights.manifest import assemble, read_manifest

        m = read_manifest(path)
        full: dict[str, Any] = {}
        seen = 0

        def tensors() -> Any:
            nonlocal seen
            for name, t in assemble(path, m):
                seen += 1
                if keep_base:
                    full[name] = t
                yield name, t

        self._hpcrl_model().load_weights(weights=tensors())
        if seen != len(m.tensors):
            raise RuntimeError(f"vLLM's load_weights stopped before the last tensor of {path}")
        self._hpcrl_full = full if keep_base else None  # type: ignore[attr-defined]
        self._hpcrl_checksum = m.checksum  # type: ignore[attr-defined]
        return m.checksum

    def hpcrl_update_from_path(self, path: str, keep_base: bool = True) -> str:
        from hpcrl.inference.loading import load_safetensors_dir, read_delta
        from hpcrl.weights.manifest import is_sharded

        delta = read_delta(path)  # one file, or every trainer rank's pieces merged per tensor
        if delta is not None:  # applied where the base lives (apply_delta moves the few changed values)
            return self._hpcrl_apply_delta(delta)
        if is_sharded(path):
            return self._hpcrl_load_sharded(path, keep_base)
        return self._hpcrl_load(load_safetensors_dir(path), keep_base)

    def hpcrl_update_collective(self, keep_base: bool = True) -> tuple[int, str, str | None]:
        from hpcrl.weights.collective import receive_header, receive_tensors
        from hpcrl.weights.delta import Delta

        group = getattr(self, "_hpcrl_group", None)
        if group is None:
            raise RuntimeError("no weight broadcast group: call /init_broadcaster first")
        header = receive_header(group)
        tensors = receive_tensors(group, header, device=self.device)  # type: ignore[attr-defined]
        if header.adapter is not None:  # received (the sender is not left hanging), then refused
            raise RuntimeError(
                "a LoRA adapter over the collective transport is merged by the hf backend only; "
                'with vllm use trainer.broadcast.transport = "filesystem" (/load_lora_adapter)'
            )
        if header.delta is not None:
            return (
                header.step,
                self._hpcrl_apply_delta(Delta.from_manifest(header.delta, tensors)),
                header.checksum,
            )
        return header.step, self._hpcrl_load(tensors, keep_base), header.checksum
