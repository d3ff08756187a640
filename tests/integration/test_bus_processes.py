"""Bus faults with real processes: SIGKILLed writers, readers before/after writers, restarted readers.

This file is also the worker script the tests spawn (`python test_bus_processes.py <mode> ...`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.bus import Bus, TrainBatch, read_message
from hpcrl.bus.files import TMP_MARK
from hpcrl.paths import RunPaths
from tests.unit.test_bus_messages import make_batch

REPO = Path(__file__).resolve().parents[2]
SLOW_POLL = 30.0  # readers with this poll interval only finish in time if the doorbell works


def spawn(mode: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, __file__, mode, *map(str, args)], env=env, stdout=subprocess.PIPE, text=True
    )


def check_content(batch: TrainBatch, step: int) -> None:
    assert batch.step == step and int(batch.example_ids[0]) == 1000 * step


# -- workers ----------------------------------------------------------------------------------------
def _writer(root: str, start: str, count: str, interval: str) -> None:
    bus = Bus(RunPaths(root), "orchestrator", listen=False)
    for step in range(int(start), int(start) + int(count)):
        bus.publish_batch(step, 0, make_batch(step=step))
        time.sleep(float(interval))
    print("done", flush=True)


def _hammer(root: str, mib: str) -> None:
    """Write big batches as fast as possible, forever, until killed."""
    bus = Bus(RunPaths(root), "orchestrator", listen=False)
    tokens = int(mib) * (1 << 20) // 17  # 17 bytes per token across the token arrays
    batch = make_batch(samples=1, sample_len=tokens)
    step = 0
    while True:
        batch.step = step
        batch.example_ids[0] = 1000 * step
        bus.publish_batch(step, 0, batch)
        step += 1


def _reader(root: str, count: str) -> None:
    bus = Bus(RunPaths(root), "trainer", 0, poll_interval=SLOW_POLL)
    for step in range(int(count)):
        check_content(bus.wait_batch(step, timeout=10), step)
        print(step, flush=True)
    time.sleep(60)  # stay up until the test kills us


# -- tests ------------------------------------------------------------------------------------------
def test_sigkilled_writer_never_exposes_a_partial_file(tmp_path):
    paths = RunPaths(tmp_path / "run")
    reads = caught_mid_write = 0
    for _trial in range(3):
        writer = spawn("hammer", paths.root, 16)
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                # A reader running alongside the writer: every final-named file is whole.
                for f in paths.rollouts_dir.glob("step_*/rank_*.msgpack"):
                    try:
                        batch = read_message(f, TrainBatch)
                    except FileNotFoundError:
                        continue
                    check_content(batch, batch.step)
                    reads += 1
                if reads >= 2 and list(paths.rollouts_dir.glob(f"step_*/*{TMP_MARK}*")):
                    break  # a write is in flight right now
            os.kill(writer.pid, signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait()
        leftovers = list(paths.rollouts_dir.glob(f"step_*/*{TMP_MARK}*"))
        caught_mid_write += bool(leftovers)
        for f in paths.rollouts_dir.glob("step_*/rank_*.msgpack"):
            check_content(read_message(f, TrainBatch), int(f.parent.name.split("_")[1]))
        Bus(paths, "trainer", listen=False).close()  # a new consumer cleans the dead writer's tmp
        assert not list(paths.rollouts_dir.glob(f"step_*/*{TMP_MARK}*"))
        Bus(paths, "orchestrator", listen=False).cleanup(before_step=10**9)
    assert reads > 0 and caught_mid_write >= 1


def test_reader_started_before_the_writer_is_woken_by_the_doorbell(tmp_path):
    paths = RunPaths(tmp_path / "run")
    with Bus(paths, "trainer", 0, poll_interval=SLOW_POLL) as reader:
        writer = spawn("writer", paths.root, 0, 10, 0.05)
        # The writer's start-up (imports; 8 s on a loaded machine once) is not what is measured:
        # from the first batch on, polling alone would take SLOW_POLL per batch.
        check_content(reader.wait_batch(0, timeout=SLOW_POLL - 5), 0)
        t0 = time.monotonic()
        for step in range(1, 10):
            check_content(reader.wait_batch(step, timeout=10), step)
        assert time.monotonic() - t0 < SLOW_POLL / 2
        assert writer.wait(timeout=10) == 0
        assert reader.rings_received >= 1


def test_reader_started_after_the_writer_finds_everything(tmp_path):
    paths = RunPaths(tmp_path / "run")
    writer = spawn("writer", paths.root, 0, 10, 0)
    assert writer.wait(timeout=20) == 0 and writer.stdout.read().strip() == "done"
    with Bus(paths, "trainer", 0, poll_interval=SLOW_POLL) as reader:
        for step in range(10):
            check_content(reader.wait_batch(step, timeout=1), step)


def test_restarted_reader_gets_the_rest_of_the_stream_exactly_once(tmp_path):
    paths = RunPaths(tmp_path / "run")
    total, interval = 20, 0.08
    writer = spawn("writer", paths.root, 0, total, interval)
    first = spawn("reader", paths.root, total)
    got_first = []
    try:
        for line in first.stdout:
            got_first.append(int(line))
            if len(got_first) == 5:
                break
        os.kill(first.pid, signal.SIGKILL)  # crash: its endpoint file stays behind, pointing nowhere
    finally:
        first.kill()
        first.wait()
    assert got_first == [0, 1, 2, 3, 4]
    # The replacement binds a new port; the writer must notice the new endpoint file and ring it.
    t0 = time.monotonic()
    with Bus(paths, "trainer", 0, poll_interval=SLOW_POLL) as second:
        for step in range(5, total):
            check_content(second.wait_batch(step, timeout=10), step)
        assert second.rings_received >= 1
    assert time.monotonic() - t0 < total * interval + 5  # no wait fell back to the 30 s poll
    assert writer.wait(timeout=10) == 0  # the crashed reader never blocked the writer


def test_reader_restarted_every_few_steps_clean_or_not(tmp_path):
    """The reader is replaced every 10 steps, half the time without closing (a hung predecessor
    keeps its socket bound): the writer follows each new endpoint file and nothing is lost or repeated."""
    paths = RunPaths(tmp_path / "run")
    total, interval = 30, 0.04
    writer = spawn("writer", paths.root, 0, total, interval)
    t0 = time.monotonic()
    abandoned = []
    seen = []
    for chunk in range(total // 10):
        reader = Bus(paths, "trainer", 0, poll_interval=SLOW_POLL)
        for step in range(chunk * 10, chunk * 10 + 10):
            batch = reader.wait_batch(step, timeout=10)
            check_content(batch, step)
            seen.append(step)
        if chunk % 2:
            reader.close()
        else:
            abandoned.append(reader)
    assert seen == list(range(total))
    assert time.monotonic() - t0 < total * interval + 5
    assert writer.wait(timeout=10) == 0
    for reader in abandoned:
        reader.close()


if __name__ == "__main__":
    {"writer": _writer, "hammer": _hammer, "reader": _reader}[sys.argv[1]](*sys.argv[2:])
