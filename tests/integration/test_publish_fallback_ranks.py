"""The gathered publish and LoRA adapters over the collective transport, with two trainer ranks (real
gloo, CPU), when a server of the weight group dies: every rank must make the same writes and
collectives, in the same order, or one is left alone in a collective and the trainer hangs.

The weight group is a stand-in (group = object(); rank 0's broadcast and the others' relay are
replaced), as in test_refused_publish_ranks case E: what is tested is how the trainer ranks agree.

race: the orchestrator writes the fallback file while the policy is being gathered (the full-model
    gather takes seconds on a big model). The transport was decided once, by every rank, before the
    gather: policy 0 still goes over the collective on every rank; policy 1 goes as files on every
    rank. (It used to be decided again on rank 0 alone after the gather: rank 0 made two writes
    the others did not join and the ranks hung.)
lora: after the full policy 0, the broadcast of adapter 1 fails on rank 0 (a receiver died): every
    rank agrees, falls back to files and writes adapter 1 as files (same checksum as announced over
    the collective), and adapter 2 goes as files without a broadcast. Then, with the transport set
    back to collective and the fallback file written, adapter 3 goes as files on every rank without
    a broadcast (the dead server, told before the publish)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks


def _worker(mode: str, run_dir: str, out_dir: str, model_dir: str) -> None:
    import torch

    import hpcrl.trainer.publish as publish_mod
    import hpcrl.weights.collective as wc
    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.publish import PolicyPublisher

    env = par.init_distributed(torch.device("cpu"))
    paths, out = RunPaths(run_dir), Path(out_dir)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    seen: dict = {"rank": env.rank, "broadcasts": [], "relays": 0, "transports": []}
    fail_adapter = {"on": False}

    def broadcast(group, tensors, step, **kw):  # rank 0's send to the servers
        seen["broadcasts"].append({"step": step, "adapter": kw.get("adapter") is not None,
                                   "checksum": kw.get("checksum")})  # fmt: skip
        if fail_adapter["on"] and kw.get("adapter") is not None:
            raise RuntimeError("Connection closed by peer")  # what gloo raises when a receiver died

    def relay(group):  # the other ranks' part: the header
        seen["relays"] += 1

    wc.broadcast_weights, wc.relay, wc.destroy_group = broadcast, relay, lambda g: None

    def together(name: str, t0: float) -> None:
        """One collective, as the next step's would be: when did every rank get there."""
        t = torch.tensor([time.monotonic() - t0])
        got = [torch.zeros(1) for _ in range(env.world_size)]
        torch.distributed.all_gather(got, t)
        seen[f"{name}_arrived_s"] = [float(x.item()) for x in got]

    with Bus(paths, "trainer", env.rank, storage_timeout_s=10) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, "collective", keep=100, dtype="float32", sharded=False,
            storage_timeout_s=10,
        )  # fmt: skip
        pub.group = object()
        if mode == "race":
            model = torch.nn.Linear(4, 4)
            gather = publish_mod.hf_named_tensors

            def named(m, **kw):  # the orchestrator writes the fallback file during the gather
                if env.rank == 0 and not paths.weights_fallback_file.exists():
                    paths.weights_fallback_file.parent.mkdir(parents=True, exist_ok=True)
                    paths.weights_fallback_file.write_text("a server died\n")
                time.sleep(0.5)
                return gather(m, **kw)

            publish_mod.hf_named_tensors = named
            steps = [0, 1]
        else:
            from tests.integration.test_sharded_publish import _model

            model = _model("lora", model_dir)
            with torch.no_grad():  # an untrained adapter: the policies after the first are adapters
                for n, p in model.named_parameters():
                    if ".lora_B." in n:
                        p.zero_()
            steps = [0, 1, 2, 3]
        for step in steps:
            if mode == "lora" and step > 0:
                with torch.no_grad():  # what a training step does to the adapter (FSDP shards)
                    for n, p in model.named_parameters():
                        if ".lora_" in n:
                            p.mul_(1.1).add_(0.01 * step)
                fail_adapter["on"] = step == 1
                if step == 3:  # a dead server, told before the publish: files, no broadcast tried
                    pub.transport, pub.group = "collective", object()
                    if env.rank == 0:
                        paths.weights_fallback_file.write_text("a server died\n")
                    par.barrier()
            t0 = time.monotonic()
            pub.publish(model, step)
            seen["transports"].append(pub.transport)
            together(f"p{step}", t0)
    (out / f"rank{env.rank}.json").write_text(json.dumps(seen))
    par.barrier()
    par.destroy_distributed()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)


def _run(mode: str, tmp_path: Path, model_dir: str, timeout: float) -> tuple[dict, dict, Path]:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    run_ranks(__file__, 2, mode, str(run), str(out), model_dir, timeout=timeout)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    return r0, r1, run


