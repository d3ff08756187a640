"""Processes of the tensor-parallel weight-group test (tests/integration/test_weight_group_tp.py).

    python -m tests.integration.tp_roles worker --rank R [--corrupt]
    python -m tests.integration.tp_roles trainer --run-dir D --model M --servers K --steps N

`worker` plays one vLLM GPU worker of a tp > 1 server: the real `HpcrlWorkerExtension` methods run
on a minimal worker object (rank, device cpu, model_runner.model.load_weights storing the tensors).
It answers JSON lines on stdin/stdout, one call at a time, the way vLLM's executor runs
`collective_rpc` on each worker. `--corrupt` makes its model alter what it loads (a bad shard).

`trainer` is trainer rank 0's real send path: it sizes and hosts the weight group from the servers'
announcements (`trainer_join_weight_group`) and publishes N policies with `PolicyPublisher`
(PolicyReady with the checksum, then the chunked broadcast).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class StandInModel:
    """What vLLM's model offers the extension: load_weights(weights) with (hf_name, tensor) pairs."""

    def __init__(self, corrupt: bool):
        self.weights: dict[str, Any] = {}
        self.corrupt = corrupt

    def load_weights(self, weights: list[tuple[str, Any]]) -> set[str]:
        for name, tensor in weights:
            if self.corrupt:
                tensor.view(-1)[:1].add_(1)  # a worker that mangles its shard while loading it
            self.weights[name] = tensor.clone()
        return set(self.weights)


def worker_main(rank: int, corrupt: bool) -> int:
    import torch

    from hpcrl.inference.vllm_worker import HpcrlWorkerExtension
    from hpcrl.weights.checksum import state_dict_checksum

    class StandInWorker(HpcrlWorkerExtension):
        def __init__(self) -> None:
            self.rank = rank
            self.device = torch.device("cpu")
            self.model_runner = SimpleNamespace(model=StandInModel(corrupt))

    worker = StandInWorker()
    extra = {  # what the test asks beyond the extension: what this worker really holds
        "stored_checksum": lambda: state_dict_checksum(worker.model_runner.model.weights),
        "group_rank": lambda: [worker._hpcrl_group.rank, worker._hpcrl_group.world_size],
    }
    for line in sys.stdin:
        call = json.loads(line)
        try:
            fn = extra.get(call["method"]) or getattr(worker, call["method"])
            reply = {"result": fn(*call.get("args", []))}
        except Exception as e:  # noqa: BLE001 - reported to the caller, like vLLM's executor does
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


def trainer_main(run_dir: Path, model_dir: Path, servers: int, steps: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.weights.collective import destroy_group
    from hpcrl.weights.rendezvous import trainer_join_weight_group

    paths = RunPaths(run_dir)
    bus = Bus(paths, role="trainer", rank=0)
    group = trainer_join_weight_group(paths, bus, servers, timeout_s=120)
    # A small bucket: the payload crosses several chunks, some inside one tensor, some spanning many.
    publisher = PolicyPublisher(paths, bus, 0, "collective", keep=2, weight_group=group, bucket_mb=0.05)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)  # new weights every step
        publisher.publish(model, step)
    destroy_group(group)
    bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tp_roles")
    sub = p.add_subparsers(dest="role", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--corrupt", action="store_true")
    t = sub.add_parser("trainer")
    t.add_argument("--run-dir", type=Path, required=True)
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--servers", type=int, required=True)
    t.add_argument("--steps", type=int, default=1)
    args = p.parse_args(argv)
    if args.role == "worker":
        return worker_main(args.rank, args.corrupt)
    return trainer_main(args.run_dir, args.model, args.servers, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
