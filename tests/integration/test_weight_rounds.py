"""Protocol 4's rounds between real processes on gloo (hpcrl.weights.rounds): 2 trainer ranks each
sending its own rows, a server of 2 processes (a ring) and a server of 1, on 127.0.0.1.

Checked: every process ends with the whole policy bit for bit and the sender's checksum; each server
takes exactly P bytes from the senders, and in the 2-process server each worker takes exactly the
buckets of its own senders (sender r -> worker r mod 2) and the rest from the other worker.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

T, SERVERS, WORLD = 2, ((2, 2), (4, 1)), 5
ROUND = 600  # bytes a round: buckets of 300 per sender, so tensors span rounds and senders


def policy() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.w": torch.randn(37, 19, generator=g),
        "b.w": torch.randn(200, 8, generator=g).bfloat16(),
        "c": torch.tensor(3.5),
        "d.b": torch.randn(13, generator=g),
    }


def pieces_of(rank: int) -> list[Any]:
    """Rank `rank`'s rows of every tensor, as FSDP would shard them (the scalar: rank 0's)."""
    from hpcrl.weights.shards import Piece

    out = []
    for name, t in policy().items():
        if t.dim() == 0:
            if rank == 0:
                out.append(Piece(name, (), 0, t))
            continue
        rows = torch.arange(t.shape[0]).chunk(T)[rank]
        a, b = int(rows[0]), int(rows[-1]) + 1
        out.append(Piece(name, tuple(t.shape), a, t[a:b]))
    return out


def member(rank: int, port: int, scratch: str, q: Any) -> None:
    torch.set_num_threads(1)
    from hpcrl.weights import collective as coll
    from hpcrl.weights.rounds import Assembler, send_rounds

    g = coll.init_group(
        "127.0.0.1", port, WORLD, rank, backend="gloo", timeout_s=60, senders=T, servers=SERVERS
    )
    if rank < T:  # a trainer rank: its records to the others (the trainer's own group does this)
        recs = coll.bucket_records(coll.iter_buckets(pieces_of(rank), ROUND // T))
        tmp = Path(scratch, f"r{rank}.tmp")
        tmp.write_text(json.dumps(recs))
        tmp.rename(Path(scratch, f"r{rank}.json"))
        q.put(("ready", rank))
        header = None
        if rank == 0:
            files = [Path(scratch, f"r{r}.json") for r in range(T)]
            while not all(f.exists() for f in files):  # renamed into place: complete when seen
                time.sleep(0.05)
            everyone = [json.loads(f.read_text()) for f in files]
            rounds = coll.schedule(everyone)
            tensors, checksum = coll.layout_and_checksum(rounds)
            header = coll.make_header(1, ROUND, checksum, tensors, rounds, senders=T, servers=SERVERS)
        if header is not None:
            coll.send_header(g, header)
            parsed = coll._parse_header(header)
        else:
            parsed = coll.receive_header(g)
        send_rounds(g, parsed, coll.iter_buckets(pieces_of(rank), ROUND // T))
        q.put((rank, dict(g.stats), len(parsed.rounds)))
        return
    header = coll.receive_header(g)
    got: dict[str, Any] = {}
    checksum = coll.receive_into(
        g, header, Assembler(header, "cpu", lambda done: got.update((n, t.clone()) for n, t in done))
    )
    want = policy()
    same = got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    q.put((rank, dict(g.stats), same, checksum == header.checksum))


@pytest.mark.timeout(180)
def test_senders_spread_over_a_servers_workers_and_each_byte_crosses_once(tmp_path: Path) -> None:
    from hpcrl.net import free_port
    from hpcrl.weights.checksum import state_dict_checksum
    from hpcrl.weights.rounds import holder

    assert [holder(2, 2, r) for r in range(T)] == [2, 3] and [holder(4, 1, r) for r in range(T)] == [4, 4]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    # the senders write their records first; the receivers join the group meanwhile
    procs = [ctx.Process(target=member, args=(r, port, str(tmp_path), q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < WORLD:
            item = q.get(timeout=120)
            if item[0] != "ready":
                out[item[0]] = item[1:]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    pol = policy()
    nbytes = sum(t.numel() * t.element_size() for t in pol.values())
    for r in range(T, WORLD):
        stats, same, verified = out[r]
        assert same and verified, (r, out[r])
    assert out[0][1] > 3  # several rounds: tensors span rounds and senders
    # sender r's bytes went once to each server: to worker r mod 2 of the ring, to the one process
    sent = [sum(p.nbytes for p in pieces_of(r)) for r in range(T)]
    ring0, ring1, single = (out[r][0] for r in (2, 3, 4))
    assert ring0.get("received_bytes", 0) == sent[0] and ring1.get("received_bytes", 0) == sent[1]
    assert ring0["received_bytes"] + ring1["received_bytes"] == nbytes == single["received_bytes"]
    assert ring0["forwarded_in_bytes"] >= sent[1] and ring1["forwarded_in_bytes"] >= sent[0]
    assert "forwarded_in_bytes" not in single or single["forwarded_in_bytes"] == 0
    assert state_dict_checksum(pol)  # the checksum every receiver compared against
