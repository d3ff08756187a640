"""Weight updates of a live hf server: from a path, over gloo, verified by checksum; pause; LoRA."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from hpcrl.inference.client import InferenceClient, WeightSyncError  # noqa: E402
from hpcrl.net import free_port  # noqa: E402
from hpcrl.weights.checksum import ALGO, state_dict_checksum  # noqa: E402
from hpcrl.weights.collective import broadcast_weights, init_group, receive_weights  # noqa: E402

MSGS = [{"role": "user", "content": "Sort: d c b a"}]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import InferenceServer

    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("weights_run"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hpcrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("other_weights")
    return {seed: build_tiny_model(root / f"seed{seed}", seed=seed) for seed in (1, 2)}


def load_sd(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


async def greedy(c: InferenceClient) -> dict:
    r = await c.chat_completion(MSGS, **GREEDY)
    ch = r["choices"][0]
    # Random tiny models often repeat one token greedily: compare logprobs too, not only tokens.
    return {
        "tokens": ch["token_ids"],
        "steps": ch["policy_steps"],
        "out": (ch["token_ids"], [round(x["logprob"], 5) for x in ch["logprobs"]["content"]]),
    }


def test_collective_protocol_round_trip() -> None:
    """Odd bucket sizes (chunks inside one tensor and across several), bf16, int and 0-dim tensors."""
    sd = {
        "w": torch.randn(37, 11),
        "b": torch.randn(5).bfloat16(),
        "i": torch.arange(9),
        "s": torch.tensor(2.5),
        "big": torch.randn(70_000),
    }

    def receiver(port: int, got: dict) -> None:
        got["out"] = receive_weights(init_group("127.0.0.1", port, 2, 1, timeout_s=30))

    for bucket_mb in (1e-4, 0.05, 16):
        port, got = free_port(), {}
        recv = threading.Thread(target=receiver, args=(port, got))
        recv.start()
        group = init_group("127.0.0.1", port, 2, 0, timeout_s=30)
        broadcast_weights(group, sd, step=7, bucket_mb=bucket_mb)
        recv.join(30)
        step, tensors = got["out"]
        assert step == 7 and list(tensors) == list(sd)
        assert all(tensors[k].dtype == sd[k].dtype and torch.equal(tensors[k], sd[k]) for k in sd)
        assert state_dict_checksum(tensors) == state_dict_checksum(sd)


def test_checksum_sees_names_dtypes_shapes_and_bytes() -> None:
    sd = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    ck = state_dict_checksum(sd)
    assert ck == state_dict_checksum(list(reversed(list(sd.items()))))  # order-independent
    assert ck != state_dict_checksum({"a2": sd["a"], "b": sd["b"]})
    assert ck != state_dict_checksum({"a": sd["a"].double(), "b": sd["b"]})
    assert ck != state_dict_checksum({"a": sd["a"].reshape(3, 2), "b": sd["b"]})
    bumped = sd["a"].clone()
    bumped[1, 2] = 1.0000001
    assert ck != state_dict_checksum({"a": bumped, "b": sd["b"]})


def test_update_from_path_changes_outputs_and_checksum(server, other_weights) -> None:
    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            start = await c.weights()
            before = await greedy(c)
            expected = state_dict_checksum(load_sd(other_weights[1]))
            r = await c.update_weights(
                start["step"] + 1, path=str(other_weights[1]), expected_checksum=expected
            )
            assert r["checksum"] == expected != start["checksum"]
            after = await greedy(c)
            assert after["out"] != before["out"] and after["steps"] == [start["step"] + 1]
            assert (await c.weights())["checksum"] == expected

    asyncio.run(run())


def test_update_over_gloo_changes_outputs_and_checksum(server, other_weights) -> None:
    sd = load_sd(other_weights[2])
    expected = state_dict_checksum(sd)

    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            before = await greedy(c)
            step = (await c.weights())["step"] + 1
            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(init_group, "127.0.0.1", port, 2, 0, timeout_s=60),
                c.init_broadcaster("127.0.0.1", port, 2, 1, timeout=60),
            )
            _, r = await asyncio.gather(
                asyncio.to_thread(broadcast_weights, group, sd, step, bucket_mb=0.25, checksum=expected),
                c.update_weights(step, collective=True, expected_checksum=expected),
            )
            assert r["checksum"] == expected
            after = await greedy(c)
            assert after["out"] != before["out"] and after["steps"] == [step]
            assert (await c.weights()) | {"checksum": expected} == await c.weights()

    asyncio.run(run())


def test_corrupt_bucket_fails_the_update_naming_it_and_refuses_to_serve(server, other_weights) -> None:
    """Protocol 4: a part whose bytes differ from what the sender hashed (flipped after hashing) fails
    the update with 409 naming the round, its sender and the part. The parts land in the parameters
    as they arrive (no staging copy of the policy), so the half-written weights are not served: the
    server answers 503 until the next good broadcast loads."""
    from hpcrl.weights import collective as coll
    from hpcrl.weights.rounds import send_rounds
    from hpcrl.weights.shards import full_piece

    sd = {k: v.clone() for k, v in load_sd(other_weights[1]).items()}

    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            before = await c.weights()
            step = before["step"] + 1
            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(init_group, "127.0.0.1", port, 2, 0, timeout_s=60),
                c.init_broadcaster("127.0.0.1", port, 2, 1, timeout=60),
            )
            bkts = coll.plan_buckets((full_piece(n, t) for n, t in sd.items()), 64 * 1024)
            rounds = coll.schedule([coll.bucket_records(bkts)])
            tensors, checksum = coll.layout_and_checksum(rounds)
            header = coll.make_header(step, 64 * 1024, checksum, tensors, rounds, servers=[(1, 1)])
            bad = bkts[3][-1]
            bad.tensor.view(-1)[-1] += 1  # after hashing: the wire carries other bytes than the digest's

            def send() -> None:
                coll.send_header(group, header)
                send_rounds(group, coll._parse_header(header), bkts)

            with pytest.raises(WeightSyncError) as e:
                await asyncio.gather(asyncio.to_thread(send), c.update_weights(step, collective=True))
            where = f"round 3 from sender rank 0: {bad.name} rows {bad.row0}..{bad.row0 + bad.rows}"
            assert where in str(e.value), str(e.value)
            assert (await c.health())["status"] == "weights_unverified"
            r = await c._http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 503 and "failed verification" in r.json()["error"]["message"]
            bad.tensor.view(-1)[-1] -= 1
            _, r = await asyncio.gather(
                asyncio.to_thread(broadcast_weights, group, sd, step, bucket_mb=0.25, checksum=checksum),
                c.update_weights(step, collective=True, expected_checksum=checksum),
            )
            assert r["checksum"] == checksum == state_dict_checksum(sd)
            assert (await c.health())["status"] == "ok"

    asyncio.run(run())


def test_checksum_mismatch_is_loud_until_a_good_update(server, other_weights) -> None:
    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            step = (await c.weights())["step"] + 1
            with pytest.raises(WeightSyncError, match="checksum"):
                await c.update_weights(step, path=str(other_weights[1]), expected_checksum="xxh3_128:00")
            assert (await c.health())["status"] == "weights_unverified"
            r = await c._http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 503 and "failed verification" in r.json()["error"]["message"]
            good = state_dict_checksum(load_sd(other_weights[1]))
            await c.update_weights(step + 1, path=str(other_weights[1]), expected_checksum=good)
            assert (await c.health())["status"] == "ok"
            assert (await greedy(c))["steps"] == [step + 1]

    asyncio.run(run())


def test_update_lands_between_decode_steps(server, other_weights) -> None:
    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            step = (await c.weights())["step"]
            long = asyncio.create_task(c.chat_completion(MSGS, max_tokens=600, ignore_eos=True))
            while (await c.health())["running"] == 0:
                await asyncio.sleep(0.01)
            await c.update_weights(step + 1, path=str(other_weights[2]))
            r = await long
            assert r["choices"][0]["policy_steps"] == [step, step + 1]
            assert len(r["choices"][0]["token_ids"]) == 600

    asyncio.run(run())


def test_pause_holds_requests_until_resume(server) -> None:
    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            await c.pause()
            task = asyncio.create_task(c.chat_completion(MSGS, max_tokens=4))
            await asyncio.sleep(0.3)
            h = await c.health()
            assert not task.done() and h["paused"] and h["waiting"] == 1
            await c.resume()
            assert len((await task)["choices"]) == 1

    asyncio.run(run())


def test_lora_adapter_is_merged_and_listed(server, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    g = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(2, 128, generator=g),
            f"{prefix}.lora_B.weight": torch.randn(128, 2, generator=g),
        },
        str(adapter / "adapter_model.safetensors"),
    )

    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            before = await greedy(c)
            r = await c.load_lora_adapter("reverse-lora", str(adapter))
            assert r["checksum"].startswith(ALGO + ":")
            assert "reverse-lora" in [m["id"] for m in await c.models()]
            after = await c.chat_completion(MSGS, model="reverse-lora", **GREEDY)
            lps = [round(x["logprob"], 5) for x in after["choices"][0]["logprobs"]["content"]]
            assert (after["choices"][0]["token_ids"], lps) != before["out"]
            bad = httpx.post(
                f"{server.base_url}/load_lora_adapter",
                json={"lora_name": "x", "lora_path": str(tmp_path)},
                timeout=30,
            )
            assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]

    asyncio.run(run())


def _perturbed(sd: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A next policy in which about `frac` of the elements changed (what one small RL step does)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        mask = torch.rand(v.shape, generator=g) < frac
        out[k] = torch.where(mask, v + 0.05, v)
    return out


def test_delta_sync_from_path_and_over_gloo_is_verified(server, other_weights, tmp_path: Path) -> None:
    """The trainer's publisher sends a full policy, then deltas (files, then a gloo broadcast); the server
    rebuilds the full weights and its checksum of them equals the trainer's checksum of the full policy."""
    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher

    p0 = load_sd(other_weights[1])
    p1 = _perturbed(p0, 1)
    p2 = _perturbed(p1, 2)
    paths = RunPaths(tmp_path / "run")
    bus = Bus(paths, "trainer", 0, listen=False)

    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            step = (await c.weights())["step"] + 1
            pub = PolicyPublisher(paths, bus, 0, "filesystem", keep=2, delta=True, full_every=10)
            for i, sd in enumerate((p0, p1)):
                pub.publish_named(sd, step + i)
                msg = bus.latest_policy()
                assert (msg.base_step is None) == (i == 0)
                if i:
                    assert msg.sync_bytes == pub.last_sync_bytes < 0.1 * msg.num_bytes
                r = await c.update_weights(msg.step, path=msg.path, expected_checksum=msg.checksum)
                assert r["checksum"] == msg.checksum == state_dict_checksum(sd)
            # a delta whose base the server does not hold is refused and changes nothing
            stale = PolicyPublisher(
                RunPaths(tmp_path / "stale"),
                Bus(RunPaths(tmp_path / "stale"), "trainer", 0, listen=False),
                0,
                "filesystem",
                keep=2,
                delta=True,
            )
            stale.publish_named(p2, 1)
            stale.publish_named(_perturbed(p2, 3), 2)
            before = await c.weights()
            with pytest.raises(WeightSyncError, match="full update is needed"):
                await c.update_weights(step + 2, path=str(stale.paths.broadcast_dir(2)))
            assert await c.weights() == before
            # over gloo: the same publisher code, collective transport
            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(init_group, "127.0.0.1", port, 2, 0, timeout_s=60),
                c.init_broadcaster("127.0.0.1", port, 2, 1, timeout=60),
            )
            pub.transport, pub.group = "collective", group
            _, r = await asyncio.gather(
                asyncio.to_thread(pub.publish_named, p2, step + 2),
                c.update_weights(step + 2, collective=True),
            )
            msg = bus.latest_policy()
            assert msg.base_step == step + 1 and msg.sync_bytes < 0.1 * msg.num_bytes
            assert r["checksum"] == msg.checksum == state_dict_checksum(p2) == (await c.weights())["checksum"]

    asyncio.run(run())


