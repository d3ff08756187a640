"""prime-rl's `env_vars` tables and `slurm.pre_run_command` in the rendered hetjob: each component's
step gets the top-level table under its role's, as assignments before its srun (any value, commas
included; secrets and `${env:NAME}` references expand in the batch shell, never written into the
script); the pre-run command runs once, after env_files and the setup lines, before any step.
Golden render (pure), bash's own syntax check, and the assignments run through bash as the batch
shell would."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.test_slurm_cluster import cluster, jobs  # noqa: F401
from tests.integration.test_slurm_render import check_golden

REPO = "/opt/hpcrl"
RUN = "/scratch/runs/envvars"
SECRET = "sk-slurmenvsecret0123456789abcdef"

CONFIG = f"""
max_steps = 4
seq_len = 64

[env_vars]
PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"
NCCL_DEBUG = "WARN"
WANDB_API_KEY = "{SECRET}"

[slurm]
job_name = "envvars-demo"
gpus_per_node = 0
pre_run_command = 'uv sync --all-extras ; timeout 120 prime sandbox delete --label "swe" -y || true'

[model]
name = "hpcrl/tiny-qwen3"

[orchestrator]
batch_size = 8
rollouts_per_example = 4
[orchestrator.env_vars]
NCCL_DEBUG = "INFO"
JUDGE_URL = "http://judge:8000/v1?a=1,b=2"
[orchestrator.train.sampling]
max_tokens = 8
[[orchestrator.train.env]]
id = "reverse-text"

[trainer.env_vars]
TRITON_CACHE_DIR = "/tmp/.triton cache"

[inference.env_vars]
VLLM_CACHE_ROOT = "/tmp/vllm"
HF_TOKEN = "${{env:MY_HF_TOKEN}}"
"""


def _spec(tmp_path: Path):
    from hpcrl.launch.checks import load
    from hpcrl.launch.placement import slurm_placement
    from hpcrl.launch.slurm import build_spec
    from hpcrl.paths import RunPaths

    f = tmp_path / "rl.toml"
    f.write_text(CONFIG)
    cfg = load([str(f), "--output-dir", RUN]).config
    spec = build_spec(
        cfg, slurm_placement(cfg, nodes=3), RunPaths(RUN), python="/py", scripts=Path(f"{REPO}/sbatch")
    )
    return cfg, spec


def test_env_vars_and_pre_run_command_match_golden(tmp_path: Path) -> None:
    from hpcrl.config.resolved import secret_env
    from hpcrl.launch.slurm import render
    from hpcrl.paths import RunPaths

    cfg, spec = _spec(tmp_path)
    trainer, inference = spec.components
    (orchestrator,) = spec.steps
    assert trainer.user_env == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "NCCL_DEBUG": "WARN",
        "WANDB_API_KEY": "${env:HPCRL_SECRET_ENV_VARS_WANDB_API_KEY}",
        "TRITON_CACHE_DIR": "/tmp/.triton cache",
    }
    assert orchestrator.user_env["NCCL_DEBUG"] == "INFO"  # the role's table wins
    assert (
        inference.user_env["HF_TOKEN"] == "${env:MY_HF_TOKEN}"
        and "TRITON_CACHE_DIR" not in inference.user_env
    )
    text = render(spec, RunPaths(RUN))
    check_golden("hetjob_env_vars.sbatch", text)
    assert SECRET not in text
    assert secret_env(cfg) == {
        "HPCRL_SECRET_ENV_VARS_WANDB_API_KEY": SECRET
    }  # what sbatch's environment carries
    lines = text.splitlines()
    pre = lines.index('uv sync --all-extras ; timeout 120 prime sandbox delete --label "swe" -y || true')
    assert lines[pre - 1] == "# slurm.pre_run_command"
    assert pre < min(i for i, ln in enumerate(lines) if " srun --het-group" in ln or ln.startswith("srun "))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_each_step_gets_its_table_through_bash(tmp_path: Path) -> None:
    """The rendered assignments run in bash as the batch shell would, `srun` being a stub that prints
    the environment it got: every value arrives intact, secrets and references from the shell's."""
    _, spec = _spec(tmp_path)
    from hpcrl.launch.hetjob import _srun_line

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/bash\nenv -0 > "$DUMP"\n')
    (stub / "srun").chmod(0o755)
    for name, index, unit in spec.all_steps():
        line = _srun_line(name, index, unit)
        dump = tmp_path / f"{name}.env"
        shell_env = {
            "PATH": f"{stub}:/usr/bin:/bin",
            "DUMP": str(dump),
            "STEP_LOGS": str(tmp_path),
            "HPCRL_SECRET_ENV_VARS_WANDB_API_KEY": SECRET,
            "MY_HF_TOKEN": "hf_fromthebatchshell",
        }
        subprocess.run(["bash", "-c", f"set -u; {line}"], env=shell_env, check=True)
        got = dict(kv.split("=", 1) for kv in dump.read_text().split("\0") if kv)
        assert got["WANDB_API_KEY"] == SECRET and got["NCCL_DEBUG"] == (
            "INFO" if name == "orchestrator" else "WARN"
        )
        if name == "trainer":
            assert got["TRITON_CACHE_DIR"] == "/tmp/.triton cache"
        if name == "orchestrator":
            assert got["JUDGE_URL"] == "http://judge:8000/v1?a=1,b=2"
        if name == "inference":
            assert got["HF_TOKEN"] == "hf_fromthebatchshell" and "TRITON_CACHE_DIR" not in got


