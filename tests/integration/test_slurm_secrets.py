"""Secrets on SLURM: the batch script sources env_files by path, runs a slurm.setup line that holds a
literal secret as `eval "$HPCRL_SECRET_SLURM_SETUP_<i>"`, and the value reaches the job through
sbatch's environment only. Golden render (pure) and a real submission on the local SLURM: a tiny run
whose verifiers env needs an api_key from an env_file completes, leaves no secret anywhere under the
output dir (logs/slurm/ and the rendered hetjob.sbatch included), and `hpcrl resume` of it needs
nothing re-exported for env_file secrets (the setup line's literal secret, kept only in process
environments, is named in one line before anything is submitted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_slurm_cluster import cluster, jobs  # noqa: F401
from tests.integration.test_slurm_render import check_golden
from tests.vf_classic import classic_verifiers

REPO = Path(__file__).resolve().parents[2]
JUDGE_KEY = "sk-judgekeyfromenvfile0123456789ab"  # only in the env_file
HF_TOKEN = "hf_setuplinesecretABCDEFGHIJKLMNOP"  # only in a slurm.setup line of the config

# A verifiers environment package that refuses to load without the env_file's key as its api_key
# argument; it reports (outside the run dir) whether the setup line's variable reached the step.
PACKAGE = f'''
import os
from pathlib import Path

def reversed_exactly(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"].strip() == answer)

def load_environment(api_key: str, probe: str = "", num_examples: int = 16):
    import datasets
    import verifiers as vf

    if api_key != "{JUDGE_KEY}":
        raise ValueError("wrong api_key reached load_environment: " + api_key[:6])
    if probe:
        tag = "job%s_restart%s" % (os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0"))
        Path(probe, tag).write_text(str(os.environ.get("HF_TOKEN") == "{HF_TOKEN}"))
    words = ["abc", "hello", "xyz", "tree", "moon", "cat", "dog", "star"]
    rows = [{{"question": w, "answer": w[::-1]}} for w in (words * 4)[:num_examples]]
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), system_prompt="Reverse the text.",
                            rubric=vf.Rubric(funcs=[reversed_exactly]))
'''

CONFIG = """
max_steps = {steps}
seq_len = 64
env_files = ["{env_file}"]
[model]
name = "hpcrl/tiny-qwen3"
[orchestrator]
batch_size = 8
rollouts_per_example = 4
[orchestrator.advantage]
zero_advantage = "keep"  # the tiny model never reverses exactly: rewards are all 0 (no refill rounds)
[orchestrator.train.sampling]
max_tokens = 8
[[orchestrator.train.env]]
id = "acme/judge-reverse"
args = {{ api_key = "${{env:JUDGE_API_KEY}}", probe = "{probe}" }}
[slurm]
gpus_per_node = 0
time = "00:15:00"
setup = ["export HF_TOKEN={hf_token}", "export JUDGE_SITE={site}"]
[ckpt]
interval = 2
"""


def _write(tmp: Path, steps: int = 2, env_file: str | None = None) -> Path:
    site, probe = tmp / "site", tmp / "probe"
    site.mkdir(exist_ok=True)
    probe.mkdir(exist_ok=True)
    (site / "judge_reverse.py").write_text(PACKAGE)
    ef = Path(env_file or tmp / "secrets.env")
    ef.write_text(f"# judge credentials\nJUDGE_API_KEY={JUDGE_KEY}\n") if env_file is None else None
    cfg = tmp / "rl.toml"
    cfg.write_text(CONFIG.format(steps=steps, env_file=ef, probe=probe, hf_token=HF_TOKEN, site=site))
    return cfg


def _files_holding(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            hits += [f"{p}: {n}" for n in needles if n.encode() in data]
    return hits


def _clean_env(tmp: Path) -> dict[str, str]:
    """The submitting shell: the env package importable, none of the secrets, no HPCRL_SECRET_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL_SECRET_")}
    env["PYTHONPATH"] = f"{tmp / 'site'}{os.pathsep}{REPO}"
    for k in ("JUDGE_API_KEY", "HF_TOKEN"):
        env.pop(k, None)
    return env