def test_sharded_publish_streams_into_the_parameters(server, other_weights) -> None:
    """A policy written by two trainer ranks (pieces + manifest.json) loads tensor by tensor into the
    served parameters (no whole copy of the policy on the host), with the full export's checksum; a
    piece corrupted on disk fails the load midway in one line, after which the half-written weights
    are not served (503) until a good update lands."""
    from hpcrl.weights.manifest import finish, write_pieces
    from hpcrl.weights.shards import Piece

    sd = load_sd(other_weights[1])
    d = server.run_dir / "broadcasts" / "sharded_test"
    for rank in range(2):
        pieces = []
        for name, t in sd.items():
            a = -(-t.shape[0] // 2) if t.dim() else 0
            if t.dim() or rank == 0:
                rows = (t[:a] if rank == 0 else t[a:]) if t.dim() else t
                pieces.append(Piece(name, tuple(t.shape), 0 if rank == 0 else a, rows))
        write_pieces(d, rank, pieces, bucket_bytes=1 << 14)
    expected = finish(d, 5, world=2).checksum
    assert expected == state_dict_checksum(sd)

    async def run() -> None:
        async with InferenceClient(server.base_url) as c:
            step = (await c.weights())["step"] + 1
            r = await c.update_weights(step, path=str(d), expected_checksum=expected)
            assert r["checksum"] == expected and (await c.health())["status"] == "ok"
            last = sorted(d.glob("rank00001-*.safetensors"))[-1]
            raw = bytearray(last.read_bytes())
            raw[-1] ^= 0x10  # one bit of the last piece of rank 1
            last.write_bytes(bytes(raw))
            with pytest.raises(Exception, match="does not match its digest"):
                await c.update_weights(step + 1, path=str(d))
            assert (await c.health())["status"] == "weights_unverified"
            r = await c._http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 503
            await c.update_weights(step + 2, path=str(other_weights[1]))
            assert (await c.health())["status"] == "ok"

    asyncio.run(run())
