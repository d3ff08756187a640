"""Rendezvous of the weight-broadcast group (collective transport) through the run directory.

Who is in the group: every trainer rank (group ranks 0..T-1, the senders: each broadcasts its own
pieces, hpcrl.weights.collective) and every process of every inference server that receives weights. That is not one per server: a vLLM server with tensor parallelism tp
runs tp workers and each holds its own shard of the model, so each joins (tp x pp with pipeline
parallelism); the embedded hf engine receives in one process however many GPUs it spans. Each server
announces its count in its ServerInfo (`weight_receivers`), and one pure function, `group_layout`,
turns the announcements (ordered by server index) into the group:

    world_size       = T + sum(receivers)
    rank_offset[i]   = T + sum(receivers of the servers before server i)

and a server's worker w joins as rank_offset[i] + w. E.g. one trainer rank and servers with [2, 1]
receivers: world 4, offsets [1, 3] (server 0's workers are ranks 1 and 2, server 1 is rank 3); with
2 trainer ranks: world 5, offsets [2, 4].

Why the trainer sizes the group from the announcements rather than from the config: the backend,
and with it the receiver count, is resolved by each server at runtime (`inference.backend = "auto"`
picks vLLM only where CUDA and vllm exist, and extra vLLM flags may set tp), so only the running
server knows what it brings. Trainer rank 0 therefore waits (bounded) for all
`deployment.num_inference_servers` announcements, computes the layout, writes it with the group's
address to bus/endpoints/weights.json (WeightGroupAddress), tells the other trainer ranks (the
trainer's own group) and hosts the TCPStore as rank 0; trainer rank r joins as group rank r. The
orchestrator reads the same announcements, recomputes the layout with the same function, and
refuses in one line if it disagrees with what the trainer sized (`check_layout`), instead of
letting the group time out; it then asks server i to POST /init_broadcaster with rank_offset[i].
Everything is discovered through the shared filesystem, so it works across nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcrl.net import free_port, host_address
from hpcrl.paths import RunPaths

if TYPE_CHECKING:
    from hpcrl.bus import Bus, ServerInfo, WeightGroupAddress
    from hpcrl.config.schema import Config

ENDPOINT = "weights"
log = logging.getLogger("hpcrl.weights")


class WeightGroupMismatch(ValueError):
    """The servers seen do not match the weight group the trainer sized."""


@dataclass(frozen=True)
class GroupLayout:
    """Ranks of the weight group: ranks 0..senders-1 are the trainer ranks, server i owns ranks
    [offset, offset + receivers)."""

    world_size: int
    rank_offsets: tuple[int, ...]
    receivers: tuple[int, ...]
    senders: int = 1


def group_layout(receivers: Sequence[int], senders: int = 1) -> GroupLayout:
    """The group for `senders` trainer ranks and servers bringing `receivers[i]` ranks each (in
    server-index order)."""
    if not receivers:
        raise ValueError("weight group: there must be at least one inference server")
    if not isinstance(senders, int) or senders < 1:
        raise ValueError(f"weight group: {senders!r} trainer ranks; must be an integer >= 1")
    offsets, nxt = [], senders
    for i, r in enumerate(receivers):
        if not isinstance(r, int) or r < 1:
            raise ValueError(
                f"weight group: server {i} announces {r!r} weight receivers; must be an integer >= 1"
            )
        offsets.append(nxt)
        nxt += r
    return GroupLayout(
        world_size=nxt, rank_offsets=tuple(offsets), receivers=tuple(receivers), senders=senders
    )


def by_index(servers: Sequence[ServerInfo]) -> list[ServerInfo]:
    return sorted(servers, key=lambda s: s.index)


def layout_of(servers: Sequence[ServerInfo], senders: int = 1) -> GroupLayout:
    return group_layout([s.weight_receivers for s in by_index(servers)], senders)


def check_layout(address: WeightGroupAddress, servers: Sequence[ServerInfo]) -> GroupLayout:
    """The layout of `servers`, if it is the one trainer rank 0 sized `address` for; else one line."""
    ordered = by_index(servers)
    mine = layout_of(ordered, address.senders)
    where = f"the trainer's weight group at {address.host}:{address.port}"
    indices = [s.index for s in ordered]
    if indices != list(address.server_indices):
        raise WeightGroupMismatch(
            f"{where} counts servers {list(address.server_indices)}, the orchestrator uses servers {indices}"
        )
    for s, counted in zip(ordered, address.receivers):
        if s.weight_receivers != counted:
            raise WeightGroupMismatch(
                f"server {s.index} ({s.base_url}) announces {s.weight_receivers} weight receiver(s), {where} "
                f"was sized for {counted} (world_size {address.world_size}); did the server restart with "
                "another tensor-parallel size?"
            )
    assert mine.world_size == address.world_size, (mine, address)  # WeightGroupAddress checks the sum
    return mine


def num_servers(cfg: Config) -> int:
    return cfg.deployment.num_inference_servers or 1


def trainer_join_weight_group(
    paths: RunPaths,
    bus: Bus | None,
    num_servers: int,
    timeout_s: float,
    rank: int = 0,
    senders: int = 1,
    share: Any = None,
) -> Any:
    """Every trainer rank (collective over them): rank 0 waits for the servers' announcements, sizes
    the group for `senders` trainer ranks plus the servers' receivers, announces it and hosts it;
    `share(address or None) -> address` hands rank 0's address to the others (the trainer's own group,
    e.g. broadcast_object_list; with one rank it may be None). Trainer rank r joins as group rank r.

    Blocks until every member joined (the orchestrator sends the servers in) or `timeout_s`.
    """
    from hpcrl.bus import WeightGroupAddress
    from hpcrl.bus.messages import encode_json
    from hpcrl.fileio import write_atomic
    from hpcrl.weights.collective import init_group

    address = None
    if rank == 0:
        assert bus is not None
        servers = by_index(bus.wait_servers(num_servers, timeout=timeout_s))[:num_servers]
        layout = layout_of(servers, senders)
        host = host_address()
        address = WeightGroupAddress(
            host=host,
            port=free_port(host),
            world_size=layout.world_size,
            server_indices=[s.index for s in servers],
            receivers=list(layout.receivers),
            senders=senders,
        )
        path = paths.endpoint_file(ENDPOINT)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, [encode_json(address)])
        log.info(
            "weight group at %s:%d: world_size %d = %d trainer rank(s) + receivers %s",
            host,
            address.port,
            layout.world_size,
            senders,
            list(layout.receivers),
        )
    if share is not None:
        address = share(address)
    assert address is not None, "trainer ranks other than 0 need `share` to learn the group's address"
    layout = group_layout(list(address.receivers), address.senders)
    return init_group(
        address.host,
        address.port,
        address.world_size,
        rank,
        timeout_s=timeout_s,
        senders=address.senders,
        servers=tuple(zip(layout.rank_offsets, layout.receivers)),
    )


def read_weight_group_address(paths: RunPaths, timeout_s: float, poll: float = 0.2) -> WeightGroupAddress:
    """Wait (bounded) for trainer rank 0 to announce the group."""
    from hpcrl.bus import CorruptMessageError, WeightGroupAddress
    from hpcrl.bus.files import decode_json_file

    path = paths.endpoint_file(ENDPOINT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return decode_json_file(path, WeightGroupAddress)
        except FileNotFoundError:
            time.sleep(poll)
        except CorruptMessageError as e:
            # Written atomically, so a bad file is not half-written: it is from another version.
            raise WeightGroupMismatch(str(e)) from None
    raise TimeoutError(
        f"no weight-broadcast group announced at {path} after {timeout_s:.0f}s "
        "(is trainer rank 0 running with trainer.broadcast.transport = collective?)"
    )
