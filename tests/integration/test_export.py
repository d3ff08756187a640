"""ckpt.hf_weights = "never" + `hpcrl export`: real runs write checkpoints without weights/step_N;
`hpcrl export` turns the sharded trainer state into HF weights bit-identical to the policy the trainer
published at that step (equal checksums) for the dense tiny model on 2 gloo ranks and the tiny MoE
under ep = 2; a warm start from the export and from the checkpoint itself begins at those weights, and
`hpcrl resume` continues from the checkpoint without HF weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.bus import PolicyReady
from hpcrl.bus.files import read_message
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration.tiny_run import TINY_RL

RANKS2 = "[deployment]\nnum_trainer_ranks = 2\n"
MOE = rl_toml(
    2,
    seq_len=64,
    model="hpcrl/tiny-qwen3-moe",
    max_tokens=8,
    tables='[trainer.model]\nname = "hpcrl/tiny-qwen3-moe"\nimpl = "custom"\nep = 2\n' + RANKS2,
)


def _hpcrl(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _dir_checksum(d: Path) -> str:
    from safetensors.torch import load_file

    from hpcrl.weights.checksum import state_dict_checksum

    state: dict = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state_dict_checksum(state)


def _policy(run: Path, step: int) -> str:
    return read_message(RunPaths(run).policy_file(step), PolicyReady).checksum


def _trained_steps(run: Path) -> list[int]:
    rows = read_metrics(RunPaths(run).metrics_file)
    return [m["step"] for m in rows if m.get("role") == "trainer" and "loss/mean" in m]


def _run_without_hf(tmp: Path, text: str) -> Path:
    cfg, out = tmp / "cfg.toml", tmp / "run"
    cfg.write_text(text)
    _hpcrl("run", str(cfg), "--output-dir", str(out), "--ckpt", "--ckpt.hf-weights", "never",
           "--trainer.optim.lr", "1e-3")  # fmt: skip
    paths = RunPaths(out)
    assert checkpoint.verify(paths, 2) is None  # a complete, resumable checkpoint
    assert not paths.weights_dir(2).exists()  # and no HF weights written by rank 0
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dense_two_ranks_export_warm_start_and_resume(tmp_path: Path) -> None:
    run = _run_without_hf(tmp_path, TINY_RL.format(steps=2) + RANKS2)
    want = _policy(run, 2)
    assert want != _policy(run, 0)
    step_dir = RunPaths(run).checkpoint_dir(2)
    listing = _hpcrl("checkpoints", str(run)).stdout
    assert f"(none: hpcrl export {step_dir})" in listing
    out = tmp_path / "hf"
    _hpcrl("export", str(step_dir), "--out", str(out))
    assert _dir_checksum(out) == want  # bit-identical to the policy the trainer published at step 2
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    # warm start from the export (an HF dir) and from the checkpoint without HF weights
    cfg = tmp_path / "one.toml"
    cfg.write_text(TINY_RL.format(steps=1))
    for i, ref in enumerate((out, step_dir)):
        warm = tmp_path / f"warm{i}"
        _hpcrl("run", str(cfg), "--output-dir", str(warm), "--ckpt.warm-start", str(ref))
        assert _policy(warm, 0) == want, ref
        assert _trained_steps(warm) == [1]
    # resume from the checkpoint that has no HF weights: steps 3 and 4 follow
    _hpcrl("resume", "--step", "-1", "--output-dir", str(run), "--max-steps", "4")
    assert [s for s in _trained_steps(run) if s > 2] == [3, 4]
    assert not RunPaths(run).weights_dir(4).exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_ep2_export_is_the_published_policy(tmp_path: Path) -> None:
    run = _run_without_hf(tmp_path, MOE)
    _hpcrl("export", str(RunPaths(run).checkpoint_dir(2)))  # default: <run>/weights/step_2
    out = RunPaths(run).weights_dir(2)
    from safetensors.torch import load_file

    names = {n for f in out.glob("*.safetensors") for n in load_file(str(f))}
    assert any(".mlp.experts.0." in n for n in names)  # per-expert HF names
    assert _dir_checksum(out) == _policy(run, 2)