@pytest.mark.timeout(180)
def test_fallback_file_written_during_the_gather_does_not_split_the_ranks(tmp_path: Path) -> None:
    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.paths import RunPaths

    # before the fix rank 0 hung in a collective the other rank never joined: killed at the timeout
    r0, r1, run = _run("race", tmp_path, "-", timeout=90)
    paths = RunPaths(run)
    for step in (0, 1):
        arrived = r0[f"p{step}_arrived_s"]
        assert abs(arrived[0] - arrived[1]) < 5.0, (step, arrived)
    # policy 0: decided (collective) before the gather on every rank, and sent that way
    assert read_message(paths.policy_file(0), PolicyReady).transport == "collective"
    assert [b["step"] for b in r0["broadcasts"]] == [0] and r1["relays"] == 1
    # policy 1: every rank saw the fallback before its gather and wrote files together
    msg = read_message(paths.policy_file(1), PolicyReady)
    assert msg.transport == "filesystem" and msg.path is not None
    assert (Path(msg.path) / "model.safetensors").is_file()
    assert r0["transports"] == r1["transports"] == ["collective", "filesystem"]


@pytest.mark.timeout(300)
def test_failed_adapter_broadcast_publishes_it_as_files_on_every_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.paths import RunPaths
    from hpcrl.weights.checksum import state_dict_checksum

    # before the fix the adapter broadcast's RuntimeError escaped publish() on rank 0
    r0, r1, run = _run("lora", tmp_path, str(tiny_model_dir), timeout=240)
    paths = RunPaths(run)
    for step in (0, 1, 2, 3):
        arrived = r0[f"p{step}_arrived_s"]
        assert abs(arrived[0] - arrived[1]) < 5.0, (step, arrived)
    full = read_message(paths.policy_file(0), PolicyReady)
    assert not full.adapter and full.transport == "collective"
    # rank 0 broadcast policy 0 and tried adapter 1; nothing after (files from then on)
    assert [(b["step"], b["adapter"]) for b in r0["broadcasts"]] == [(0, False), (1, True)]
    assert r1["relays"] == 2  # the header of policy 0 and of adapter 1
    sent = r0["broadcasts"][1]["checksum"]
    for step in (1, 2, 3):
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.adapter and msg.transport == "filesystem" and msg.path is not None, (step, msg)
        written = load_file(str(Path(msg.path) / "adapter_model.safetensors"))
        assert state_dict_checksum(written) == msg.checksum, step
        assert (Path(msg.path) / "adapter_config.json").is_file()
    # the files replace the collective announcement of the same tensors: same checksum
    assert read_message(paths.policy_file(1), PolicyReady).checksum == sent
    assert r0["transports"] == r1["transports"] == ["collective", "filesystem", "filesystem", "filesystem"]


@pytest.mark.timeout(300)
def test_one_rank_falls_back_without_a_collective(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One trainer rank (no process group): the same fallbacks, and not one torch.distributed call."""
    import torch
    import torch.distributed as dist

    import hpcrl.trainer.publish as publish_mod
    import hpcrl.weights.collective as wc
    from hpcrl.bus import Bus, PolicyReady, read_message
    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher

    def no_collective(*a, **k):
        raise AssertionError("a collective with one trainer rank")

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                 "barrier"):  # fmt: skip
        monkeypatch.setattr(dist, name, no_collective)
    sent: list[tuple[int, bool]] = []

    def broadcast(group, tensors, step, **kw):
        sent.append((step, kw.get("adapter") is not None))
        if kw.get("adapter") is not None:
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(wc, "broadcast_weights", broadcast)
    monkeypatch.setattr(wc, "relay", no_collective)
    monkeypatch.setattr(wc, "destroy_group", lambda g: None)
    paths = RunPaths(tmp_path / "run")
    paths.make_dirs()
    with Bus(paths, "trainer", 0) as bus:
        # the gathered path: the fallback file written during the gather still counts (rank 0 alone)
        pub = PolicyPublisher(paths, bus, 0, "collective", keep=100, dtype="float32")
        pub.group = object()
        gather = publish_mod.hf_named_tensors

        def named(m, **kw):
            paths.weights_fallback_file.write_text("a server died\n")
            return gather(m, **kw)

        monkeypatch.setattr(publish_mod, "hf_named_tensors", named)
        pub.publish(torch.nn.Linear(4, 4), 0)
        assert pub.transport == "filesystem" and sent == []
        assert read_message(paths.policy_file(0), PolicyReady).transport == "filesystem"
        monkeypatch.setattr(publish_mod, "hf_named_tensors", gather)
        paths.weights_fallback_file.unlink()
        # LoRA: policy 1 in full over the collective, adapter 2's broadcast fails: files from it on
        model = load_model(tiny_model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj",)))
        pub = PolicyPublisher(paths, bus, 0, "collective", keep=100, dtype="float32")
        pub.group = object()
        for step in (1, 2, 3):
            with torch.no_grad():  # policy 1 with an untrained adapter: the later ones are adapters
                for n, p in model.named_parameters():
                    if ".lora_" in n and step > 1:
                        p.add_(0.01)
            pub.publish(model, step)
    assert sent == [(1, False), (2, True)] and pub.transport == "filesystem"
    assert read_message(paths.policy_file(1), PolicyReady).transport == "collective"
    for step in (2, 3):
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.adapter and msg.transport == "filesystem" and msg.path is not None, msg
        assert (Path(msg.path) / "adapter_model.safetensors").is_file()
