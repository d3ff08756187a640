"""Sharded publish (trainer.broadcast.sharded) on real gloo ranks: the policy a server assembles from
every rank's pieces is bit-identical to today's full export (same tensors, equal checksums) for the
tiny dense model (1 and 2 ranks, FSDP2), the tiny MoE under ep = 2 and LoRA (merged on each rank's
rows), with the checkpoint's streamed HF export equal too; delta sync per shard rebuilds each policy
exactly; over the collective every rank sends its own pieces and a receiver gets the same bytes; a
rank killed with SIGKILL mid-publish leaves no manifest, no announcement, and a directory every
loader refuses (files), or a failed receive (collective), while the last complete policy still loads.

A worker (this file run as a script on N ranks) builds each model, takes one optimizer step (so fp32
master weights differ from their bf16 cast), saves the gathered full export (``hf_named_tensors``, the
path every rank used to take) and publishes with ``PolicyPublisher(sharded=True)`` on a real bus."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

BUCKET_MB = 0.03  # ~31 KiB: several files per rank and embeddings cut into row pieces


def _model(kind: str, model_dir: str):
    import torch

    from hpcrl.models import parallelize as mp
    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model

    torch.manual_seed(0)
    if kind == "moe":
        from hpcrl.models.qwen3.parallelize import apply_ep

        model = load_model(model_dir, impl="custom")
        experts = apply_ep(model, 2, torch.device("cpu"))
        model = mp.apply_fsdp(model, ignored_params=experts)
    elif kind == "lora":
        model = load_model(model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # peft starts B at zero: the merge would change nothing
        model = mp.apply_fsdp(model)
    else:
        model = mp.apply_fsdp(load_model(model_dir))
    ids = torch.arange(3, 35).reshape(2, 16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    return model


def _worker(run_dir: str, out_dir: str, kill_after: str, transport: str, *models: str) -> None:
    import torch
    from safetensors.torch import save_file

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.model import hf_named_tensors
    from hpcrl.trainer.publish import PolicyPublisher

    env = par.init_distributed(torch.device("cpu"))
    paths = RunPaths(run_dir)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    group = None
    transport, _, port = transport.partition(":")
    if transport == "collective":  # every trainer rank is a sender; one receiver after them
        from hpcrl.weights.collective import init_group

        group = init_group(
            "127.0.0.1",
            int(port),
            env.world_size + 1,
            env.rank,
            backend="gloo",
            timeout_s=60,
            senders=env.world_size,
        )
    with Bus(paths, "trainer", env.rank) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, transport, keep=100, weight_group=group, bucket_mb=BUCKET_MB,
            dtype="bfloat16", sharded=True, shard_bucket_mb=BUCKET_MB,
        )  # fmt: skip
        for step, spec in enumerate(models):
            kind, model_dir = spec.split("=", 1)
            if kind == "delta":  # last: policies step.. step + 2, a full one then deltas per piece
                _delta_policies(pub, env.rank, model_dir, out_dir, step)
                break
            model = _model(kind, model_dir)
            full = {k: v.contiguous() for k, v in hf_named_tensors(model, dtype="bfloat16")}
            if env.rank == 0:
                save_file(full, str(Path(out_dir) / f"{kind}.safetensors"))
            del full
            pub.base_sent = False  # each model is a new trainer: its first policy goes in full
            if int(kill_after) >= 0 and step == len(models) - 1:
                _die_mid_publish(env.rank, int(kill_after), transport, out_dir)
            pub.publish(model, step)
            if transport == "filesystem":  # the checkpoint's HF export, streamed to rank 0 (no gather)
                from hpcrl.trainer.stream import export_hf_streamed

                export_hf_streamed(
                    model, None, str(Path(out_dir) / f"{kind}_export"), rank=env.rank, dtype="bfloat16",
                    max_shard_bytes=200_000,
                )  # fmt: skip
    par.barrier()
    par.destroy_distributed()


def _delta_policies(pub, rank: int, model_dir: str, out_dir: str, first: int) -> None:
    import torch
    from safetensors.torch import save_file

    from hpcrl.trainer.model import hf_named_tensors

    pub.delta, pub.base_sent = True, False
    model = _model("dense", model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)  # most bf16 bits stay
    ids = torch.arange(3, 35).reshape(2, 16)
    for k in range(3):
        if k:
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        full = {n: v.contiguous() for n, v in hf_named_tensors(model, dtype="bfloat16")}
        if rank == 0:
            save_file(full, str(Path(out_dir) / f"delta{first + k}.safetensors"))
        pub.publish(model, first + k)


def _die_mid_publish(rank: int, after: int, transport: str, out_dir: str) -> None:
    """Rank 1 SIGKILLs itself after writing (filesystem) or broadcasting (collective) `after` buckets
    of its pieces."""
    if rank != 1:
        return
    if transport == "collective":
        import hpcrl.weights.rounds as coll

        real_send, sent = coll.send_bucket, [0]

        def dying_send(*args, **kwargs):
            if sent[0] == after:
                (Path(out_dir) / "killed").write_text(f"after {after} bucket(s)")
                os.kill(os.getpid(), signal.SIGKILL)
            sent[0] += 1
            return real_send(*args, **kwargs)

        coll.send_bucket = dying_send
        return
    import hpcrl.weights.manifest as manifest

    real = manifest.buckets

    def dying(pieces, size):
        for i, b in enumerate(real(pieces, size)):
            if i == after:
                os.kill(os.getpid(), signal.SIGKILL)
            yield b

    manifest.buckets = dying


if __name__ == "__main__":
    _worker(*sys.argv[1:])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)


def _check_same(run: Path, out: Path, kinds: list[str], world: int) -> None:
    from safetensors.torch import load_file

    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.paths import RunPaths
    from hpcrl.weights.checksum import state_dict_checksum

    paths = RunPaths(run)
    for step, kind in enumerate(kinds):
        ref = load_file(str(out / f"{kind}.safetensors"))
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.checksum == state_dict_checksum(ref), kind  # the announced checksum is today's
        d = paths.broadcast_dir(step)
        assert sorted(p.name for p in d.glob("rank*.json")) == [f"rank{r:05d}.json" for r in range(world)]
        got = load_safetensors_dir(str(d))  # the server's reader: assembled, verified
        assert list(sorted(got)) == sorted(ref), kind
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch_equal_bits(got[name], t), (kind, name)
        assert state_dict_checksum(got) == msg.checksum
        export = load_safetensors_dir(str(out / f"{kind}_export"))  # HF dir: several files + index
        assert len(list((out / f"{kind}_export").glob("model-*.safetensors"))) > 1
        assert state_dict_checksum(export) == msg.checksum, kind
        if world > 1:  # every rank wrote a share, none the whole policy
            sizes = [
                sum(f.stat().st_size for f in d.glob(f"rank{r:05d}-*.safetensors")) for r in range(world)
            ]
            assert max(sizes) < 0.8 * sum(sizes), (kind, sizes)


def torch_equal_bits(a, b) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


@pytest.mark.timeout(300)
def test_sharded_policy_is_bit_identical_to_the_full_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    from hpcrl.models.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    one, two, out1, out2 = (tmp_path / n for n in ("run1", "run2", "out1", "out2"))
    out1.mkdir()
    out2.mkdir()
    run_ranks(__file__, 1, str(one), str(out1), "-1", "filesystem", f"dense={tiny_model_dir}")
    _check_same(one, out1, ["dense"], 1)
    run_ranks(
        __file__,
        2,
        str(two),
        str(out2),
        "-1",
        "filesystem",
        f"dense={tiny_model_dir}",
        f"moe={moe}",
        f"lora={tiny_model_dir}",
        f"delta={tiny_model_dir}",
    )
    _check_same(two, out2, ["dense", "moe", "lora"], 2)
    _check_deltas(two, out2, first=3)


@pytest.mark.timeout(300)
def test_rank_killed_mid_publish_leaves_no_partial_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.inference.protocol import APIError
    from hpcrl.paths import RunPaths

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    with pytest.raises(AssertionError, match=r"rank \d exited"):
        run_ranks(
            __file__,
            2,
            str(run),
            str(out),
            "1",
            "filesystem",
            f"dense={tiny_model_dir}",
            f"dense={tiny_model_dir}",
        )
    paths = RunPaths(run)
    assert paths.policy_file(0).exists() and not paths.policy_file(1).exists()  # nothing announced
    partial = paths.broadcast_dir(1)
    assert list(partial.glob("rank00001-*.safetensors")) and not (partial / "manifest.json").exists()
    with pytest.raises(APIError, match="did not complete"):
        load_safetensors_dir(str(partial))
    assert load_safetensors_dir(str(paths.broadcast_dir(0)))  # the last complete policy still loads


def _receiver(port: int, world: int, policies: int, got: list) -> None:
    """A server of the weight group (group rank `world - 1`): receive `policies` updates; each one is
    (checksum, tensors) or the exception its receive raised."""
    from hpcrl.weights.collective import init_group, receive_header, receive_tensors

    try:
        group = init_group("127.0.0.1", port, world, world - 1, backend="gloo", timeout_s=120)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        got.append(e)
        return
    for _ in range(policies):
        try:
            header = receive_header(group)
            got.append((header.checksum, receive_tensors(group, header)))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            got.append(e)
            return


@pytest.mark.timeout(300)
def test_collective_every_rank_sends_its_own_pieces(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Collective transport, sharded: both trainer ranks are members of the weight group and broadcast
    their own buckets (no rank forwards another's rows); a receiver in this process assembles exactly
    today's full export, checksum included, for the dense model, the tiny MoE under ep = 2 and LoRA."""
    import threading

    from safetensors.torch import load_file

    from hpcrl.models.tiny import build_tiny_model
    from hpcrl.net import free_port
    from hpcrl.weights.checksum import state_dict_checksum

    moe = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    port, got = free_port(), []
    t = threading.Thread(target=_receiver, args=(port, 3, 3, got), daemon=True)
    t.start()
    kinds = ["dense", "moe", "lora"]
    run_ranks(
        __file__, 2, str(run), str(out), "-1", f"collective:{port}",
        f"dense={tiny_model_dir}", f"moe={moe}", f"lora={tiny_model_dir}",
    )  # fmt: skip
    t.join(60)
    assert len(got) == 3 and not any(isinstance(g, BaseException) for g in got), got[-1:]
    for kind, (checksum, tensors) in zip(kinds, got, strict=True):
        ref = load_file(str(out / f"{kind}.safetensors"))
        assert checksum == state_dict_checksum(ref) == state_dict_checksum(tensors), kind
        assert sorted(tensors) == sorted(ref)
        assert all(torch_equal_bits(tensors[k], v) for k, v in ref.items()), kind


