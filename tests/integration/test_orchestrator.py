"""The orchestrator as a real process against a real inference server, with a fake trainer.

The test plays the trainer: it publishes PolicyReady(0) (checksum of the tiny model's tensors),
reads the TrainBatches of steps 1 and 2 from the bus, checks them, and publishes the next policies
(same weights) so that the orchestrator finishes and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcrl.bus import Bus, PolicyReady, TrainBatch
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import InferenceServer

CONFIG = """
max_steps = {max_steps}
seq_len = 256
output_dir = "{run}"
deterministic = {deterministic}

[model]
name = "{model}"

[trainer.broadcast]
transport = "filesystem"

[deployment]
num_inference_servers = 1

[orchestrator]
batch_size = 8
rollouts_per_example = 4
max_async_level = 1
max_concurrent = 16
request_timeout_s = 60
policy_timeout_s = 60

[orchestrator.advantage]
zero_advantage = "keep"

[orchestrator.train.sampling]
max_tokens = 12

[[orchestrator.train.env]]
id = "reverse-text"
args = {{ num_examples = 50 }}
"""

REQUIRED_METRICS = (
    "reward/all/mean", "reward/all/std", "reward/reverse-text/mean", "seq_len/all/mean", "is_truncated/all/mean",
    "num_turns/all/mean", "empty_rollouts/all", "errored_rollouts/all", "off_policy/mean", "off_policy/dropped",
    "filter/easy_dropped", "filter/hard_dropped", "time/wait_for_policy", "time/generate", "perf/samples_per_s",
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One server for the module (its weights end up changed: the mismatch test runs last)."""
    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("orch_server"))
    yield srv
    srv.stop()


def announce(server: InferenceServer, run: Path) -> None:
    """Make the module's server known to the run in `run` (as a launcher-started one would be)."""
    src = RunPaths(server.run_dir).server_file(0)
    dst = RunPaths(run).server_file(0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())


def model_checksum(model_dir: Path) -> tuple[str, int, int]:
    from safetensors.torch import load_file

    from hpcrl.weights.checksum import state_dict_checksum

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return state_dict_checksum(tensors), sum(t.numel() for t in tensors.values()), nbytes


def start_orchestrator(run: Path, model: Path, max_steps: int = 2, deterministic: bool = False,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cfg = run / "orch.toml"
    cfg.write_text(CONFIG.format(run=run, model=model, max_steps=max_steps,
                                 deterministic=str(deterministic).lower()))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    log = open(run / "orchestrator.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "orchestrator", "@", str(cfg), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def check_batch(batch: TrainBatch, step: int, prompt_ids_end: list[int]) -> None:
    assert (batch.step, batch.rank, batch.world_size) == (step, 0, 1)
    assert batch.num_samples == 8 and set(batch.env_names) == {"reverse-text"}
    assert batch.total_loss_tokens == batch.num_loss_tokens > 0
    assert np.all((batch.example_ids >= 0) & (batch.example_ids < 50))
    offsets = batch.sample_offsets()
    per_example: dict[int, list[float]] = {}
    for i in range(batch.num_samples):
        a, b = offsets[i], offsets[i + 1]
        mask, ids = batch.loss_mask[a:b], batch.input_ids[a:b]
        first = int(np.argmax(mask))
        assert mask.any() and mask[first:].all(), "single turn: the loss mask is exactly the completion"
        # Everything before the completion is prompt, ending with the generation prompt.
        assert ids[:first].tolist()[-len(prompt_ids_end):] == prompt_ids_end
        assert np.array_equal(batch.position_ids[a:b], np.arange(b - a))
        lp = batch.inference_logprobs[a:b]
        assert np.all(np.isfinite(lp)) and np.all(lp[mask] <= 0) and np.all(lp[~mask] == 0)
        adv = batch.advantages[a:b]
        assert np.all(adv == adv[0])
        per_example.setdefault(int(batch.example_ids[i]), []).append(float(adv[0]))
        assert max(0, step - 2) <= batch.policy_versions[i] <= step - 1  # max_async_level = 1
    for advs in per_example.values():
        assert len(advs) == 4 and abs(sum(advs)) < 1e-4, advs


@pytest.mark.timeout(180)
def test_orchestrator_publishes_valid_batches(tiny_model_dir: Path, run_dir: Path, server: InferenceServer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    checksum, nparams, nbytes = model_checksum(tiny_model_dir)
    announce(server, run_dir)
    orch = start_orchestrator(run_dir, tiny_model_dir)
    paths = RunPaths(run_dir)
    bus = Bus(paths, role="trainer", rank=0, timeout=90)
    try:
        def policy(step: int) -> None:
            bus.publish_policy(PolicyReady(step=step, transport="filesystem", path=str(tiny_model_dir),
                                           checksum=checksum, num_params=nparams, num_bytes=nbytes))

        policy(0)
        for step in (1, 2):
            check_batch(bus.wait_batch(step, 0), step, gen_prompt)
            policy(step)
        assert orch.wait(timeout=60) == 0, (run_dir / "orchestrator.out").read_text()[-3000:]
    finally:
        if orch.poll() is None:
            orch.kill()
        bus.close()
    lines = [json.loads(x) for x in paths.prompts_log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(len(x["example_ids"]) == 2 for x in lines)
    records = [r for r in read_metrics(paths.metrics_file) if r["role"] == "orchestrator"]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, missing
        assert r["errored_rollouts/all"] == 0 and r["off_policy/dropped"] == 0


@pytest.mark.timeout(120)
def test_checksum_mismatch_is_a_loud_error(tiny_model_dir: Path, run_dir: Path, server: InferenceServer) -> None:
    announce(server, run_dir)
    orch = start_orchestrator(run_dir, tiny_model_dir)
    bus = Bus(RunPaths(run_dir), role="trainer", rank=0)
    try:
        # The weights on disk are the tiny model, but the trainer claims other bytes.
        bus.publish_policy(PolicyReady(step=0, transport="filesystem", path=str(tiny_model_dir),
                                       checksum="xxh3_128:" + "0" * 32, num_params=1, num_bytes=4))
        assert orch.wait(timeout=90) == 1
    finally:
        if orch.poll() is None:
            orch.kill()
        bus.close()
    out = (run_dir / "orchestrator.out").read_text()
    assert "PolicyMismatch" in out and "checksum" in out
    assert not RunPaths(run_dir).rollout_step_dir(1).exists()
