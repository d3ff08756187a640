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

    def _hpcrl_load(self, tensors: dict[str, Any]) -> str:
        """Load full weights (HF names) from a file; the checksum is of the tensors load_weights read."""
        from hpcrl.weights.checksum import state_dict_checksum

        self._hpcrl_model().load_weights(
            weights=list(tensors.items())
        )  # vLLM maps HF names onto fused params
        self._hpcrl_checksum = state_dict_checksum(tensors)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def _hpcrl_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _hpcrl_load_sharded(self, path: str) -> str:
        """A sharded publish (hpcrl.weights.manifest): vLLM's `load_weights` takes the assembled tensors
        one at a time (each verified piece by piece; the policy checksum once the last is in), so the
        worker holds one tensor at a time on the host."""
        from hpcrl.weights.manifest import assemble, read_manifest

        m = read_manifest(path)
        seen = 0

        def tensors() -> Any:
            nonlocal seen
            for name, t in assemble(path, m):
                seen += 1
                yield name, t

        self._hpcrl_model().load_weights(weights=tensors())
        if seen != len(m.tensors):
            raise RuntimeError(f"vLLM's load_weights stopped before the last tensor of {path}")
        self._hpcrl_checksum = m.checksum  # type: ignore[attr-defined]
        return m.checksum

    def hpcrl_update_from_path(self, path: str, keep_base: bool = False) -> str:
        """Full weights from files. `keep_base` (a server started for delta sync) is refused: vLLM's
        parameters are fused, sharded over the TP workers and maybe quantized, so a delta in Hugging Face
        names has no base on a worker short of a whole copy of the policy (tp x P per server), which
        hpcrl does not keep (docs/weights.md, "Delta sync")."""
        from hpcrl.inference.loading import load_safetensors_dir, read_delta
        from hpcrl.weights.manifest import is_sharded

        if keep_base or read_delta(path) is not None:
            raise RuntimeError(
                "a weight delta cannot be applied by vLLM (fused, TP-sharded parameters: no base without a "
                "whole copy of the policy); set trainer.broadcast.delta = false"
            )
        if is_sharded(path):
            return self._hpcrl_load_sharded(path)
        return self._hpcrl_load(load_safetensors_dir(path))

    def hpcrl_update_collective(self, keep_base: bool = False) -> tuple[int, str, str | None]:
        """One update over the weight group: this worker's server receives each round once (worker 0
        from every trainer rank at once, worker w from worker w - 1, hpcrl.weights.rounds), and every
        worker hands `load_weights` whole tensors as they complete: a tensor that came in one part goes
        straight from the round buffer, one whose rows span rounds is assembled first. Memory: two
        round buffers and the tensors being assembled, on this worker's device; nothing of the policy is
        kept. Each part is digested on the device after load_weights read it: that is the verification."""
        from hpcrl.weights.collective import receive_header, receive_into
        from hpcrl.weights.rounds import Assembler, receive_rounds

        group = getattr(self, "_hpcrl_group", None)
        if group is None:
            raise RuntimeError("no weight broadcast group: call /init_broadcaster first")
        header = receive_header(group)
        if header.adapter is not None or header.delta is not None or keep_base:
            receive_rounds(
                group, header, None
            )  # received and forwarded (no peer is left hanging), then refused
            raise RuntimeError(
                "over the collective transport vLLM takes full weights only: a LoRA adapter goes as files "
                '(trainer.broadcast.transport = "filesystem", /load_lora_adapter); a delta not at all'
            )
        model = self._hpcrl_model()
        sink = Assembler(header, self.device, lambda done: model.load_weights(weights=done))  # type: ignore[attr-defined]
        self._hpcrl_checksum = "unverified"  # type: ignore[attr-defined]
        self._hpcrl_checksum = receive_into(group, header, sink)  # type: ignore[attr-defined]
        return header.step, self._hpcrl_checksum, header.checksum  # type: ignore[attr-defined]
