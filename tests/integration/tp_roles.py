"""Processes of the tensor-parallel weight-group test (tests/integration/test_weight_group_tp.py).

    python -m tests.integration.tp_roles worker --rank R [--corrupt] [--die-at-round K]
    python -m tests.integration.tp_roles trainer --run-dir D --model M --servers K --steps N [--bucket-mb B]

`worker` plays one vLLM GPU worker of a tp > 1 server: the real `HpcrlWorkerExtension` methods run
on a minimal worker object (rank, device cpu, model_runner.model.load_weights storing the tensors).
It answers JSON lines on stdin/stdout, one call at a time, the way vLLM's executor runs
`collective_rpc` on each worker. `--corrupt` makes its model alter what it loads (a bad shard);
`--die-at-round K` makes it exit (as a killed process does) when round K of an update lands. Around each
collective update it records what the test checks: the largest tensor the Python side allocated with
torch.empty, the growth of its peak resident memory, and the group's byte counters.

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
            if name in self.weights:  # into the parameter it already has, as vLLM's loaders copy
                self.weights[name].copy_(tensor)
            else:
                self.weights[name] = tensor.clone()
        return set(self.weights)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker_main(rank: int, corrupt: bool, die_at_round: int | None = None) -> int:
    import os

    import torch

    import hpcrl.weights.rounds as rounds
    from hpcrl.inference.vllm_worker import HpcrlWorkerExtension
    from hpcrl.weights.checksum import state_dict_checksum

    class StandInWorker(HpcrlWorkerExtension):
        def __init__(self) -> None:
            self.rank = rank
            self.device = torch.device("cpu")
            self.model_runner = SimpleNamespace(model=StandInModel(corrupt))

    worker = StandInWorker()
    report: dict[str, Any] = {}
    real_empty = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> Any:
        t = real_empty(*args, **kwargs)
        report["largest_empty"] = max(report.get("largest_empty", 0), t.numel() * t.element_size())
        return t

    if die_at_round is not None:
        real_land = rounds._Round.parts

        def dying_parts(self: Any) -> Any:
            if self.k == die_at_round:
                os._exit(9)  # as a killed worker: no goodbye to its peers
            return real_land(self)

        rounds._Round.parts = dying_parts

    def update(*args: Any) -> Any:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident memory (VmHWM) to the current
        before, report["largest_empty"] = _rss_kib("VmRSS"), 0
        torch.empty = counting_empty
        try:
            return worker.hpcrl_update_collective(*args)
        finally:
            torch.empty = real_empty
            report["peak_growth"] = (_rss_kib("VmHWM") - before) * 1024
            report["stats"] = dict(worker._hpcrl_group.stats)

    def dump(path: str) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in worker.model_runner.model.weights.items()}, path)

    extra = {  # what the test asks beyond the extension: what this worker really holds
        "stored_checksum": lambda: state_dict_checksum(worker.model_runner.model.weights),
        "group_rank": lambda: [worker._hpcrl_group.rank, worker._hpcrl_group.world_size],
        "hpcrl_update_collective": update,
        "last_update": lambda: report,
        "dump": dump,
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


def trainer_main(
    run_dir: Path, model_dir: Path, servers: int, steps: int, bucket_mb: float = 0.05, timeout: float = 120
) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.weights.collective import destroy_group
    from hpcrl.weights.rendezvous import trainer_join_weight_group

    paths = RunPaths(run_dir)
    bus = Bus(paths, role="trainer", rank=0)
    group = trainer_join_weight_group(paths, bus, servers, timeout_s=timeout)
    # A small bucket: the payload crosses several rounds, some inside one tensor, some spanning many.
    publisher = PolicyPublisher(paths, bus, 0, "collective", keep=2, weight_group=group, bucket_mb=bucket_mb)
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
    w.add_argument("--die-at-round", type=int, default=None)
    t = sub.add_parser("trainer")
    t.add_argument("--run-dir", type=Path, required=True)
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--servers", type=int, required=True)
    t.add_argument("--steps", type=int, default=1)
    t.add_argument("--bucket-mb", type=float, default=0.05)
    t.add_argument("--timeout", type=float, default=120)
    args = p.parse_args(argv)
    if args.role == "worker":
        return worker_main(args.rank, args.corrupt, args.die_at_round)
    return trainer_main(args.run_dir, args.model, args.servers, args.steps, args.bucket_mb, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
