"""Secrets reach a verifiers environment through process environments only: a hosted-shape config
with `env_file` and a literal `api_key` argument trains through `hpcrl run`, and afterwards no
secret value is found anywhere under the output dir (every file, binary ones included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.vf_classic import classic_verifiers

classic_verifiers()

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-argsecretvalue0123456789abcdef"
ENV_FILE_TOKEN = "envfile-judge-token-9f8e7d6c5b4a"

# An installed environment package `acme/judge-reverse` (module judge_reverse): it refuses to load
# without the right api_key argument and the JUDGE_TOKEN variable of the env_file, the way a judge
# env checks its keys (vf.ensure_keys).
PACKAGE = f'''
import os

def reversed_exactly(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"].strip() == answer)

def load_environment(api_key: str, num_examples: int = 16):
    import datasets
    import verifiers as vf

    vf.ensure_keys(["JUDGE_TOKEN"])
    if api_key != "{API_KEY}" or os.environ["JUDGE_TOKEN"] != "{ENV_FILE_TOKEN}":
        raise ValueError("wrong secret reached load_environment: " + api_key[:6])
    words = ["abc", "hello", "xyz", "tree", "moon", "cat", "dog", "star"]
    rows = [{{"question": w, "answer": w[::-1]}} for w in (words * 4)[:num_examples]]
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), system_prompt="Reverse the text.",
                            rubric=vf.Rubric(funcs=[reversed_exactly]))
'''

HOSTED = """
model = "hpcrl/tiny-qwen3"
max_steps = 2
seq_len = 64
batch_size = 8
rollouts_per_example = 4
env_file = ["{env_file}"]

[sampling]
max_tokens = 8

[[env]]
id = "acme/judge-reverse"
args = {{ api_key = "{api_key}" }}
"""


def _files_holding(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            hits += [f"{p}: {n.decode()}" for n in needles if n in data]
    return hits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hosted_run_with_env_file_and_api_key_leaves_no_secret_on_disk(tmp_path: Path) -> None:
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "judge_reverse.py").write_text(PACKAGE)
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"# judge credentials\nexport JUDGE_TOKEN='{ENV_FILE_TOKEN}'\n")
    cfg = tmp_path / "rl.toml"
    cfg.write_text(HOSTED.format(env_file=env_file, api_key=API_KEY))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{pkg}{os.pathsep}{REPO}")
    env.pop("JUDGE_TOKEN", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "run",
            str(cfg),
            "--output-dir",
            str(out),
            "--ckpt",
            "--wandb.offline",
            # the tiny model never reverses exactly: rewards are all 0, so no refill rounds
            "--orchestrator.advantage.zero-advantage",
            "keep",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hpcrl: run finished" in r.stdout
    # The roles started from references, not from "***" (the old redaction broke the env).
    role = tomllib.loads((out / "configs" / "orchestrator.toml").read_text())
    assert (
        role["orchestrator"]["train"]["env"][0]["args"]["api_key"]
        == "${env:HPCRL_SECRET_ORCHESTRATOR_TRAIN_ENV_0_ARGS_API_KEY}"
    )
    assert role["env_files"] == [str(env_file)]
    assert (out / "weights" / "step_2").is_dir() and (out / "checkpoints" / "step_2").is_dir()
    hits = _files_holding(out, [API_KEY.encode(), ENV_FILE_TOKEN.encode()])
    assert not hits, hits
    assert API_KEY not in r.stdout + r.stderr and ENV_FILE_TOKEN not in r.stdout + r.stderr
