"""Vision-language RL end to end (`[model.vlm]` in `hpcrl run`): a tiny Qwen3-VL built offline trains
for 2 steps on the built-in color-codeword env (PIL-drawn colour images) on CPU (~30 s): the embedded
engine samples with the images, the orchestrator ships their pixel values with each sample, and the
trainer's forward of the sampled tokens reproduces the engine's logprobs at step 1 (the mismatch KL of
text RL, here ~1e-14; without the images it would be ~1e-5). prime-rl's own multimodal config shape
(configs/ci/nightly/multimodal_color_codeword.toml) dry-runs: its taskset resolves to the built-in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.bus.messages import TrainBatch, decode
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import child_env

# prime-rl's configs/ci/nightly/multimodal_color_codeword.toml, key for key
PRIME_RL_MULTIMODAL = """
max_steps = 25
seq_len = 4096

[deployment]
num_train_gpus = 4
num_infer_gpus = 4

[model]
name = "Qwen/Qwen3.5-4B"

[model.vlm]
vision_encoder_attr = "model.visual"
language_model_attr = "model.language_model"

[orchestrator]
batch_size = 256
group_size = 16

[orchestrator.concurrency]
max_inflight = 128

[orchestrator.train.sampling]
max_completion_tokens = 64

[[orchestrator.train.source]]
name = "color-codeword"

[orchestrator.train.source.env.taskset]
id = "color-codeword"
images_per_turn = 1

[orchestrator.train.source.env.agent.harness]
id = "null"

[orchestrator.train.source.env.agent.runtime]
type = "subprocess"

[trainer]

[trainer.model]
impl = "custom"
optimization_dtype = "bfloat16"
reduce_dtype = "bfloat16"

[trainer.optim]
lr = 3e-6

[inference]
"""

RUN = """
max_steps = 2
seq_len = 256
seed = 1
[log]
plots = false
[model]
name = "{model}"
[model.vlm]
[orchestrator]
batch_size = 8
rollouts_per_example = 4
[orchestrator.train.sampling]
max_tokens = 6
[[orchestrator.train.env]]
id = "color-codeword"
args = {{ similarity_weight = 1.0 }}
"""


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def test_prime_rl_multimodal_config_dry_runs_on_the_builtin_env(tmp_path: Path) -> None:
    cfg = tmp_path / "multimodal_color_codeword.toml"
    cfg.write_text(PRIME_RL_MULTIMODAL)
    out = tmp_path / "out"
    proc = subprocess.run(
        _hpcrl("run", str(cfg), "--dry-run", "--output-dir", str(out)),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "running hpcrl's env 'color-codeword'" in text and "as its args: images_per_turn" in text
    assert "impl = 'custom' with [model.vlm]" in text
    resolved = (out / "configs" / "orchestrator.toml").read_text()
    assert "[model.vlm]" in resolved and "images_per_turn = 1" in resolved


@pytest.mark.timeout(600)
def test_vlm_rl_run_trains_on_images(tmp_path: Path) -> None:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "tiny-vlm")
    cfg = tmp_path / "vlm_rl.toml"
    cfg.write_text(RUN.format(model=model))
    out = tmp_path / "out"
    proc = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = RunPaths(out)
    batch = decode(paths.rollout_file(2, 0).read_bytes(), TrainBatch)
    image_id = 402  # the tiny VLM's <|image_pad|> (its config's image_token_id)
    assert batch.images is not None and batch.images.pixel_values.shape[1] == 1536
    # a 32 x 32 image: 2 x 2 patches of 16 px, one merged image token; every sample has one image
    assert [batch.images.sample(i)[1].tolist() for i in range(batch.num_samples)] == [
        [[1, 2, 2]]
    ] * batch.num_samples
    assert batch.images.images_per_sample.tolist() == [1] * batch.num_samples
    # a group's rollouts share their prompt's image: each distinct image is on the wire once
    assert len(batch.images.image_grid_thw) <= 2 < batch.num_samples  # 8 samples: 2 groups of 4
    prompt = ~batch.loss_mask.astype(bool)
    assert int((batch.input_ids[prompt] == image_id).sum()) == batch.num_samples
    rows = read_metrics(paths.metrics_file)
    trained = {m["step"]: m for m in rows if "mismatch_kl/all/mean" in m}
    assert sorted(trained) == [1, 2]
    # step 1: policy 0 sampled, policy 0 trained: the trainer reproduces the engine's logprobs
    assert trained[1]["mismatch_kl/all/mean"] < 1e-8, trained[1]
    assert trained[1]["optim/grad_norm"] > 0  # the similarity reward varies: a real gradient
    rewards = [m["reward/color-codeword/mean"] for m in rows if "reward/color-codeword/mean" in m]
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)
    assert any("reward/color-codeword/exact_match/mean" in m for m in rows)