def test_secret_setup_and_env_files_render_by_reference(tmp_path: Path, monkeypatch) -> None:
    """Golden: env_file sourced by path, the secret setup line as an eval of its variable; the value is
    in secret_env (what `hpcrl submit` hands to sbatch) and in no rendered text."""
    from hpcrl.config.resolved import secret_env
    from hpcrl.launch.checks import load
    from hpcrl.launch.placement import slurm_placement
    from hpcrl.launch.slurm import build_spec, render
    from hpcrl.paths import RunPaths

    cfg_file, env_file = tmp_path / "rl.toml", tmp_path / "judge.env"
    env_file.write_text(f"JUDGE_API_KEY={JUDGE_KEY}\n")  # loaded by the config loader, never rendered
    cfg_file.write_text(
        CONFIG.format(steps=2, env_file=env_file, probe="", hf_token=HF_TOKEN, site="/opt/site")
    )
    classic_verifiers()
    (tmp_path / "judge_reverse.py").write_text(PACKAGE)  # the env id must name an installed package
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load([str(cfg_file), "--output-dir", "/scratch/runs/secrets"], require_envs=False).config
    paths = RunPaths("/scratch/runs/secrets")
    spec = build_spec(
        cfg,
        slurm_placement(cfg, 3),
        paths,
        python="/opt/hpcrl/.venv/bin/python",
        scripts=Path("/opt/hpcrl/sbatch"),
    )
    text = render(spec, paths)
    check_golden("hetjob_secrets.sbatch", text.replace(str(tmp_path), "/secure"))  # machine-independent
    assert f"set -a; . {env_file}; set +a" in text
    assert 'eval "${HPCRL_SECRET_SLURM_SETUP_0}"' in text
    assert "export JUDGE_SITE=/opt/site" in text  # a line without a secret stays as written
    assert HF_TOKEN not in text and JUDGE_KEY not in text
    assert secret_env(cfg) == {"HPCRL_SECRET_SLURM_SETUP_0": f"export HF_TOKEN={HF_TOKEN}"}
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # A later launch (resume) sees only the reference: its variable must be set again, checked up front.
    from hpcrl.config import secrets
    from hpcrl.config.resolved import to_dict
    from hpcrl.errors import ConfigError

    written = secrets.externalize(to_dict(cfg))[0]
    secrets.check_secret_refs(written, secret_env(cfg))
    with pytest.raises(ConfigError, match=r"slurm\.setup\[0\].*HPCRL_SECRET_SLURM_SETUP_0 is not set"):
        secrets.check_secret_refs(written, {"JUDGE_API_KEY": "x"})


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_submit_with_secrets_completes_leaves_none_and_resumes(cluster, jobs, tmp_path: Path) -> None:  # noqa: F811
    from hpcrl import checkpoint
    from hpcrl.paths import RunPaths
    from tests.integration.test_slurm_cluster import ended, wait_for

    classic_verifiers()
    cfg = _write(tmp_path)
    out = tmp_path / "run"
    env = _clean_env(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--nodes", "3", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    paths = RunPaths(out)
    job = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job)
    state = wait_for(lambda: ended(job), 400, "the hetjob to finish", every=2)
    log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.rglob("*.log"))
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == 2
    # The setup line's secret reached the step that builds the environment (through sbatch's env).
    assert (tmp_path / "probe" / f"job{job}_restart0").read_text() == "True"
    script = (paths.slurm_dir / "hetjob.sbatch").read_text()
    assert 'eval "${HPCRL_SECRET_SLURM_SETUP_0}"' in script and f". {tmp_path / 'secrets.env'}" in script
    assert not _files_holding(out, [JUDGE_KEY, HF_TOKEN]), _files_holding(out, [JUDGE_KEY, HF_TOKEN])
    assert JUDGE_KEY not in r.stdout + r.stderr and HF_TOKEN not in r.stdout + r.stderr

    # Resume. The setup line's secret lived only in the first submission's environment: without it,
    # one line naming the variable, exit 2, nothing submitted.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "resume",
            "--step",
            "-1",
            "--output-dir",
            str(out),
            "--max-steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(tmp_path),
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "HPCRL_SECRET_SLURM_SETUP_0" in r.stderr and r.stderr.count("\n") == 1, (
        r.stderr
    )
    assert str(json.loads(paths.job_file.read_text())["job_id"]) == job
    # Exporting that one again is enough: the env_file's key is re-read from its file on the nodes.
    env = _clean_env(tmp_path) | {"HPCRL_SECRET_SLURM_SETUP_0": f"export HF_TOKEN={HF_TOKEN}"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "resume",
            "--step",
            "-1",
            "--output-dir",
            str(out),
            "--max-steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout + r.stderr
    job2 = str(json.loads(paths.job_file.read_text())["job_id"])
    jobs.append(job2)
    state = wait_for(lambda: ended(job2), 400, "the resumed job to finish", every=2)
    log = "".join(p.read_text(errors="replace") for p in paths.slurm_logs_dir.rglob("*.log"))
    assert state == "COMPLETED", log[-3000:]
    assert checkpoint.latest_complete(paths) == 3
    assert (tmp_path / "probe" / f"job{job2}_restart0").read_text() == "True"
    assert not _files_holding(out, [JUDGE_KEY, HF_TOKEN]), _files_holding(out, [JUDGE_KEY, HF_TOKEN])
