"""The storage policy's remaining roads (hpcrl.storage, issue 52): a LoRA adapter's publish and its
adapters/step_N, the orchestrator's checkpoint part waited out without blocking its event loop, and
the agreement of several ranks (retry_together) on threads standing in for ranks. Real refusals:
`chattr +i` (as root chmod stops nothing) and a full tmpfs; the gloo ranks are in
tests/integration/test_refused_writes_ranks.py."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl.storage import WriteRefused, retry_together
from tests.integration.faults import Filler, _make_unwritable, _mount_tmpfs, row
from tests.integration.naming import IN_PROCESS_CELLS


@pytest.fixture
def lora_model(tiny_model_dir: Path):
    import torch

    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model

    torch.manual_seed(0)
    model = load_model(tiny_model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj",)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at zero: make the adapter matter
    return model


def _adapter_publisher(root: Path, timeout_s: float):
    from hpcrl.bus.api import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher

    paths = RunPaths(root)
    bus = Bus(paths, role="trainer", listen=False, storage_timeout_s=60)
    pub = PolicyPublisher(paths, bus, rank=0, transport="filesystem", keep=10, storage_timeout_s=timeout_s)
    pub.base_sent = True  # the full first policy went out: only the adapter travels now
    return paths, bus, pub


def test_a_lora_adapter_publish_waits_out_an_unwritable_broadcasts_dir(lora_model, tmp_path, caplog) -> None:
    """broadcasts/ immutable for ~1 s while policy 3's adapter is published: named once (path, errno,
    free space), retried, then written whole and announced with the checksum of what is on disk."""
    from safetensors.torch import load_file

    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.trainer.model import adapter_tensors
    from hpcrl.weights.checksum import state_dict_checksum

    paths, bus, pub = _adapter_publisher(tmp_path / "run", 60)
    paths.broadcasts_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    how, undo = _make_unwritable(paths.broadcasts_dir)
    clear = threading.Timer(1.0, lambda: subprocess.run(undo, check=True))
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            pub.publish(lora_model, 3)
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
        bus.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert (
        lines[0].startswith("trainer: cannot write policy 3 (LoRA adapter): not writable (")
        and len(lines) == 2
    )
    assert str(paths.broadcasts_dir) in lines[0] and " free of " in lines[0], (how, lines)
    assert lines[1].startswith("trainer: wrote policy 3 (LoRA adapter) after")
    d = paths.broadcast_dir(3)
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in paths.broadcasts_dir.iterdir()) == ["step_3"]  # no tmp left
    written = load_file(str(d / "adapter_model.safetensors"))
    msg = read_message(paths.policy_file(3), PolicyReady)
    assert msg.adapter and msg.checksum == state_dict_checksum(written)
    assert msg.checksum == state_dict_checksum(adapter_tensors(lora_model))
    named = next(r.created for r in caplog.records if r.name == "hpcrl.storage")
    row(
        "trainer (LoRA adapter publish)",
        f"broadcasts/ unwritable ({how}) for 1 s (PolicyPublisher in the test's process)",
        named - t0,
        "trainer (hpcrl.storage)",
        lines[0][:220],
        "retried with backoff; written whole once it cleared, then announced",
        "announced checksum = the adapter file's = the model's adapter",
        *IN_PROCESS_CELLS,
    )


def test_a_lora_adapter_refused_mid_file_is_never_left_as_complete(lora_model, tmp_path) -> None:
    """broadcasts/ a full tmpfs: the adapter's safetensors is refused part way (ENOSPC from write(2));
    past storage_timeout_s the publish ends in one line, and no step_N (nor a tmp) is left for a server
    to take as an adapter; nothing is announced. Then the checkpointer's adapters/step_N alike."""
    paths, bus, pub = _adapter_publisher(tmp_path / "run", 0.3)
    why = _mount_tmpfs(paths.broadcasts_dir, "1m")
    if why is not None:
        pytest.skip(why)
    filler = Filler(paths.broadcasts_dir)
    t0 = time.monotonic()
    try:
        with pytest.raises(WriteRefused) as got:
            pub.publish(lora_model, 4)
        took = time.monotonic() - t0
        assert sorted(p.name for p in paths.broadcasts_dir.iterdir()) == ["filler"]
    finally:
        filler.stop()
        subprocess.run(["umount", "-l", str(paths.broadcasts_dir)], check=False)
        bus.close()
    line = str(got.value)
    assert re.match(r"cannot write policy 4 \(LoRA adapter\) for [01] s: disk full at ", line), (
        line
    )  # 0.3 s bound
    assert str(paths.broadcasts_dir) in line and line.endswith("(storage_timeout_s = 0.3)"), line
    assert not paths.policy_file(4).exists()
    row(
        "trainer (LoRA adapter publish)",
        "broadcasts/ a full 1 MB tmpfs (ENOSPC mid-file), past storage_timeout_s = 0.3 s",
        took,
        "the publish's WriteRefused (the role's one line)",
        f"{line[:150]} … {line[-80:]}",
        "ends in one line",
        "no step_4 and no tmp left, nothing announced",
        *IN_PROCESS_CELLS,
    )


