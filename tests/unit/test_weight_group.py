"""Layout of the weight-broadcast group: who is counted, at which ranks, and loud disagreement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from hpcrl.bus import Bus, CorruptMessageError, ServerInfo, WeightGroupAddress
from hpcrl.bus.files import write_atomic
from hpcrl.bus.messages import decode_json, encode_json
from hpcrl.inference.options import weight_receivers
from hpcrl.inference.vllm_routes import collective_result
from hpcrl.orchestrator.policy import PolicyMismatch, PolicySync
from hpcrl.paths import RunPaths
from hpcrl.weights.rendezvous import (
    ENDPOINT,
    WeightGroupMismatch,
    check_layout,
    group_layout,
    layout_of,
)


def info(index: int, receivers: int = 1) -> ServerInfo:
    return ServerInfo(
        index=index,
        base_url=f"http://h{index}:8000",
        host=f"h{index}",
        port=8000,
        pid=1,
        model="m",
        weight_receivers=receivers,
    )


def address(indices: list[int], receivers: list[int]) -> WeightGroupAddress:
    return WeightGroupAddress(
        host="t", port=29500, world_size=1 + sum(receivers), server_indices=indices, receivers=receivers
    )


@pytest.mark.parametrize(
    "receivers, world, offsets",
    [
        ([1], 2, (1,)),  # one hf server: trainer + 1
        ([1, 1], 3, (1, 2)),  # what the group was before tp counted
        ([2, 1], 4, (1, 3)),  # tp=2 server takes ranks 1, 2; the hf server rank 3
        ([4, 2, 1], 8, (1, 5, 7)),  # 1+4 -> 5, 5+2 -> 7, 7+1 = world 8
        ([2, 2], 5, (1, 3)),
    ],
)
def test_group_layout_hand_checked(receivers, world, offsets) -> None:
    layout = group_layout(receivers)
    assert (layout.world_size, layout.rank_offsets, layout.receivers) == (world, offsets, tuple(receivers))


@pytest.mark.parametrize(
    "receivers, match",
    [
        ([], "at least one inference server"),
        ([2, 0], "server 1 announces 0 weight receivers"),
        ([-1], "server 0 announces -1"),
    ],
)
def test_group_layout_rejects_nonsense(receivers, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_layout(receivers)


@pytest.mark.parametrize(
    "senders, receivers, world, offsets",
    [
        (2, [1], 3, (2,)),  # 2 trainer ranks (group ranks 0, 1), the hf server rank 2
        (4, [2, 1], 7, (4, 6)),  # tp=2 server takes ranks 4, 5; the hf server rank 6
        (16, [8, 8], 32, (16, 24)),  # seed 000: 2 x 8 trainer ranks, 2 vLLM servers at tp 8
    ],
)
def test_group_layout_counts_every_trainer_rank(senders, receivers, world, offsets) -> None:
    layout = group_layout(receivers, senders)
    assert (layout.world_size, layout.rank_offsets, layout.senders) == (world, offsets, senders)
    a = WeightGroupAddress(
        host="t", port=1, world_size=world, server_indices=list(range(len(receivers))), receivers=receivers,
        senders=senders,
    )  # fmt: skip
    assert decode_json(encode_json(a), WeightGroupAddress) == a
    assert check_layout(a, [info(i, r) for i, r in enumerate(receivers)]).rank_offsets == offsets
    with pytest.raises(ValueError, match="0 trainer ranks; must be an integer >= 1"):
        group_layout(receivers, 0)


def test_layout_follows_server_index_not_discovery_order() -> None:
    layout = layout_of([info(1, 1), info(0, 2)])
    assert (layout.world_size, layout.rank_offsets, layout.receivers) == (4, (1, 3), (2, 1))


def test_check_layout_agrees_and_disagrees_in_one_line() -> None:
    assert check_layout(address([0, 1], [2, 1]), [info(0, 2), info(1, 1)]).rank_offsets == (1, 3)
    with pytest.raises(WeightGroupMismatch) as e:
        check_layout(address([0, 1], [1, 1]), [info(0, 2), info(1, 1)])
    msg = str(e.value)
    assert "\n" not in msg
    assert "server 0 (http://h0:8000) announces 2 weight receiver(s)" in msg and "sized for 1" in msg
    assert "world_size 3" in msg
    with pytest.raises(
        WeightGroupMismatch, match=r"counts servers \[0\], the orchestrator uses servers \[0, 1\]"
    ):
        check_layout(address([0], [1]), [info(0), info(1)])


def test_server_info_reads_old_files_and_rejects_zero_receivers() -> None:
    old = b'{"index":0,"base_url":"http://h:1","host":"h","port":1,"pid":2,"model":"m","created_at":1.0}'
    assert decode_json(old, ServerInfo).weight_receivers == 1
    new = info(3, 2)
    assert decode_json(encode_json(new), ServerInfo) == new
    with pytest.raises(ValueError, match="weight_receivers must be >= 1"):
        info(0, 0)
    with pytest.raises(CorruptMessageError, match="weight_receivers"):
        decode_json(old.replace(b'"pid"', b'"weight_receivers":0,"pid"'), ServerInfo)


def test_weight_group_address_round_trip_and_consistency() -> None:
    a = address([0, 1], [2, 1])
    assert decode_json(encode_json(a), WeightGroupAddress) == a
    with pytest.raises(ValueError, match=r"world_size 3 != senders \+ sum\(receivers\) = 4"):
        WeightGroupAddress(host="t", port=1, world_size=3, server_indices=[0, 1], receivers=[2, 1])
    with pytest.raises(ValueError, match="differ in length"):
        WeightGroupAddress(host="t", port=1, world_size=3, server_indices=[0], receivers=[1, 1])


@pytest.mark.parametrize(
    "backend, args, n",
    [
        ("hf", ["--tensor-parallel-size=4"], 1),  # the embedded engine receives once, whatever it spans
        ("vllm", [], 1),
        (
            "vllm",
            ["--tensor-parallel-size=2", "--gpu-memory-utilization=0.9"],
            2,
        ),  # what serve_config renders
        ("vllm", ["-tp", "4"], 4),
        ("vllm", ["--tensor_parallel_size", "2", "--pipeline-parallel-size=2"], 4),  # tp x pp workers
        ("vllm", ["-tp=2", "--tensor-parallel-size", "8"], 8),  # last one wins, as in argparse
    ],
)
def test_weight_receivers_of_a_server(backend, args, n) -> None:
    assert weight_receivers(backend, args) == n


def test_weight_receivers_rendered_tp_and_flags_after_it() -> None:
    assert weight_receivers("vllm", [], tp=2) == 2
    assert weight_receivers("vllm", ["-pp", "2"], tp=2) == 4
    assert (
        weight_receivers("vllm", ["--tensor-parallel-size=4"], tp=2) == 4
    )  # extra flags come last: they win
    assert weight_receivers("hf", [], tp=2) == 1


@pytest.mark.parametrize(
    "args, match",
    [
        (["--tensor-parallel-size", "two"], "--tensor-parallel-size needs an integer"),
        (["-pp=0"], "parallel sizes must be >= 1"),
    ],
)
def test_weight_receivers_rejects_bad_flags(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        weight_receivers("vllm", args)


def test_collective_result_checks_every_worker() -> None:
    assert collective_result([(3, "c", "c"), (3, "c", "c")], 3) == ("c", "c")
    assert collective_result([(3, "c", None)], 3) == ("c", None)
    with pytest.raises(ValueError, match="worker 1 loaded checksum bad != sender's c"):
        collective_result([(3, "c", "c"), (3, "bad", "c")], 3)
    with pytest.raises(ValueError, match="worker 2 received step 2, the request said 3"):
        collective_result([(3, "c", "c"), (3, "c", "c"), (2, "c", "c")], 3)
    with pytest.raises(ValueError, match="different checksums"):
        collective_result([(3, "a", None), (3, "b", None)], 3)
    with pytest.raises(ValueError, match="no vLLM worker"):
        collective_result([], 3)


def test_orchestrator_refuses_a_group_sized_for_other_servers(tmp_path: Path) -> None:
    """Server 0 announces tp = 2 but the trainer's group counted it as 1: one clear line, before
    any server is asked to join (the servers' URLs lead nowhere)."""
    paths = RunPaths(tmp_path / "run")
    paths.make_dirs()
    servers = [info(0, 2), info(1, 1)]
    paths.endpoint_file(ENDPOINT).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(paths.endpoint_file(ENDPOINT), [encode_json(address([0, 1], [1, 1]))])

    async def join() -> None:
        bus = Bus(paths, role="orchestrator", listen=False)
        sync = PolicySync(
            paths, bus, [s.base_url for s in servers], "collective", timeout=5, policy_timeout=5
        )
        try:
            await sync.join_group(servers)
        finally:
            await sync.aclose()
            bus.close()

    with pytest.raises(PolicyMismatch) as e:
        asyncio.run(join())
    assert "server 0 (http://h0:8000) announces 2 weight receiver(s)" in str(e.value)
    assert "sized for 1 (world_size 3)" in str(e.value)


def test_weights_endpoint_of_another_version_is_refused(tmp_path: Path) -> None:
    from hpcrl.weights.rendezvous import read_weight_group_address

    paths = RunPaths(tmp_path / "run")
    paths.endpoint_file(ENDPOINT).parent.mkdir(parents=True, exist_ok=True)
    # The layout-less file an older trainer wrote.
    paths.endpoint_file(ENDPOINT).write_bytes(msgspec.json.encode({"host": "t", "port": 1, "world_size": 3}))
    with pytest.raises(WeightGroupMismatch, match="server_indices"):
        read_weight_group_address(paths, timeout_s=1)