@pytest.mark.waits  # for the group's timeout
@pytest.mark.timeout(300)
def test_rank_killed_mid_broadcast_leaves_no_partial_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Collective transport: trainer rank 1 is SIGKILLed after broadcasting one bucket of policy 1. The
    receiver's update fails (nothing assembled is returned, so a server loads nothing) and policy 0,
    received whole before, is intact."""
    import threading

    from safetensors.torch import load_file

    from hpcrl.net import free_port
    from hpcrl.weights.checksum import state_dict_checksum

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    port, got = free_port(), []
    t = threading.Thread(target=_receiver, args=(port, 3, 2, got), daemon=True)
    t.start()
    with pytest.raises(AssertionError, match=r"rank \d exited"):  # rank 1 killed, rank 0 then fails
        run_ranks(
            __file__, 2, str(run), str(out), "1", f"collective:{port}",
            f"dense={tiny_model_dir}", f"dense={tiny_model_dir}",
        )  # fmt: skip
    t.join(150)  # a recv from the dead rank may only end at the group's timeout (120 s)
    assert (out / "killed").read_text() == "after 1 bucket(s)"  # SIGKILLed mid-broadcast, not a crash
    assert not t.is_alive() and len(got) == 2, got
    checksum, tensors = got[0]
    assert (
        checksum
        == state_dict_checksum(load_file(str(out / "dense.safetensors")))
        == state_dict_checksum(tensors)
    )
    assert isinstance(got[1], RuntimeError), got[1]  # the update of policy 1 failed: nothing to load


def _check_deltas(run: Path, out: Path, first: int) -> None:
    """trainer.broadcast.delta with the sharded publish: each rank encoded its own pieces against its
    own previous ones; a server merges the ranks' deltas per tensor and rebuilds each policy bit for
    bit (checksums equal to the full exports'), from a fraction of the bytes."""
    from safetensors.torch import load_file

    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.inference.loading import load_safetensors_dir, read_delta
    from hpcrl.paths import RunPaths
    from hpcrl.weights.checksum import state_dict_checksum
    from hpcrl.weights.delta import apply_delta

    paths = RunPaths(run)
    served = load_safetensors_dir(str(paths.broadcast_dir(first)))
    assert read_delta(str(paths.broadcast_dir(first))) is None  # the first is full
    for step in (first + 1, first + 2):
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.base_step == step - 1 and msg.sync_bytes < 0.2 * msg.num_bytes, (
            msg.sync_bytes,
            msg.num_bytes,
        )
        assert sorted(p.name for p in paths.broadcast_dir(step).glob("*.delta.safetensors")) == [
            "rank00000.delta.safetensors",
            "rank00001.delta.safetensors",
        ]
        delta = read_delta(str(paths.broadcast_dir(step)))
        base = read_message(paths.policy_file(step - 1), PolicyReady)
        assert delta is not None and delta.base_checksum == base.checksum
        apply_delta(served, delta)
        ref = load_file(str(out / f"delta{step}.safetensors"))
        assert state_dict_checksum(served) == msg.checksum == state_dict_checksum(ref)
