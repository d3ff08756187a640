"""A verifiers 0.4 environment that is not part of hpcrl (tests/vf1_envs/vf1_tool_env.py: a v1
taskset + a multi-turn tool harness, played by verifiers' SingleAgentEnv) trains through `hpcrl run`
on the Qwen3-template tiny model with the typed qwen3 renderer, and `hpcrl eval` runs on it. The
episodes run in verifiers' own env server (serve_env / EnvServerPool, 2 workers) and its EnvClient;
the harness program runs in verifiers' `subprocess` runtime, offline. Runs in the 0.4 venv
(the main venv, `verifiers` extra); skipped where verifiers 0.4 is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.envs.runtime.components import alive
from hpcrl.envs.verifiers.versions import installed, major_minor
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif((major_minor(installed()) or (0, 0)) < (0, 4), reason="needs verifiers 0.4"),
]
ROOT = Path(__file__).resolve().parents[2]
ENV_ID = "vf1_tool_env"  # an installed env package: tests/vf1_envs is on PYTHONPATH, not in hpcrl
CONFIG = """max_steps = 3
seq_len = 1024
[log]
plots = false
[model]
name = "hpcrl/tiny-qwen3-think"
[orchestrator]
batch_size = 8
rollouts_per_example = 4
[orchestrator.renderer]
name = "qwen3"
[orchestrator.advantage]
zero_advantage = "keep"
[orchestrator.train.sampling]
max_tokens = 16
[[orchestrator.train.env]]
id = "vf1_tool_env"
workers = 2
args = { num_tasks = 4 }
"""


def _surviving_servers(out: Path, within_s: float = 30.0) -> list[int]:
    """The pids of the run's verifiers env server and its workers (components.json) still running
    `within_s` after the run ended: none may outlive it."""
    pids = []
    for f in (out / "logs" / "envs").glob("*/*/components.json"):
        doc = json.loads(f.read_text())
        pids += [doc["server"]["pid"], *(w["pid"] for w in doc["workers"])]
    assert pids
    deadline = time.monotonic() + within_s
    while any(alive(p, None) == "running" for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p, None) == "running"]


def _hpcrl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'vf1_envs'}")
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, env=env, timeout=800
    )


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One v1-env training run shared by the tests below (it used to be two runs, 3 steps on the dense
    tiny-qwen3-think and 2 on a tiny MoE): 3 steps on a tiny MoE with the same Qwen3 template. The
    dense run's checks hold on it unchanged: the v1 path (verifiers' env server and workers, the
    harness, the qwen3 renderer's bridge, the traces hpcrl turns into samples) never looks at the
    MLP, and router replay only adds the routing rows to the same samples; token exactness
    (mismatch_kl) is what replay is for. The dense model's own RL path stays covered by
    test_renderer_rollouts (tool-think, qwen3 renderer, token-exact)."""
    tmp = tmp_path_factory.mktemp("vf1_moe")
    model = tmp / "tiny-moe-qwen3"
    made = _hpcrl("make-tiny-model", str(model), "--preset", "tiny-moe", "--template", "qwen3")
    assert made.returncode == 0, made.stderr[-2000:]
    cfg, out = tmp / "vf1.toml", tmp / "run"
    cfg.write_text(CONFIG.replace("hpcrl/tiny-qwen3-think", str(model)))
    proc = _hpcrl("run", str(cfg), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_a_v1_env_trains_to_max_steps(moe_run: Path) -> None:
    out = moe_run
    rows = read_metrics(RunPaths(out).metrics_file)
    orch = [m for m in rows if m.get("role") == "orchestrator" and "reward/vf1_tool_env/mean" in m]
    assert [m["step"] for m in orch] == [1, 2, 3]
    for m in orch:
        assert m["errored_rollouts/vf1_tool_env"] == 0.0
        # the harness's 3 model turns, each trained; a turn verifiers re-rendered (its renderer's bridge
        # declined on random completions) starts a new branch, whose turns count too
        assert m["num_turns/vf1_tool_env/mean"] >= 3.0
        assert 0.0 <= m["reward/vf1_tool_env/mean"] <= 1.5
    # Trainer logprobs of the tokens verifiers recorded equal the sampler's: ids and logprobs are exact.
    trainer = [m for m in rows if m.get("role") == "trainer" and "mismatch_kl/mean" in m]
    assert len(trainer) == 3 and all(abs(m["mismatch_kl/mean"]) < 1e-3 for m in trainer), trainer
    server_log = (out / "logs" / "envs" / "train" / ENV_ID / "server.log").read_text()
    assert "EnvServerPool up" in server_log and "workers=2/2" in server_log
    doc = json.loads((out / "logs" / "envs" / "train" / ENV_ID / "components.json").read_text())
    assert doc["server"]["restarts"] == 0 and len(doc["workers"]) == 2, doc
    assert not _surviving_servers(out)
    orch_log = (out / "logs" / "orchestrator.log").read_text()
    assert orch_log.count("running it in the local 'subprocess' runtime") == 1


def test_a_v1_env_on_an_moe_model_replays_the_servers_routing(moe_run: Path) -> None:
    """verifiers' training client asks /inference/v1/generate for the routing (bridged turns send
    routed_experts_prompt_start), its traces keep it per node, hpcrl turns them into per-turn rows and
    the trainer replays them: the replay hit rate is reported, i.e. replayed slots reached the trainer."""
    assert not _surviving_servers(moe_run)
    rows = read_metrics(RunPaths(moe_run).metrics_file)
    trainer = [m for m in rows if m.get("role") == "trainer" and "moe/replay_hit_rate" in m]
    assert [m["step"] for m in trainer] == [1, 2, 3], [m for m in rows if m.get("role") == "trainer"][:1]
    assert all(0.0 < m["moe/replay_hit_rate"] <= 1.0 for m in trainer)


def test_hpcrl_eval_runs_a_v1_env(tmp_path: Path) -> None:
    ev = tmp_path / "eval"
    proc = _hpcrl("eval", ENV_ID, "-m", "hpcrl/tiny-qwen3-think", "-n", "4", "-r", "2", "-t", "16",
                  "--renderer.name", "qwen3", "--output-dir", str(ev))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in (ev / "results.jsonl").read_text().splitlines()]
    assert len(results) == 8 and all(r["error"] is None for r in results), results[:1]
    assert all(r["num_turns"] == 3 and r["completion_tokens"] > 0 for r in results)
    assert all({"correct", "digits", "turns"} <= set(r["metrics"]) for r in results)
    assert all(r["completion"] and r["completion"][0]["role"] == "assistant" for r in results)