def test_an_unset_reference_stops_the_script_naming_it(tmp_path: Path) -> None:
    _, spec = _spec(tmp_path)
    from hpcrl.launch.hetjob import _srun_line

    inference = spec.components[1]
    r = subprocess.run(
        ["bash", "-c", f"set -u; {_srun_line('inference', 1, inference)}; echo went-on"],
        env={"PATH": "/usr/bin:/bin", "STEP_LOGS": str(tmp_path), "HPCRL_SECRET_ENV_VARS_WANDB_API_KEY": "x"},
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "went-on" not in r.stdout
    assert "MY_HF_TOKEN: is not set (step inference, variable HF_TOKEN references it)" in r.stderr


@pytest.mark.parametrize(
    ("table", "value", "message"),
    [
        ("env_vars", "CUDA_VISIBLE_DEVICES", "set by hpcrl's launcher"),
        ("trainer.env_vars", "SLURM_NTASKS", "set by hpcrl's launcher"),
        ("inference.env_vars", "VLLM_USE_DEEP_GEMM", "set by inference.use_deep_gemm"),
    ],
)
def test_launcher_variables_are_refused(tmp_path: Path, table: str, value: str, message: str) -> None:
    from hpcrl.config import ConfigError
    from hpcrl.launch.checks import load

    f = tmp_path / "rl.toml"
    f.write_text(CONFIG)
    with pytest.raises(ConfigError, match=rf"^{table}\.{value}: .*{message}"):
        load([str(f), f"--{table.replace('_', '-')}.{value}", "1"])


def test_sft_submit_runs_the_pre_run_command_and_env_vars(tmp_path: Path) -> None:
    from hpcrl.config.schema import SFTConfig
    from hpcrl.launch.checks import load
    from hpcrl.launch.sft_submit import build_spec, layout
    from hpcrl.paths import RunPaths

    cfg = load(
        [
            "--model.name", "hpcrl/tiny-qwen3", "--data.name", "x.jsonl", "--slurm.gpus-per-node", "0",
            "--slurm.pre-run-command", "echo ready", "--slurm.setup", '["export HF_TOKEN=hf_abcdefghijklmnopqrstu"]',
            "--env-vars.HF_HOME", "/scratch/hf", "--env-vars.WANDB_API_KEY", SECRET,
        ],
        root=SFTConfig,
    ).config  # fmt: skip
    spec = build_spec(cfg, layout(cfg, 1), RunPaths(RUN), "/py")
    assert list(spec.setup) == [
        'eval "${HPCRL_SECRET_SLURM_SETUP_0}"',
        "# slurm.pre_run_command",
        "echo ready",
    ]
    assert spec.components[0].user_env == {
        "HF_HOME": "/scratch/hf",
        "WANDB_API_KEY": "${env:HPCRL_SECRET_ENV_VARS_WANDB_API_KEY}",
    }


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_submitted_job_starts_every_step_with_its_table(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    """The real local SLURM: every role's processes (trainer, orchestrator, inference and its keeper)
    start with the top-level table under their own, the literal secret arrives through sbatch's
    environment and is nowhere under the output dir, and the pre-run command ran in the batch shell."""
    import json
    import os
    import sys

    from tests.integration.test_env_vars_run import PROBE, REPO, _config
    from tests.integration.test_env_vars_run import SECRET as RUN_SECRET
    from tests.integration.test_slurm_cluster import ended, wait_for

    site, probe, out = tmp_path / "site", tmp_path / "probe", tmp_path / "run"
    site.mkdir()
    probe.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    marker = tmp_path / "pre_run_ran"
    cfg = tmp_path / "rl.toml"
    slurm = (
        f'[slurm]\ngpus_per_node = 0\ntime = "00:20:00"\npre_run_command = "echo $SLURM_JOB_ID > {marker}"\n'
    )
    cfg.write_text(_config(site, probe).replace("[model]", slurm + "[model]", 1))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "PYTHONPATH")}
    env["PROBE_SOURCE"] = "the launching shell"  # sbatch exports it: the batch shell expands the reference
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--nodes", "3", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    from hpcrl.paths import RunPaths

    paths = RunPaths(out)
    job_id = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job_id)
    state = wait_for(lambda: ended(job_id), 600, "the hetjob to finish", every=2)
    log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.glob(f"hetjob_{job_id}.log"))
    assert state == "COMPLETED", log[-3000:]
    assert marker.read_text().strip() == job_id
    seen: dict[str, list[dict]] = {}
    for f in probe.glob("*.json"):
        seen.setdefault(f.name.split(".")[0], []).append(json.loads(f.read_text()))
    assert {"trainer", "orchestrator", "inference"} <= set(seen), sorted(seen)
    for role in ("trainer", "orchestrator", "inference"):
        for rec in seen[role]:
            assert rec["SHARED_X"] == "top" and rec["ROLE_X"] == role, (role, rec)
            assert rec["REF_X"] == "from the launching shell" and rec["secret_ok"], (role, rec)
            assert rec["TRAINER_ONLY"] == ("1" if role == "trainer" else None), (role, rec)
    hits = [str(p) for p in out.rglob("*") if p.is_file() and RUN_SECRET.encode() in p.read_bytes()]
    assert not hits, hits


def test_a_number_is_taken_as_its_text(tmp_path: Path) -> None:
    from hpcrl.launch.checks import load

    f = tmp_path / "rl.toml"
    f.write_text(CONFIG.replace('NCCL_DEBUG = "WARN"', "OMP_NUM_THREADS = 4"))
    cfg = load([str(f)]).config
    assert cfg.env_vars["OMP_NUM_THREADS"] == "4"
