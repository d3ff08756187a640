"""vLLM's GPU Worker, made to start on CPU: the only stand-in of the conformance tests' worker.

It subclasses the real `vllm.v1.worker.gpu_worker.Worker`, so vLLM's own init_worker checks the
extension against every attribute of the production class. Its __init__ runs vLLM's WorkerBase
__init__ and then, instead of a CUDA device and a GPUModelRunner, holds a real vLLM Qwen3 model built
on CPU behind `get_model()` (what GPUModelRunner offers the extension).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import WorkerBase


class _Runner:
    def __init__(self, model: torch.nn.Module):
        self._model = model

    def get_model(self) -> torch.nn.Module:
        return self._model


class CpuQwenWorker(Worker):
    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        WorkerBase.__init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

        self.device = torch.device("cpu")
        with torch.device("cpu"):
            self.model_runner = _Runner(Qwen3ForCausalLM(vllm_config=vllm_config))  # type: ignore[assignment]