def test_the_checkpointers_lora_adapter_waits_out_an_unwritable_dir(lora_model, tmp_path, caplog) -> None:
    from hpcrl.config.schema import CkptConfig
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.checkpointer import Checkpointer

    paths = RunPaths(tmp_path / "run")
    tr = SimpleNamespace(model=lora_model, dist=SimpleNamespace(rank=0, world_size=1))
    ckpt = Checkpointer(
        CkptConfig(adapter_interval=2), paths, tr, 10, storage_timeout_s=60, role="sft trainer"
    )
    assert ckpt.maybe_save_adapter(2)
    paths.adapter_dir(4).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    how, undo = _make_unwritable(paths.adapter_dir(4).parent)
    clear = threading.Timer(1.0, lambda: subprocess.run(undo, check=True))
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            assert ckpt.maybe_save_adapter(4)
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert (
        lines[0].startswith("sft trainer: cannot write LoRA adapter step 4: not writable (")
        and len(lines) == 2
    )
    for s in (2, 4):
        assert sorted(p.name for p in paths.adapter_dir(s).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    named = next(r.created for r in caplog.records if r.name == "hpcrl.storage")
    row(
        "SFT trainer (LoRA adapter checkpoint)",
        f"adapters/ unwritable ({how}) for 1 s (Checkpointer in the test's process)",
        named - t0,
        "sft trainer (hpcrl.storage)",
        lines[0][:220],
        "retried with backoff; written once it cleared",
        "adapters/step_2 and step_4 each whole (config + weights)",
        *IN_PROCESS_CELLS,
    )


def test_the_orchestrator_checkpoint_part_is_waited_out_with_the_event_loop_running(tmp_path, caplog) -> None:
    """checkpoints/ immutable for ~1.5 s while the orchestrator writes its part of checkpoint 4: the
    refusal is named and retried, and meanwhile the event loop goes on (a task ticking every 20 ms
    keeps ticking: rollouts in flight, heartbeats and the stall report would too). A blocking wait
    (time.sleep) would freeze the ticker for the whole retry."""
    from hpcrl.orchestrator.loop import Orchestrator
    from hpcrl.orchestrator.state import OrchestratorState, load_part
    from hpcrl.paths import RunPaths

    paths = RunPaths(tmp_path / "run")
    paths.checkpoints_dir.mkdir(parents=True)
    state = OrchestratorState(
        step=4, checkpoint_step=0, world_size=1, batch_size=2, rollouts_per_example=1, buffer={},
        ready=[], progress={"total_samples": 8}, evaluated=[], pending_steps=[],
    )  # fmt: skip
    orch = SimpleNamespace(
        published={}, state=state, bus=SimpleNamespace(checksum="xxh64"), paths=paths,
        cfg=SimpleNamespace(storage_timeout_s=60),
    )  # fmt: skip
    _, undo = _make_unwritable(paths.checkpoints_dir)
    clear = threading.Timer(1.5, lambda: subprocess.run(undo, check=True))

    async def main() -> tuple[list[float], float, float]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        clear.start()  # a thread: it clears the directory whether or not the loop runs
        t0 = time.monotonic()
        await Orchestrator.save(orch, 4)
        t1 = time.monotonic()
        t.cancel()
        return [x for x in ticks if t0 <= x <= t1], t0, t1

    try:
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            during, t0, t1 = asyncio.run(main())
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
    assert t1 - t0 >= 1.5, t1 - t0  # it was refused until the directory cleared
    # the loop ran all along: ~ (t1 - t0) / 20 ms ticks (a tenth of them on a loaded CI box), and no
    # gap as long as the retry's first wait (1 s), which a blocking retry spends without a tick
    assert len(during) >= (t1 - t0) / 0.02 / 10, (len(during), t1 - t0)
    assert max(b - a for a, b in zip(during, during[1:])) < 0.9
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert lines[0].startswith(
        "orchestrator: cannot write checkpoint step 4 (orchestrator part): not writable"
    )
    assert lines[1].startswith("orchestrator: wrote checkpoint step 4 (orchestrator part) after")
    loaded, pending = load_part(paths, 4)
    assert loaded.step == 4 and loaded.checkpoint_step == 4 and pending == {}


class _Ranks:
    """all_gather_object for `n` threads standing in for ranks (the same contract: every rank calls
    it, each gets every rank's object in rank order)."""

    def __init__(self, n: int) -> None:
        self.n, self.got, self.barrier = n, [None] * n, threading.Barrier(n)

    def gather(self, rank: int):
        def gather(obj):
            self.got[rank] = obj
            self.barrier.wait(10)
            out = list(self.got)
            self.barrier.wait(10)
            return out

        return gather


def _on_ranks(n: int, body) -> list:
    ranks, outs = _Ranks(n), [None] * n

    def run(r: int) -> None:
        try:
            outs[r] = body(r, ranks.gather(r))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            outs[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outs


def _eperm(rank: int) -> OSError:
    return PermissionError(errno.EPERM, os.strerror(errno.EPERM), f"/r/broadcasts/step_5/rank{rank}.json")


def test_ranks_retry_together_and_each_own_part_is_written_once() -> None:
    """Rank 1 is refused twice: every rank tries again with it (a write with collectives inside), all
    wait the same backoff; with each_own a rank whose part went through does not write it again."""
    for each_own, rank0_tries in ((False, 3), (True, 1)):
        tries, sleeps = [0, 0], [[], []]

        def body(r: int, gather, each_own=each_own, tries=tries, sleeps=sleeps):
            def write() -> str:
                tries[r] += 1
                if r == 1 and tries[r] < 3:
                    raise _eperm(1)
                return f"rank {r}"

            return retry_together(
                "trainer", "policy 5", write, 60, gather=gather, each_own=each_own,
                sleep=sleeps[r].append, first_s=0.01,
            )  # fmt: skip

        assert _on_ranks(2, body) == ["rank 0", "rank 1"]
        assert tries == [rank0_tries, 3], each_own
        assert sleeps == [[0.01, 0.02], [0.01, 0.02]]  # the same waits on every rank


def test_one_rank_past_the_bound_ends_every_rank_with_its_one_line() -> None:
    def body(r: int, gather):
        def write() -> None:
            if r == 1:
                raise _eperm(1)

        return retry_together("trainer", "policy 5", write, 0.05, gather=gather, first_s=0.01)

    outs = _on_ranks(3, body)
    assert all(isinstance(o, WriteRefused) for o in outs), outs
    assert len({str(o) for o in outs}) == 1 and len({o.errno for o in outs}) == 1
    line = str(outs[0])
    assert line.startswith("cannot write policy 5 for 0 s: not writable (operation not permitted) at ")
    assert "/r/broadcasts/step_5/rank1.json" in line and line.endswith("(storage_timeout_s = 0.05)")

    def bug(r: int, gather):
        def write() -> None:
            if r == 2:
                raise ValueError("a bug, not a full disk")

        return retry_together("trainer", "policy 6", write, 60, gather=gather)

    outs = _on_ranks(3, bug)
    assert isinstance(outs[2], ValueError)  # where it happened: its own error, at once
    assert [str(o) for o in outs[:2]] == [
        "trainer: rank 2 failed writing policy 6: ValueError: a bug, not a full disk"
    ] * 2
