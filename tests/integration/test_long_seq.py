"""Long sequences end to end on this CPU machine, at Qwen3's vocabulary (hpcrl/tiny-qwen3-151k):

* an RL run with seq_len 8192 (reverse-text prompts of 8,000 letters, ~7.7k tokens per sample) and
  context parallelism cp = 2 over 2 trainer ranks (ring attention, FSDP over both);
* an SFT run with seq_len 8192 (samples of ~8k tokens: a long user turn, a 64-letter answer that
  carries the loss) and the chunked LM head.

Both are as short as they can be (2 steps) and check that the steps really trained on long samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import child_env, rl_toml

REPO = Path(__file__).resolve().parents[2]
MODEL = "hpcrl/tiny-qwen3-151k"


def _env() -> dict[str, str]:
    return child_env()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_run_8k_tokens_cp2(tmp_path: Path) -> None:
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        rl_toml(
            2,
            seq_len=8192,
            model=MODEL,
            batch_size=2,
            rollouts_per_example=2,
            max_tokens=16,
            # 8 tasks, not the default 10,000 (that many 8,000-letter texts took the env server 30 s
            # of CPU to draw). 16 tokens never reverse 8,000 letters: both rollouts score 0, so such
            # groups are kept (advantage 0) rather than refilled by 16 rounds of 8k-token prompts.
            tables="args = { min_len = 8000, max_len = 8000, num_examples = 8, num_eval_examples = 0, "
            'num_val_examples = 0 }\n[orchestrator.advantage]\nzero_advantage = "keep"\n',
        )
    )
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)]
        + ["--deployment.num-trainer-ranks", "2", "--trainer.model.cp", "2"]
        + ["--trainer.micro-batch-tokens", "8192"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    paths = RunPaths(out)
    trainer = [m for m in read_metrics(paths.metrics_file) if m["role"] == "trainer" and "loss/mean" in m]
    assert [m["step"] for m in trainer] == [1, 2]
    print(
        "RL 8k cp=2: "
        + ", ".join(
            f"step {m['step']}: {m['progress/total_tokens']} tokens so far, {m['time/step']:.1f} s"
            for m in trainer
        )
    )
    # 2 samples of ~7.7k tokens per step (counted once, not once per cp rank), 16 loss tokens each
    assert all(2 * 7000 * m["step"] <= m["progress/total_tokens"] <= 2 * 8192 * m["step"] for m in trainer), (
        trainer
    )
    assert [m["progress/total_samples"] for m in trainer] == [2, 4]
    assert all(m["loss_tokens"] == 32 for m in trainer)
    trainer_log = paths.log_file("trainer").read_text()
    assert "context parallel" in trainer_log
    assert "vocab-parallel embedding and LM head: 75968 of 151936 rows per rank" in trainer_log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_run_8k_tokens_chunked(tmp_path: Path) -> None:
    import random

    data = tmp_path / "long.jsonl"
    rng = random.Random(0)
    with data.open("w") as f:
        for _ in range(4):
            # a long document and a short answer: ~8k tokens per sample, the loss on the answer (so
            # the CPU step stays short; the LM head's cost scales with loss tokens)
            text = "".join(rng.choice("abcdefghij") for _ in range(8000))
            msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": text[:64]}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        "\n".join(
            [
                "max_steps = 2",
                "seq_len = 8192",
                "micro_batch_tokens = 8192",
                f'output_dir = "{tmp_path / "run"}"',
                "[model]",
                f'name = "{MODEL}"',
                "logprobs_chunk_tokens = 512",
                "[data]",
                f'name = "{data}"',
                "batch_size = 2",
                "[val]",
                "interval = 0",
            ]
        )
        + "\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)],
        cwd=REPO,
        env={**_env(), "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = {
        x["step"]: x
        for x in read_metrics(RunPaths(tmp_path / "run").metrics_file)
        if x.get("role") == "trainer"
    }
    assert sorted(m) == [1, 2]
    print(
        f"SFT 8k: step 2 {m[2]['progress/num_tokens']} tokens so far, loss {m[2]['loss/mean']:.3f}, "
        f"{m[2]['time/step']:.1f} s/step"
    )
    assert m[2]["progress/num_tokens"] >= 4 * 7500, m[2]
    assert m[2]["data/truncated"] == 0 and m[2]["data/dropped"] == 0
