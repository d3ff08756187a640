"""The rank launcher of the distributed tests (tests/integration/ranks.py) ends every launch within its
bound and says why: a rank that fails stops its peers at once (left alone they would wait in a
collective for gloo's 30 min timeout), a rank that hangs is killed at the deadline with its Python
stack in the failure. Before, a rank that died at rendezvous (rank 0's port taken) left the others
waiting past pytest's 600 s timeout, with nothing in the output.

The workers are this file run as a script: ``mode`` (ok | crash | hang) and the faulty rank."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.integration.ranks import Ranks, run_ranks, wait_ranks


def test_ranks_rendezvous_at_the_launchers_store() -> None:
    """The store is the launcher's, bound before the ranks start: no rank binds a port picked earlier."""
    outs = run_ranks(__file__, 2, "ok", "-1", timeout=240)
    assert [o.splitlines()[-1] for o in outs] == [f"rank {r} of 2: 2.0 agent store True" for r in range(2)]


def test_a_failed_rank_stops_its_peers_at_once(tmp_path: Path) -> None:
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    with pytest.raises(AssertionError) as e:
        wait_ranks(Ranks(__file__, ["crash", "1"], logs), timeout=240)
    msg = str(e.value)
    assert msg.startswith("a rank failed; the others were stopped"), msg[:2000]  # not the deadline
    assert "rank 1 exited 1" in msg and "injected crash" in msg, msg[:2000]


def test_a_hung_rank_is_killed_with_its_stack(tmp_path: Path) -> None:
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    group = Ranks(__file__, ["hang", "1", str(tmp_path / "hanging")], logs)
    deadline = time.monotonic() + 120
    while not (tmp_path / "hanging").exists():  # in its endless loop (slow to start on a loaded CI)
        assert time.monotonic() < deadline, "rank 1 did not start"
        time.sleep(0.1)
    t = time.monotonic()
    with pytest.raises(AssertionError) as e:
        wait_ranks(group, timeout=1)
    assert time.monotonic() - t < 60
    msg = str(e.value)
    assert "still running after 1 s" in msg and "rank 1: stopped" in msg, msg[:2000]
    assert "most recent call first" in msg and "_hang" in msg, msg[:2000]  # faulthandler's dump


def _hang() -> None:
    while True:
        time.sleep(1)


if __name__ == "__main__":
    mode, bad = sys.argv[1], int(sys.argv[2])
    import os

    if mode == "hang":  # no collective: the bound alone must end it
        if int(os.environ["RANK"]) == bad:
            Path(sys.argv[3]).touch()
            _hang()
        sys.exit(0)
    import torch

    from hpcrl.trainer import parallel as par

    env = par.init_distributed(torch.device("cpu"))
    if env.rank == bad and mode == "crash":
        raise RuntimeError("injected crash")
    total = float(par.all_reduce(torch.ones(1)))  # a peer of the crashed rank waits here
    store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    print(f"rank {env.rank} of {env.world_size}: {total} agent store {store}", flush=True)
    par.barrier()
    par.destroy_distributed()
    par.hard_exit(0)
