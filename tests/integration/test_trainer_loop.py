"""The real `hpcrl trainer` process against the real bus; the test plays the orchestrator.

Checks: policy 0 carries the checksum of the base weights; each trained step publishes a new policy
whose weights load from broadcasts/step_N with that checksum; a batch whose loss is non-finite is
reported and skipped (weights unchanged); checkpoints become COMPLETE only once the orchestrator part
exists, and weights/step_N is an HF directory transformers loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcrl import checkpoint
from hpcrl.bus import Bus, TrainBatch
from hpcrl.net import free_port
from hpcrl.paths import RunPaths
from hpcrl.runtime import rank_env
from tests.conftest import rl_toml

pytestmark = pytest.mark.timeout(240)


def _config(tmp: Path, model: Path, out: Path) -> Path:
    cfg = tmp / "cfg.toml"
    cfg.write_text(
        rl_toml(
            3,
            seq_len=64,
            model=str(model),
            batch_size=8,
            top=f'output_dir = "{out}"\n',
            tables="[trainer]\nmicro_batch_tokens = 96\n[trainer.optim]\nlr = 0.01\n[ckpt]\ninterval = 1\n",
        )
    )
    return cfg


def _batch(step: int, rng: np.random.Generator, poison: bool = False) -> TrainBatch:
    lens = rng.integers(12, 40, size=8)
    ids, pos, mask = [], [], []
    for n in lens:
        ids.append(rng.integers(10, 300, size=n))
        pos.append(np.arange(n))
        m = np.zeros(n, bool)
        m[n // 2 :] = True  # completion = second half
        mask.append(m)
    mask_all = np.concatenate(mask)
    adv = np.repeat(np.where(np.arange(8) % 2 == 0, 1.0, -1.0), lens).astype(np.float32)
    if poison:
        adv[np.flatnonzero(mask_all)[0]] = np.nan
    return TrainBatch(
        step=step,
        rank=0,
        world_size=1,
        input_ids=np.concatenate(ids),
        position_ids=np.concatenate(pos),
        seq_lens=lens,
        loss_mask=mask_all,
        advantages=adv * mask_all,
        inference_logprobs=np.where(mask_all, -5.0, 0.0).astype(np.float32),
        policy_versions=np.full(8, step - 1),
        temperatures=np.ones(8),
        env_names=["x"] * 8,
        example_ids=np.arange(8),
        rewards=np.zeros(8),
        total_loss_tokens=int(mask_all.sum()),
    )


def test_trainer_process_trains_publishes_and_checkpoints(tmp_path: Path, tiny_model_dir: Path) -> None:
    from hpcrl.cli import main as cli

    out = tmp_path / "run"
    cfg = _config(tmp_path, tiny_model_dir, out)
    assert cli(["run", str(cfg), "--dry-run"]) == 0
    paths = RunPaths(out)
    env = {
        **os.environ,
        **rank_env(0, 1, "127.0.0.1", free_port()),  # a free port: a fixed one collides with parallel runs
        "OMP_NUM_THREADS": "1",
    }
    log = open(tmp_path / "trainer.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "trainer", "@", str(paths.process_config("trainer"))],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    bus = Bus(paths, role="orchestrator")
    try:
        from hpcrl.inference.loading import load_safetensors_dir  # a sharded dir or one file
        from hpcrl.models.resolve import resolve_model  # noqa: F401  (model is a local dir here)
        from hpcrl.weights.checksum import state_dict_checksum

        p0 = bus.wait_policy(0, timeout=120)
        base = load_safetensors_dir(p0.path)
        assert p0.checksum == state_dict_checksum(base)
        rng = np.random.default_rng(0)
        checksums = [p0.checksum]
        for step in (1, 2, 3):
            bus.publish_batch(step, 0, _batch(step, rng, poison=step == 2))
            pol = bus.wait_policy(step, timeout=120)
            assert pol.step == step
            assert state_dict_checksum(load_safetensors_dir(pol.path)) == pol.checksum
            checksums.append(pol.checksum)
            # The trainer's part is written; COMPLETE must wait for ours.
            deadline = time.monotonic() + 60
            while not checkpoint.part_done(paths, step, "trainer", ranks=1) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not paths.complete_file(step).exists()
            checkpoint.begin_part(paths, step, "orchestrator")
            (paths.orchestrator_ckpt_dir(step) / "state.json").write_text("{}")
            checkpoint.mark_part_done(paths, step, "orchestrator")
        assert proc.wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        bus.close()
        log.close()
    assert checksums[1] != checksums[0]  # step 1 trained
    assert checksums[2] == checksums[1]  # step 2 had a NaN advantage: update skipped
    assert checksums[3] != checksums[2]
    text = (tmp_path / "trainer.log").read_text()
    assert "update skipped" in text
    for step in (1, 2, 3):
        assert checkpoint.verify(paths, step) is None
    assert checkpoint.latest_complete(paths) == 3
    from transformers import AutoModelForCausalLM

    from hpcrl.weights.checksum import state_dict_checksum

    m = AutoModelForCausalLM.from_pretrained(str(paths.weights_dir(3)))
    sd = {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}
    assert state_dict_checksum(sd) == checksums[3]
