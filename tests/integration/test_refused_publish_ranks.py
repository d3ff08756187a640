"""The gathered weight publish (`trainer.broadcast.sharded = false`) and its PolicyReady with two
trainer ranks (real gloo, CPU) while the filesystem refuses rank 0's writes (issue 52). Rank 0 alone
writes broadcasts/step_N and policy/step_N, but every rank takes part in each write's storage
agreement (hpcrl.storage.retry_together): the others wait with it instead of running on into the next
step's collectives, and past storage_timeout_s every rank ends with the same one line.

A worker (this file run as a script on 2 ranks) takes the tiny model under FSDP2 (the publish gathers
its shards on every rank) and publishes:
  A. policy 0 while broadcasts/ is unwritable for HOLD_S (the files): named once, on rank 0; both
     ranks return from the publish after it cleared; the next collective finds them together;
  B. policy 1 while policy/ is unwritable for HOLD_S (the announcement): the same;
  C. policy 2 with broadcasts/ unwritable for good, storage_timeout_s = 2: both ranks raise
     WriteRefused with rank 0's line; no announcement;
  D. policy 3 with policy/ unwritable for good, storage_timeout_s = 2: the same, for the announcement;
  E. (between B and C) policy 4 over the collective transport whose broadcast fails on rank 0 (a
     stand-in that raises, as gloo does when a receiver died): all ranks agree, fall back to files and
     write policy 4 as files together while broadcasts/ is unwritable for HOLD_S.
Unwritable: `chattr +i` on the directory as root (chmod does not stop root), else chmod 0555."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

HOLD_S = 2.5
BOUND_S = 2


def _lock(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(d)], check=True)
    else:
        d.chmod(0o555)


def _unlock(d: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], check=False)
    else:
        d.chmod(0o755)


def _worker(run_dir: str, out_dir: str, model_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.storage import WriteRefused
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.model import hf_named_tensors
    from hpcrl.trainer.publish import PolicyPublisher
    from tests.integration.test_sharded_publish import _model

    env = par.init_distributed(torch.device("cpu"))
    paths, out = RunPaths(run_dir), Path(out_dir)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hpcrl.storage").addHandler(handler)
    logging.getLogger("hpcrl.storage").setLevel(logging.WARNING)
    seen: dict = {"rank": env.rank}
    model = _model("full", model_dir)
    full = {k: v.contiguous() for k, v in hf_named_tensors(model, dtype="bfloat16")}
    if env.rank == 0:
        save_file(full, str(out / "policy.safetensors"))
    del full
    with Bus(paths, "trainer", env.rank, storage_timeout_s=60) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, "filesystem", keep=100, dtype="bfloat16", sharded=False,
            storage_timeout_s=60,
        )  # fmt: skip

        def case(name: str, step: int, locked: Path, hold: float | None) -> None:
            """Publish `step` with `locked` unwritable (rank 0 locks it) for `hold` s (None: for good),
            then one collective: which ranks are still together afterwards."""
            timer = None
            if env.rank == 0:
                _lock(locked)
                if hold is not None:
                    timer = threading.Timer(hold, _unlock, args=(locked,))
                    timer.start()
            lines.clear()
            t0 = time.monotonic()
            try:
                pub.publish(model, step)
            except WriteRefused as e:
                seen[f"{name}_line"], seen[f"{name}_errno"] = str(e), e.errno
            seen[f"{name}_s"], seen[f"{name}_lines"] = time.monotonic() - t0, list(lines)
            if timer is not None:
                timer.join()
            elif env.rank == 0:
                _unlock(locked)
            # the next collective (as the next step's would): when did every rank get there
            t = torch.tensor([time.monotonic() - t0])
            got = [torch.zeros(1) for _ in range(env.world_size)]
            torch.distributed.all_gather(got, t)
            seen[f"{name}_arrived_s"] = [float(x.item()) for x in got]

        case("A", 0, paths.broadcasts_dir, HOLD_S)
        case("B", 1, paths.policy_dir, HOLD_S)
        # E: the collective transport, rank 0's broadcast fails (a server died): the policy goes out
        # as files once every rank has agreed, all ranks taking part while broadcasts/ refuses them
        import hpcrl.weights.collective as wc

        def dead_receiver(*a, **k):
            raise RuntimeError("Connection closed by peer")

        wc.broadcast_weights, wc.relay, wc.destroy_group = dead_receiver, lambda g: None, lambda g: None
        pub.transport, pub.group = "collective", object()
        case("E", 4, paths.broadcasts_dir, HOLD_S)
        seen["E_transport"] = pub.transport
        pub.storage_timeout_s = bus.storage_timeout_s = BOUND_S
        case("C", 2, paths.broadcasts_dir, None)
        case("D", 3, paths.policy_dir, None)
    (out / f"rank{env.rank}.json").write_text(json.dumps(seen))
    par.barrier()
    par.destroy_distributed()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)


@pytest.mark.timeout(400)
def test_gathered_publish_refused_on_rank_0_waits_and_ends_on_every_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.paths import RunPaths

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    paths = RunPaths(run)
    try:
        run_ranks(__file__, 2, str(run), str(out), str(tiny_model_dir), timeout=360)
    finally:
        for d in (paths.broadcasts_dir, paths.policy_dir):
            if d.exists():
                _unlock(d)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    from hpcrl.weights.checksum import state_dict_checksum

    ref = state_dict_checksum(load_file(str(out / "policy.safetensors")))
    for name, step, what, where in (
        ("A", 0, "policy 0", paths.broadcasts_dir),
        ("B", 1, "policy step 1", paths.policy_dir),
        ("E", 4, "policy 4", paths.broadcasts_dir),
    ):
        # named once, on rank 0 (the writer); both ranks waited it out in the publish, then met
        assert r1[f"{name}_lines"] == [] and len(r0[f"{name}_lines"]) == 2, (name, r0, r1)
        assert r0[f"{name}_lines"][0].startswith(f"trainer: cannot write {what}: not writable ("), r0
        assert str(where) in r0[f"{name}_lines"][0], r0[f"{name}_lines"][0]
        assert r0[f"{name}_lines"][1].startswith(f"trainer: wrote {what} after"), r0
        assert r0[f"{name}_s"] >= HOLD_S and r1[f"{name}_s"] >= HOLD_S, (name, r0, r1)
        arrived = r0[f"{name}_arrived_s"]
        assert arrived[1] >= HOLD_S and abs(arrived[0] - arrived[1]) < 1.0, (name, arrived)
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.checksum == ref and state_dict_checksum(load_safetensors_dir(msg.path)) == ref
    assert r0["E_transport"] == r1["E_transport"] == "filesystem"
    assert read_message(paths.policy_file(4), PolicyReady).transport == "filesystem"
    for name, step, what in (("C", 2, "policy 2"), ("D", 3, "policy step 3")):
        # past the bound: every rank raises rank 0's one line, and they meet right after it
        assert r0[f"{name}_line"] == r1[f"{name}_line"] and r0[f"{name}_errno"] == r1[f"{name}_errno"]
        line = r0[f"{name}_line"]
        assert line.startswith(f"cannot write {what} for {BOUND_S} s: not writable ("), line
        assert line.endswith(f"(storage_timeout_s = {BOUND_S})"), line
        assert r1[f"{name}_s"] >= BOUND_S and r0[f"{name}_s"] < 30 and r1[f"{name}_s"] < 30, (r0, r1)
        assert abs(r0[f"{name}_arrived_s"][0] - r0[f"{name}_arrived_s"][1]) < 1.0, r0
        assert not paths.policy_file(step).exists()
    assert not (paths.broadcast_dir(2)).exists()
