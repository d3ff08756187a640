"""checkpoint_id / ckpt.warm_start: a new run begins, at step 0, from the weights of another run's
checkpoint (checked by checksum of the policy the new trainer publishes first), for full fine-tuning
and LoRA; ids come from `hpcrl checkpoints RUN_DIR`; a different model is a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.bus import PolicyReady
from hpcrl.bus.files import read_message
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.integration.tiny_run import TINY_RL


def _hpcrl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, timeout=400, cwd=cwd
    )


def _weights_checksum(d: Path) -> str:
    from safetensors.torch import load_file

    from hpcrl.weights.checksum import state_dict_checksum

    state: dict = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state_dict_checksum(state)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("source")
    cfg = tmp / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=2))
    out = tmp / "run"
    r = _hpcrl("run", str(cfg), "--output-dir", str(out), "--ckpt", "--trainer.optim.lr", "1e-3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def _policy0(run: Path) -> PolicyReady:
    return read_message(RunPaths(run).policy_file(0), PolicyReady)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_warm_start_begins_from_the_checkpoint_weights(source_run: Path, tmp_path: Path, lora: bool) -> None:
    listing = _hpcrl("checkpoints", str(source_run))
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.split()[1:3] == ["2", "ready"])
    ckpt_id = row.split()[0]
    want = _weights_checksum(RunPaths(source_run).weights_dir(2))
    assert want != _policy0(source_run).checksum  # the source run did move away from the base model
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=1))
    out = tmp_path / "warm"
    extra = ["--model.lora", "--model.lora.rank", "4"] if lora else []
    r = _hpcrl("run", str(cfg), "--output-dir", str(out), "--ckpt.warm-start", ckpt_id, *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # Policy 0 of the new run (what the trainer publishes before its first step) is exactly the
    # checkpoint's weights; then it trains step 1 of its own count.
    assert _policy0(out).checksum == want
    steps = [
        m["step"]
        for m in read_metrics(RunPaths(out).metrics_file)
        if m.get("role") == "trainer" and "loss/mean" in m
    ]
    assert steps == [1]


def test_checkpoint_references_and_model_mismatch(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpcrl.cli import main

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=1))
    for ref in (str(source_run / "checkpoints" / "step_2"), str(source_run / "weights" / "step_2")):
        assert (
            main(
                ["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o"), "--ckpt.warm-start", ref]
            )
            == 0
        )
    capsys.readouterr()
    cases = [
        (
            ["--model.name", "hpcrl/small-qwen3"],
            str(source_run / "checkpoints" / "step_2"),
            "was trained from model 'hpcrl/tiny-qwen3', this run's model is 'hpcrl/small-qwen3'",
        ),
        ([], "ckpt_000000000000", "unknown checkpoint id 'ckpt_000000000000'"),
        ([], str(source_run / "checkpoints" / "step_99"), "is neither a checkpoint"),
    ]
    for flags, ref, expected in cases:
        assert (
            main(
                [
                    "run",
                    str(cfg),
                    "--dry-run",
                    "--output-dir",
                    str(tmp_path / "o"),
                    "--ckpt.warm-start",
                    ref,
                    *flags,
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert (
            err.startswith("config error: ckpt.warm_start: ") and err.count("\n") == 1 and expected in err
        ), err
