"""Bus API in one process: exactly-once delivery, doorbell faults, corruption, control, retention."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpcrl.bus import (
    Bus,
    BusTimeout,
    PolicyReady,
    Ring,
    ServerInfo,
    Shutdown,
    ShutdownRequested,
    TrainBatch,
    encode,
    write_message,
)
from hpcrl.bus.doorbell import DoorbellWriter
from hpcrl.bus.messages import Endpoint, encode_json
from hpcrl.paths import RunPaths
from tests.unit.test_bus_messages import make_batch

SLOW_POLL = 30.0  # a wait that finishes well before this was woken by the doorbell


@pytest.fixture
def paths(tmp_path):
    return RunPaths(tmp_path / "run")


@pytest.fixture
def buses(paths):
    made: list[Bus] = []

    def make(role: str, rank: int = 0, **kw) -> Bus:
        kw.setdefault("durable", False)  # fsync adds nothing to these logic tests
        bus = Bus(paths, role, rank, **kw)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        bus.close()


def landing(delay: float, path, msg) -> list[float]:
    """Write `msg` to `path` after `delay` s (a thread); the list gets the time its write began
    (before the reader can see it). Bounds are measured from there: on a loaded machine the writer
    itself can be late."""
    landed: list[float] = []
    later(delay, lambda: (landed.append(time.monotonic()), write_message(path, msg)))
    return landed


def later(delay: float, fn, *args) -> threading.Thread:
    def run():
        time.sleep(delay)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def policy(step: int) -> PolicyReady:
    return PolicyReady(step=step, transport="collective", checksum=f"c{step}", num_params=1, num_bytes=4)


def test_doorbell_wakes_the_reader_at_once(buses):
    trainer = buses("trainer", poll_interval=SLOW_POLL)
    orch = buses("orchestrator")
    later(0.2, orch.publish_batch, 0, 0, make_batch(step=0))
    t0 = time.monotonic()
    batch = trainer.wait_batch(0, timeout=5)
    assert batch.step == 0 and time.monotonic() - t0 < 2
    assert trainer.rings_received >= 1


def test_each_step_is_delivered_once_and_is_that_step(buses, paths):
    trainer = buses("trainer", 1, poll_interval=0.05)
    orch = buses("orchestrator")
    for step in (2, 0, 1):  # published out of order: rings arrive reordered
        orch.publish_batch(step, 1, make_batch(step=step, rank=1, world_size=2))
    got = [trainer.wait_batch(s, timeout=2) for s in range(3)]
    assert [b.step for b in got] == [0, 1, 2]
    assert [int(b.example_ids[0]) for b in got] == [100, 1100, 2100]
    with pytest.raises(ValueError, match="already consumed"):
        trainer.wait_batch(1, timeout=0)


def test_duplicate_and_early_rings_are_harmless(buses, paths):
    trainer = buses("trainer", poll_interval=0.1)
    ringer = DoorbellWriter(paths)
    for _ in range(5):  # duplicated rings, and rings for a file that does not exist yet
        ringer.ring("trainer_0", Ring("rollouts", 0))
    # the file arrives later with no ring at all: found by the rescan within one poll interval
    landed = landing(0.3, paths.rollout_file(0, 0), make_batch(step=0))
    assert trainer.wait_batch(0, timeout=5).step == 0
    assert time.monotonic() - landed[0] < 0.1 + 1.0  # a poll interval after it landed, with slack
    with pytest.raises(BusTimeout):  # the stale rings do not conjure up step 1
        trainer.wait_batch(1, timeout=0.3)
    ringer.close()


def test_lost_rings_cost_one_poll_interval(buses, paths):
    trainer = buses("trainer", poll_interval=0.2)
    landed = landing(0.1, paths.rollout_file(0, 0), make_batch(step=0))  # no ring sent
    assert trainer.wait_batch(0, timeout=5).step == 0
    assert time.monotonic() - landed[0] < 0.2 + 1.0  # a poll interval after it landed, with slack


def test_timeout_says_what_and_where(buses, paths):
    trainer = buses("trainer", poll_interval=0.05)
    orch = buses("orchestrator")
    orch.publish_batch(3, 0, make_batch(step=3))
    with pytest.raises(BusTimeout) as info:
        trainer.wait_batch(4, timeout=0.2)
    text = str(info.value)
    assert "rollouts step 4 rank 0" in text and str(paths.rollout_file(4, 0)) in text
    assert "newest rollout step present: step 3" in text and "trainer_0 waited" in text


def test_tmp_files_are_never_read(buses, paths):
    trainer = buses("trainer", poll_interval=0.05)
    final = paths.rollout_file(0, 0)
    final.parent.mkdir(parents=True)
    (final.parent / (final.name + ".tmp-1-elsewhere")).write_bytes(encode(make_batch(step=0)))
    with pytest.raises(BusTimeout):
        trainer.wait_batch(0, timeout=0.2)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "foreign", "misfiled"])
def test_corrupt_batches_are_rejected_and_the_consumer_keeps_going(buses, paths, damage, caplog):
    trainer = buses("trainer", poll_interval=0.05)
    orch = buses("orchestrator")
    path = orch.publish_batch(0, 0, make_batch(step=0))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        data[len(data) // 2] ^= 0x04
        path.write_bytes(data)
    elif damage == "foreign":
        path.write_bytes(b'{"hello": "I am JSON"}')
    else:
        write_message(path, make_batch(step=5))
    with pytest.raises(BusTimeout, match="rejected files"):
        trainer.wait_batch(0, timeout=0.2)
    assert len(trainer.rejected) == 1 and trainer.rejected[0].parent == paths.rejected_dir
    assert "rejected corrupt bus file" in caplog.text and str(path) in caplog.text
    later(0.1, orch.publish_batch, 0, 0, make_batch(step=0))  # the producer republishes
    assert trainer.wait_batch(0, timeout=3).step == 0


def test_policy_latest_wait_and_corrupt_newest(buses, paths):
    orch = buses("orchestrator", poll_interval=SLOW_POLL)
    trainer = buses("trainer")
    assert orch.latest_policy() is None
    for s in (1, 2, 3):
        trainer.publish_policy(policy(s))
    assert orch.latest_policy().step == 3
    assert orch.wait_policy(2, timeout=1).step == 3  # newest wins
    paths.policy_file(3).write_bytes(b"\0" * 100)
    assert orch.latest_policy().step == 2 and len(orch.rejected) == 1
    later(0.2, trainer.publish_policy, policy(4))
    t0 = time.monotonic()
    assert orch.wait_policy(4, timeout=5).checksum == "c4"
    assert time.monotonic() - t0 < 2  # rung, not polled
    with pytest.raises(BusTimeout, match=r"policy step >= 9 .*newest is step 4"):
        orch.wait_policy(9, timeout=0.1)


def test_shutdown_interrupts_waits(buses):
    trainer = buses("trainer", poll_interval=SLOW_POLL)
    orch = buses("orchestrator")
    assert trainer.poll_control() is None
    later(0.2, orch.publish_control, Shutdown(reason="max_steps reached", origin="orchestrator"))
    t0 = time.monotonic()
    with pytest.raises(ShutdownRequested, match="orchestrator: max_steps reached"):
        trainer.wait_batch(0, timeout=5)
    assert time.monotonic() - t0 < 2
    deaf = buses("trainer", 1, check_shutdown=False)
    with pytest.raises(BusTimeout):
        deaf.wait_batch(0, timeout=0.1)
    with pytest.raises(ValueError, match="control messages are Shutdown"):
        orch.publish_control(policy(1))  # type: ignore[arg-type]


def test_cleanup_keeps_policies_and_the_newest_steps(buses, paths):
    orch = buses("orchestrator")
    for s in range(6):
        orch.publish_batch(s, 0, make_batch(step=s))
        orch.publish_policy(policy(s))
    removed = orch.cleanup(before_step=4, keep=1)
    assert [p.name for p in removed] == ["step_0", "step_1", "step_2"]
    assert RunPaths.steps_in(paths.rollouts_dir) == [3, 4, 5]
    assert RunPaths.steps_in(paths.policy_dir) == list(range(6))
    orch.cleanup(before_step=6)
    assert RunPaths.steps_in(paths.rollouts_dir) == []


def test_move_aside_after_resume_step(buses, paths):
    orch = buses("orchestrator")
    for s in range(1, 6):
        orch.publish_batch(s, 0, make_batch(step=s))
        orch.publish_policy(policy(s))
    orch.publish_control(Shutdown(reason="preempted", origin="trainer_0"))
    moved = orch.move_aside_after(3, tag="resume_3")
    aside = paths.moved_aside_dir("resume_3")
    assert sorted(p.relative_to(aside).as_posix() for p in moved) == [
        "control/shutdown_trainer_0.msgpack",
        "policy/step_4.msgpack",
        "policy/step_5.msgpack",
        "rollouts/step_4",
        "rollouts/step_5",
    ]
    assert RunPaths.steps_in(paths.rollouts_dir) == [1, 2, 3]
    assert orch.latest_policy().step == 3 and orch.poll_control() is None
    with pytest.raises(ValueError, match="tag"):
        orch.move_aside_after(3, tag="../x")


def test_move_aside_works_across_filesystems(buses, paths, monkeypatch):
    """rollouts/ on a filesystem of its own (a tmpfs, a symlink to local disk): rename(2) says
    EXDEV, and the step is copied aside and removed instead of ending the resume."""
    import errno as errno_

    from hpcrl.bus import api

    orch = buses("orchestrator")
    for s in range(1, 4):
        orch.publish_batch(s, 0, make_batch(step=s))

    def exdev(src, dst):
        raise OSError(errno_.EXDEV, "Invalid cross-device link", str(src), None, str(dst))

    monkeypatch.setattr(api.os, "replace", exdev)
    moved = orch.move_aside_after(1, tag="resume_1")
    assert [p.name for p in moved] == ["step_2", "step_3"] and all(p.is_dir() for p in moved)
    assert RunPaths.steps_in(paths.rollouts_dir) == [1]


def test_restarted_reader_is_found_by_the_writer(buses, paths):
    orch = buses("orchestrator")
    first = buses("trainer", poll_interval=SLOW_POLL)
    orch.publish_batch(0, 0, make_batch(step=0))
    assert first.wait_batch(0, timeout=2).step == 0
    first_address = first.address
    second = buses("trainer", poll_interval=SLOW_POLL)  # the restarted reader: new port, new file
    first.close()  # must not delete the successor's endpoint file
    assert paths.endpoint_file("trainer_0").exists() and second.address != first_address
    later(0.2, orch.publish_batch, 1, 0, make_batch(step=1))
    t0 = time.monotonic()
    assert second.wait_batch(1, timeout=5).step == 1
    assert time.monotonic() - t0 < 2


def test_writers_never_block_on_dead_or_garbled_readers(buses, paths):
    orch = buses("orchestrator")
    endpoint = Endpoint(name="trainer_0", address="tcp://127.0.0.1:9", pid=1, hostname="gone", nonce="x")
    paths.endpoint_file("trainer_0").write_bytes(encode_json(endpoint))  # nobody listens on port 9
    paths.endpoint_file("trainer_1").write_bytes(b"{not json")
    batch = make_batch(step=0)
    t0 = time.monotonic()
    for s in range(200):
        batch.step = s
        orch.publish_batch(s, 0, batch)
        orch.publish_batch(s, 1, make_batch(step=s, rank=1, world_size=2, samples=1))
    assert time.monotonic() - t0 < 5
    assert orch._writer.dropped > 0  # SNDHWM reached: rings dropped instead of blocking


def test_server_announcements(buses):
    inference = buses("inference", listen=False)
    orch = buses("orchestrator", poll_interval=0.05)
    later(
        0.1, inference.announce_server, ServerInfo(index=1, base_url="u1", host="h", port=2, pid=3, model="m")
    )
    inference.announce_server(ServerInfo(index=0, base_url="u0", host="h", port=1, pid=3, model="m"))
    assert [s.base_url for s in orch.wait_servers(2, timeout=3)] == ["u0", "u1"]
    with pytest.raises(BusTimeout, match="3 inference server"):
        orch.wait_servers(3, timeout=0.1)


def test_user_errors_are_value_errors(buses, paths):
    bus = buses("trainer")
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeouts"):
            bus.wait_batch(0, timeout=bad)
    with pytest.raises(ValueError, match="role"):
        Bus(paths, "a/b")
    with pytest.raises(ValueError, match="published as step 1"):
        bus.publish_batch(1, 0, make_batch(step=0))
    with pytest.raises(ValueError, match="keep"):
        bus.cleanup(3, keep=-1)


def test_batches_decode_to_plain_numpy(buses):
    orch = buses("orchestrator")
    trainer = buses("trainer")
    orch.publish_batch(0, 0, make_batch(step=0))
    batch = trainer.wait_batch(0, timeout=1)
    assert isinstance(batch, TrainBatch) and isinstance(batch.input_ids, np.ndarray)
    assert batch.position_ids[:5].tolist() == [0, 1, 2, 3, 4]


def test_host_from_argument_or_environment(paths, monkeypatch):
    monkeypatch.setenv("HPCRL_BUS_HOST", "auto")  # what a multi-node launcher sets
    with Bus(paths, "trainer", 3) as bus:
        host = bus.address.removeprefix("tcp://").rsplit(":", 1)[0]
        assert host and host != "auto"
        orch = Bus(paths, "orchestrator", listen=False)
        orch.publish_batch(0, 3, make_batch(step=0, rank=3, world_size=4))
        assert bus.wait_batch(0, timeout=2).rank == 3
        orch.close()
    with Bus(paths, "trainer", 0, host="127.0.0.1") as bus:
        assert bus.address.startswith("tcp://127.0.0.1:")


def test_policy_rings_skip_foreign_address_files(buses, paths, caplog):
    orch = buses("orchestrator", poll_interval=SLOW_POLL)
    trainer = buses("trainer")
    paths.endpoint_file("weights").write_text('{"host": "h", "port": 1, "world_size": 2}')
    later(0.2, trainer.publish_policy, policy(0))
    assert orch.wait_policy(0, timeout=5).step == 0
    trainer.publish_policy(policy(1))
    assert "WARNING" not in caplog.text


def test_policy_rings_skip_trainer_ranks(buses, paths):
    """Only readers that wait for policies are rung: never the trainer ranks (they publish them)."""
    orch = buses("orchestrator", poll_interval=SLOW_POLL)
    ranks = [buses("trainer", r) for r in range(4)]
    publisher = ranks[0]
    pub = later(0.2, publisher.publish_policy, policy(0))
    assert orch.wait_policy(0, timeout=5).step == 0  # woken by the ring, not the slow poll
    pub.join(5)  # the writer counts a ring after its send returns: the reader can wake first
    assert publisher._writer.sent == 1
    assert all(not r.rings_pending() for r in ranks[1:])


def test_asyncio_policy_wait_is_woken_by_the_doorbell(buses, paths):
    """The orchestrator's event-loop wait (PolicySync.wait_at_least -> nap) wakes on the trainer's
    ring, not on its next poll; rings that arrive while nobody naps are received (no spinning) and
    the next rescan still finds the policy."""
    import asyncio

    from hpcrl.orchestrator.policy import PolicySync

    trainer = buses("trainer")
    orch = buses("orchestrator")

    async def scenario() -> tuple[int, int, float]:
        sync = PolicySync(paths, orch, [], "filesystem", timeout=5, policy_timeout=60)
        try:
            later(0.2, trainer.publish_policy, policy(1))
            t0 = time.monotonic()
            first = await asyncio.wait_for(sync.wait_at_least(1, poll=SLOW_POLL), 10)
            waited = time.monotonic() - t0
            trainer.publish_policy(policy(2))  # rung while nobody naps
            await asyncio.sleep(0.3)  # the loop's reader receives the ring meanwhile
            second = await asyncio.wait_for(sync.wait_at_least(2, poll=SLOW_POLL), 10)
            return first.step, second.step, waited
        finally:
            await sync.aclose()

    first, second, waited = asyncio.run(scenario())
    assert (first, second) == (1, 2) and waited < SLOW_POLL / 3
    assert orch.rings_received >= 2
