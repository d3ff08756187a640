"""The storage policy with two trainer ranks (real gloo, CPU; hpcrl.storage.retry_together): the
writes interleaved with collectives are retried by every rank together, without a deadlock, and past
storage_timeout_s every rank ends with the same one line.

A worker (this file run as a script on 2 ranks) takes the tiny model with LoRA under FSDP2 (its
policy pieces need gathers: a rank refused mid-way must still take part in them) and:
  A. publishes policy 0 sharded while rank 1's first file cannot be replaced (an immutable file in
     its place, `chattr +i`, for HOLD_S): named on rank 1, retried by both, then complete;
  B. saves checkpoint 1 (Checkpointer.save: the HF export streamed to rank 0, the trainer parts)
     while weights/ is immutable for HOLD_S, where rank 0 alone writes: retried by both, complete;
  C. publishes policy 1 with rank 1's first file immutable for good and storage_timeout_s = 2: both
     ranks raise WriteRefused with the same line; no manifest, no announcement.
Each rank writes what it saw to out/rank<R>.json for the test to check."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.faults import row
from tests.integration.naming import RANKS_CELLS
from tests.integration.ranks import run_ranks

HOLD_S = 2.5
BUCKET_MB = 0.03


def _chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True)


def _refuse_rank1_file(rank: int, hold: float | None, seen: dict) -> None:
    """On rank 1, the next sharded write finds its first bucket file immutable (rename(2) onto it:
    EPERM), made free again after `hold` s (None: never)."""
    import hpcrl.trainer.sharded_publish as sp

    if rank != 1:
        return
    real = sp.write_pieces

    def refusing(directory: Path, r: int, pieces, bucket: int, **kw):
        sp.write_pieces = real  # the first try only
        target = directory / f"rank{r:05d}-00000.safetensors"
        directory.mkdir(parents=True, exist_ok=True)
        target.touch()
        _chattr("+i", target)
        seen["immutable"] = str(target)
        if hold is not None:
            threading.Timer(hold, _chattr, args=("-i", target)).start()
        return real(directory, r, pieces, bucket, **kw)

    sp.write_pieces = refusing


def _worker(run_dir: str, out_dir: str, model_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    from hpcrl.bus import Bus
    from hpcrl.config.schema import CkptConfig, TrainerModelConfig
    from hpcrl.models.tokenizer import load_tokenizer
    from hpcrl.paths import RunPaths
    from hpcrl.storage import WriteRefused
    from hpcrl.trainer import optim, precision
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.checkpointer import Checkpointer
    from hpcrl.trainer.core import Progress
    from hpcrl.trainer.model import hf_named_tensors
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.trainer.setup import Training
    from tests.integration.test_sharded_publish import _model

    env = par.init_distributed(torch.device("cpu"))
    paths, out = RunPaths(run_dir), Path(out_dir)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    lines: list[str] = []
    seen: dict = {"rank": env.rank, "named_at": []}  # when each line was said (time.monotonic())
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage()) or seen["named_at"].append(time.monotonic())  # type: ignore[method-assign]
    logging.getLogger("hpcrl.storage").addHandler(handler)
    logging.getLogger("hpcrl.storage").setLevel(logging.WARNING)
    model = _model("lora", model_dir)
    full = {k: v.contiguous() for k, v in hf_named_tensors(model, dtype="bfloat16")}
    if env.rank == 0:
        save_file(full, str(out / "policy.safetensors"))
    del full
    with Bus(paths, "trainer", env.rank) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, "filesystem", keep=100, dtype="bfloat16", sharded=True,
            shard_bucket_mb=BUCKET_MB, storage_timeout_s=60,
        )  # fmt: skip
        # A: rank 1 refused for HOLD_S in the middle of a write with gathers inside
        _refuse_rank1_file(env.rank, HOLD_S, seen)
        t0 = time.monotonic()
        pub.publish(model, 0)
        seen["A_s"], seen["A_lines"] = time.monotonic() - t0, list(lines)
        seen["A_named_s"] = [t - t0 for t in seen["named_at"]]
        lines.clear()
        seen["named_at"].clear()
        # B: the checkpoint, weights/ immutable where rank 0 alone writes the streamed export
        opt = optim.build_optimizer(model, "adamw", lr=1e-3)
        tr = Training(
            model, load_tokenizer(model_dir), opt, optim.build_scheduler(opt, "constant"),
            torch.device("cpu"), model_dir, env, precision.of_model(TrainerModelConfig(), on_gpu=False),
        )  # fmt: skip
        exported = {k: v.contiguous() for k, v in hf_named_tensors(model, dtype=tr.precision.compute)}
        if env.rank == 0:
            save_file(exported, str(out / "export.safetensors"))
        del exported
        ckpt = Checkpointer(
            CkptConfig(interval=1), paths, tr, 10, parts=("trainer",), finalize_timeout_s=60,
            storage_timeout_s=60,
        )  # fmt: skip
        if env.rank == 0:
            _chattr("+i", paths.weights_root)
            threading.Timer(HOLD_S, _chattr, args=("-i", paths.weights_root)).start()
        t0 = time.monotonic()
        ckpt.save(1, Progress(step=1))
        ckpt.close()
        seen["B_s"], seen["B_lines"] = time.monotonic() - t0, list(lines)
        seen["B_named_s"] = [t - t0 for t in seen["named_at"]]
        lines.clear()
        seen["named_at"].clear()
        # C: rank 1 refused for good, a short bound: every rank ends with the same line
        pub.storage_timeout_s, pub.base_sent = 2, False
        _refuse_rank1_file(env.rank, None, seen)
        t0 = time.monotonic()
        try:
            pub.publish(model, 1)
        except WriteRefused as e:
            seen["C_line"], seen["C_errno"] = str(e), e.errno
        seen["C_s"], seen["C_lines"] = time.monotonic() - t0, list(lines)
        seen["C_named_s"] = [t - t0 for t in seen["named_at"]]
        if "immutable" in seen:
            _chattr("-i", Path(seen["immutable"]))
    (out / f"rank{env.rank}.json").write_text(json.dumps(seen))
    par.barrier()
    par.destroy_distributed()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)


@pytest.mark.timeout(400)
def test_two_ranks_retry_a_refused_write_together(tiny_model_dir: Path, tmp_path: Path) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root")
    from safetensors.torch import load_file

    from hpcrl import checkpoint
    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.paths import RunPaths
    from hpcrl.weights.checksum import state_dict_checksum

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    try:
        run_ranks(__file__, 2, str(run), str(out), str(tiny_model_dir), timeout=360)
    finally:
        subprocess.run(["chattr", "-R", "-i", str(tmp_path)], check=False, capture_output=True)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    paths = RunPaths(run)
    ref = state_dict_checksum(load_file(str(out / "policy.safetensors")))
    # A: named once on rank 1 (its file, EPERM), retried by both until it cleared; the policy whole
    assert r0["A_lines"] == [] and len(r1["A_lines"]) == 2, r1["A_lines"]
    assert r1["A_lines"][0].startswith(
        "trainer: cannot write policy 0: not writable (operation not permitted)"
    )
    assert "rank00001-00000.safetensors" in r1["A_lines"][0] and "EPERM" in r1["A_lines"][0]
    assert r1["A_lines"][1].startswith("trainer: wrote policy 0 after")
    assert r0["A_s"] >= HOLD_S and r1["A_s"] >= HOLD_S, (r0["A_s"], r1["A_s"])
    assert read_message(paths.policy_file(0), PolicyReady).checksum == ref
    assert state_dict_checksum(load_safetensors_dir(str(paths.broadcast_dir(0)))) == ref
    # B: named once on rank 0 (weights/), both waited, then the checkpoint is complete and exact
    assert r1["B_lines"] == [] and len(r0["B_lines"]) == 2, r0["B_lines"]
    assert r0["B_lines"][0].startswith("trainer: cannot write checkpoint step 1 (weights): not writable")
    assert str(paths.weights_root) in r0["B_lines"][0]
    assert r0["B_s"] >= HOLD_S and r1["B_s"] >= HOLD_S, (r0["B_s"], r1["B_s"])
    assert checkpoint.latest_complete(paths) == 1
    export = state_dict_checksum(load_file(str(out / "export.safetensors")))
    assert state_dict_checksum(load_safetensors_dir(str(paths.weights_dir(1)))) == export
    assert not [p for p in paths.weights_root.iterdir() if p.name != "step_1"]  # no tmp left
    # C: past the 2 s bound on rank 1, both ranks end with its one line; nothing half there is taken
    assert r0["C_line"] == r1["C_line"] and r0["C_errno"] == r1["C_errno"], (r0, r1)
    line = r0["C_line"]
    assert line.startswith("cannot write policy 1 for 2 s: not writable (operation not permitted) at ")
    assert "rank00001-00000.safetensors" in line and line.endswith("(storage_timeout_s = 2)"), line
    assert r0["C_s"] < 30 and r1["C_s"] < 30  # no rank left waiting in a collective
    assert not paths.policy_file(1).exists() and not (paths.broadcast_dir(1) / "manifest.json").exists()
    what = "trainer, 2 gloo ranks (LoRA under FSDP2, sharded publish)"
    row(
        what,
        f"rank 1's first policy file immutable (chattr +i) for {HOLD_S} s",
        r1["A_named_s"][0],
        "rank 1 (hpcrl.storage)",
        r1["A_lines"][0][:220],
        "both ranks retried together, no collective left hanging; policy 0 complete",
        "published policy checksum = the model's (manifest and files)",
        *RANKS_CELLS,
    )
    row(
        what,
        f"weights/ immutable for {HOLD_S} s while rank 0 alone writes the checkpoint's HF export",
        r0["B_named_s"][0],
        "rank 0 (hpcrl.storage)",
        r0["B_lines"][0][:220],
        "both ranks waited; checkpoint 1 complete",
        "exported weights checksum = the model's; no tmp left",
        *RANKS_CELLS,
    )
    row(
        what,
        "rank 1's first policy file immutable for good, storage_timeout_s = 2",
        max(r0["C_s"], r1["C_s"]),
        "every rank (WriteRefused, the same line)",
        f"{line[:150]} … {line[-80:]}",
        "every rank ends with the same one line",
        "no manifest and no announcement of policy 1",
        *RANKS_CELLS,
    )