@pytest.mark.parametrize(
    ("env_lines", "refusal"),
    [
        ('runtime = "subprocess"', None),
        (
            'runtime = "apptainer"',
            "orchestrator.train.env[0].runtime: env 'vf1_tool_env': runtime 'apptainer' needs `apptainer` on PATH",
        ),
        (
            'runtime = "e2b"',
            "orchestrator.train.env[0].runtime: env 'vf1_tool_env': hosted runtime 'e2b' needs",
        ),
        ('runtime = "lxc"', "orchestrator.train.env[0].runtime: 'lxc' is not a verifiers runtime; allowed:"),
    ],
)
def test_dry_run_checks_the_runtime_can_start(tmp_path: Path, env_lines: str, refusal: str | None) -> None:
    assert shutil.which("apptainer") is None and not os.environ.get("E2B_API_KEY")
    cfg = tmp_path / "vf1.toml"
    cfg.write_text(CONFIG + env_lines + "\n")
    proc = _hpcrl("run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "run"))
    if refusal is None:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and refusal in lines[0], proc.stderr


def test_runtime_on_an_env_that_is_not_v1_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "builtin.toml"
    cfg.write_text(CONFIG.replace('id = "vf1_tool_env"', 'id = "reverse-text"').replace("args = { num_tasks = 4 }", "")
                   + 'runtime = "subprocess"\n')  # fmt: skip
    proc = _hpcrl("run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "config error: orchestrator.train.env[0].runtime: env 'reverse-text' is not a verifiers 0.4 (v1) "
        "environment; only those run in a runtime"
    )


def test_kill_9_of_the_verifiers_env_server_mid_run(tmp_path: Path) -> None:
    """The server is started again, the rollouts it held are errored and counted, the run ends 0."""
    cfg, out = tmp_path / "vf1.toml", tmp_path / "run"
    cfg.write_text(CONFIG.replace("max_steps = 3", "max_steps = 5").replace("workers = 2", "workers = 1"))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'vf1_envs'}")
    log = (tmp_path / "run.out").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    pid_file = out / "logs" / "envs" / "train" / ENV_ID / "server.pid"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        metrics = RunPaths(out).metrics_file
        if metrics.exists() and any(m.get("step") == 1 for m in read_metrics(metrics)):
            break
        time.sleep(0.2)
    first = int(pid_file.read_text())
    os.kill(first, signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, (tmp_path / "run.out").read_text()[-3000:]
    assert int(pid_file.read_text()) != first  # a new server
    doc = json.loads((pid_file.parent / "components.json").read_text())
    assert doc["server"]["pid"] == int(pid_file.read_text()) and doc["server"]["restarts"] == 1
    assert not _surviving_servers(out)
    listed = _hpcrl("components", str(out))
    assert listed.returncode == 0 and "env-server" in listed.stdout and "train/vf1_tool_env" in listed.stdout
    orch_log = (out / "logs" / "orchestrator.log").read_text()
    assert "verifiers' env server of 'vf1_tool_env' died (exit code -9): starting it again" in orch_log
    orch = [m for m in read_metrics(RunPaths(out).metrics_file) if m.get("role") == "orchestrator"]
    assert [m["step"] for m in orch if "reward/vf1_tool_env/mean" in m] == [1, 2, 3, 4, 5]
    errored = sum(m.get("errored_rollouts/vf1_tool_env", 0.0) for m in orch)
    dropped = sum(m.get("filter/all_errored_dropped", 0) for m in orch)
    assert errored + dropped >= 1, orch
