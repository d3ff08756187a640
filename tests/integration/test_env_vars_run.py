"""`env_vars` reach every process `hpcrl run` starts, before its interpreter starts: a tiny CPU run
whose env_vars put a probe `sitecustomize` on PYTHONPATH (read by Python at start-up, so only a
variable in the process's environment from exec can do it). Every Python process of the run records
the variables it was started with; each role sees the top-level table under its own, a `${env:NAME}`
reference resolved from the launching shell, and a literal secret that no file under the output dir
holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import rl_toml

REPO = Path(__file__).resolve().parents[2]
SECRET = "sk-envvarsecret0123456789abcdefgh"

PROBE = """
import json, os, sys
from pathlib import Path

if "hpcrl.cli" in sys.orig_argv:
    keys = ("SHARED_X", "ROLE_X", "TRAINER_ONLY", "REF_X")
    seen = {k: os.environ.get(k) for k in keys}
    seen["secret_ok"] = os.environ.get("OPENAI_API_KEY") == "SECRET"
    role = sys.orig_argv[sys.orig_argv.index("hpcrl.cli") + 1]
    Path(os.environ["PROBE_DIR"], f"{role}.{os.getpid()}.json").write_text(json.dumps(seen))
""".replace("SECRET", SECRET)


def _config(site: Path, probe: Path) -> str:
    path = os.pathsep.join([str(site), str(REPO)])
    top = (
        f'env_vars = {{ PROBE_DIR = "{probe}", PYTHONPATH = "{path}", SHARED_X = "top", ROLE_X = "top", '
        f'REF_X = "from ${{env:PROBE_SOURCE}}", OPENAI_API_KEY = "{SECRET}" }}\n'
    )
    tables = (
        '[trainer.env_vars]\nROLE_X = "trainer"\nTRAINER_ONLY = "1"\n'
        '[orchestrator.env_vars]\nROLE_X = "orchestrator"\n'
        '[inference.env_vars]\nROLE_X = "inference"\n'
    )
    return rl_toml(2, seq_len=64, batch_size=8, max_tokens=8, top=top, tables=tables)


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [
        str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_role_starts_with_its_env_vars(tmp_path: Path) -> None:
    site, probe, out = tmp_path / "site", tmp_path / "probe", tmp_path / "run"
    site.mkdir()
    probe.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    cfg = tmp_path / "rl.toml"
    cfg.write_text(_config(site, probe))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "PYTHONPATH")}
    env["PROBE_SOURCE"] = "the launching shell"
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen: dict[str, list[dict]] = {}
    for f in probe.glob("*.json"):
        seen.setdefault(f.name.split(".")[0], []).append(json.loads(f.read_text()))
    assert {"trainer", "orchestrator", "inference"} <= set(seen), sorted(seen)
    for role, records in seen.items():
        want_role = role if role in ("trainer", "orchestrator", "inference") else "top"
        for rec in records:
            assert rec["SHARED_X"] == "top" and rec["ROLE_X"] == want_role, (role, rec)
            assert rec["REF_X"] == "from the launching shell" and rec["secret_ok"], (role, rec)
            assert rec["TRAINER_ONLY"] == ("1" if role == "trainer" else None), (role, rec)
    # The literal secret travels in process environments only: configs/ holds a reference.
    assert not _files_holding(out, SECRET.encode())
    assert SECRET not in r.stdout + r.stderr
    resolved = (out / "configs" / "trainer.toml").read_text()
    assert "${env:HPCRL_SECRET_ENV_VARS_OPENAI_API_KEY}" in resolved
    assert 'REF_X = "from ${env:PROBE_SOURCE}"' in resolved  # a reference stays one


def test_a_standalone_inference_server_applies_its_table(tmp_path: Path, monkeypatch) -> None:
    """`hpcrl inference` started by hand (k8s, a script) gets env_vars under inference.env_vars in its
    own process before the backend loads, as prime-rl's standalone server does."""
    from hpcrl.inference import server
    from hpcrl.launch.checks import load

    f = tmp_path / "rl.toml"
    f.write_text(
        rl_toml(
            2,
            seq_len=64,
            top='env_vars = { SHARED_X = "top", ROLE_X = "top", TOKEN_REF = "${env:PROBE_SOURCE}" }\n',
            tables='[trainer.env_vars]\nTRAINER_ONLY = "1"\n[inference.env_vars]\nROLE_X = "inference"\n',
        )
    )
    monkeypatch.setenv("PROBE_SOURCE", "from the shell")
    for k in ("SHARED_X", "ROLE_X", "TOKEN_REF", "TRAINER_ONLY"):
        monkeypatch.setenv(k, "")  # recorded, so what serve_config sets is undone after the test
        monkeypatch.delenv(k)
    seen: dict[str, str | None] = {}
    monkeypatch.setattr(
        server,
        "serve",
        lambda opts: seen.update(
            {k: os.environ.get(k) for k in ("SHARED_X", "ROLE_X", "TOKEN_REF", "TRAINER_ONLY")}
        ),
    )
    server.serve_config(load([str(f)], role="inference").config)
    assert seen == {
        "SHARED_X": "top",
        "ROLE_X": "inference",
        "TOKEN_REF": "from the shell",
        "TRAINER_ONLY": None,
    }


def test_an_sft_rank_runs_with_its_table(tmp_path: Path, monkeypatch) -> None:
    """prime-rl's SFT `env_vars`: the rank applies them before training (ranks it spawns inherit them;
    on SLURM the script gives them to every rank: test_slurm_env_vars)."""
    import hpcrl.trainer.sft
    from hpcrl.config.schema import SFTConfig
    from hpcrl.launch import sft
    from hpcrl.launch.checks import load

    monkeypatch.setenv("SFT_PROBE", "")
    monkeypatch.delenv("SFT_PROBE")
    seen = {}
    monkeypatch.setattr(
        hpcrl.trainer.sft, "train", lambda cfg, paths: seen.update(v=os.environ.get("SFT_PROBE")) or 0
    )
    cfg = load(
        ["--model.name", "hpcrl/tiny-qwen3", "--data.name", "x.jsonl", "--env-vars.SFT_PROBE", "on",
         "--output-dir", str(tmp_path / "sft")],
        root=SFTConfig,
    ).config  # fmt: skip
    assert sft.main(cfg) == 0 and seen == {"v": "on"}
