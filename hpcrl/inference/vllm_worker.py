"""The vLLM backend's weight transfer, inside every vLLM GPU worker: `--worker-extension-cls
hpcrl.inference.vllm_worker.HpcrlWorkerExtension` mixes these methods into the worker, and the API
server reaches them with `engine_client.collective_rpc(name, args=...)`, which runs between engine
steps, so an update lands between decode steps as with the hf backend. Weights come from a path
(full or delta, read through hpcrl.inference.loading) or over the trainer's weight group.

A quantized model (`inference.quantization`, e.g. fp8_per_block: vLLM's parameters are FP8 with
block scales) cannot take bf16 tensors through `load_weights` alone (slime #1679: "Downcasting not
allowed"). Its updates go through vLLM's layer-wise reload, as prime-rl's workers do (#3031):
`initialize_layerwise_reload(model)` restores each layer's bf16 parameters, `load_weights` fills
them, each layer is re-quantized as its last weight lands, and `finalize_layerwise_reload(model,
model_config)` processes what is left (attention scales), all under the worker's vllm config.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpcrl.storage import tolerate_std_streams

# vLLM imports this module in every worker process it starts (fork or spawn): whatever those write
# (a model's loading progress bar, vLLM's own log lines) to a log the disk refuses is dropped, never
# raised (hpcrl.storage). Their count is not the API server's: /metrics reports that process's only.
tolerate_std_streams()


def _vllm(name: str) -> Any:
    from hpcrl.inference.vllm_symbols import vllm_symbol

    return vllm_symbol(name)


@contextmanager
def layerwise_reload(model: Any, model_config: Any, vllm_config: Any, device: Any) -> Iterator[None]:
    """vLLM's layer-wise reload around the `load_weights` calls of one update (prime-rl's
    load_weights_checkpoint_layerwise). A failure midway skips the finalize: the update raises and the
    server's checksum stays "unverified", so it refuses to generate until a full update lands."""
    import torch

    with torch.device(device), _vllm("set_current_vllm_config")(vllm_config):
        _vllm("initialize_layerwise_reload")(model)
        yield
        _vllm("finalize_layerwise_reload")(model, model_config)


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

        model = self._hpcrl_model()
        with self._hpcrl_loading(model):
            model.load_weights(weights=list(tensors.items()))  # vLLM maps HF names onto fused params
        self._hpcrl_checksum = state_dict_checksum(tensors)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def _hpcrl_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _hpcrl_quantized(self) -> bool:
        """vLLM quantized the model it serves (online, `--quantization`, or an FP8 checkpoint)."""
        return getattr(getattr(self, "model_config", None), "quantization", None) is not None

    def _hpcrl_loading(self, model: Any) -> Any:
        """Around one update's `load_weights` calls: vLLM's layer-wise reload when the model is quantized."""
        if not self._hpcrl_quantized():
            from contextlib import nullcontext

            return nullcontext()
        return layerwise_reload(model, self.model_config, self.vllm_config, self.device)  # type: ignore[attr-defined]

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

        model = self._hpcrl_model()
        with self._hpcrl_loading(model):
            model.load_weights(weights=tensors())
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
        with self._hpcrl_loading(model):  # quantized: every round's load_weights inside one reload
            checksum = receive_into(group, header, sink)
        self._hpcrl_checksum = checksum  # type: ignore[attr-defined]
        return header.step, self._hpcrl_checksum, header.checksum  # type: ignore[attr-defined]
