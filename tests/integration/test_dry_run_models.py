"""Every command's --dry-run checks each model it names (and SFT's datasets) where start will look for
it: a local directory (it must hold config.json), a built-in, the Hugging Face cache, or else one line
saying it will be downloaded at start; with HF_HUB_OFFLINE=1 that last case is a one-line error naming
the field, since start would fail. The caches are laid out in tmp dirs as huggingface_hub and datasets
read them; nothing here reaches the network (the download entry points and non-local sockets fail)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.models.hub import seed_cache
from tests.conftest import rl_toml

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "tiny-org/tiny-qwen3"
MISSING = "no-org/made-up-model"
DATASET = "tiny-org/tiny_sft"
MISSING_DATASET = "no-org/made-up-dataset"
COMMANDS = ["run", "submit", "resume", "sft", "trainer", "orchestrator", "inference", "eval"]
DOWNLOAD = "is not in the Hugging Face cache: it will be downloaded at"


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"a dry run tried to download: {args} {kwargs}")


@pytest.fixture
def hf(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp: HUB_ID in its hub cache, DATASET in its datasets cache; no network."""
    import datasets
    import huggingface_hub
    from huggingface_hub import constants

    home = tmp_path / "hf"
    seed_cache(tiny_model_dir, HUB_ID, home / "hub")
    _seed_dataset(home / "datasets", DATASET)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    # Both libraries read their cache paths once, at import: this process imported them already.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _no_network)
    monkeypatch.setattr(datasets, "load_dataset", _no_network)
    real_connect = socket.socket.connect

    def local_only(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):  # type: ignore[index]
            raise AssertionError(f"a dry run opened a connection to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    # submit: no SLURM controller to ask (sinfo, sbatch --test-only); the plan is left to sbatch.
    from hpcrl.launch import submit

    monkeypatch.setattr(submit, "partition_nodes", lambda partition: None)
    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda cmd, *a, **k: None if cmd == "sbatch" else which(cmd, *a, **k)
    )
    return home


def _seed_dataset(cache: Path, repo_id: str, rows: int = 4) -> Path:
    """A Hub dataset as `datasets.load_dataset` leaves it in its cache (and reads it offline):
    <org>___<name>/<config>/<version>/<hash>/{dataset_info.json, <name>-<split>.arrow}."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    org, name = repo_id.split("/")
    out = cache / f"{org}___{name}" / "default" / "0.0.0" / "0123abcd"
    out.mkdir(parents=True)
    features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string")})
    with ArrowWriter(features=features, path=str(out / f"{name}-train.arrow")) as w:
        for i in range(rows):
            w.write({"prompt": f"reverse: ab{i}", "completion": f"{i}ba"})
        n, size = w.finalize()
    split = datasets.SplitInfo(name="train", num_bytes=size, num_examples=n, dataset_name=name)
    datasets.DatasetInfo(
        features=features,
        dataset_name=name,
        config_name="default",
        splits=datasets.SplitDict({"train": split}),
    ).write_to_directory(str(out))
    return out


def _data_file(tmp_path: Path) -> Path:
    f = tmp_path / "sft.jsonl"
    f.write_text('{"prompt": "reverse: ab", "completion": "ba"}\n')
    return f


def _argv(command: str, model: str, tmp_path: Path) -> list[str]:
    """`hpcrl <command> ... --dry-run` with `model` as its model name."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text(rl_toml(5))
    out = str(tmp_path / "run")
    if command == "run":
        return ["run", "@", str(cfg), "--model.name", model, "--output-dir", out, "--dry-run"]
    if command == "submit":
        slurm = ["--nodes", "2", "--slurm.gpus-per-node", "0", "--slurm.time", "00:10:00"]
        return ["submit", "@", str(cfg), "--model.name", model, "--output-dir", out, *slurm, "--dry-run"]
    if command == "resume":
        _resumable_run(cfg, tmp_path / "run")
        return ["resume", "--output-dir", out, "--model.name", model, "--dry-run"]
    if command == "sft":
        data = str(_data_file(tmp_path))
        return ["sft", "--model.name", model, "--data.name", data, "--output-dir", out, "--dry-run"]
    if command == "inference":
        return ["inference", "--model.name", model, "--dry-run"]
    if command == "eval":
        return ["eval", "reverse-text", "-m", model, "--dry-run"]
    return [command, "@", str(cfg), "--model.name", model, "--dry-run"]


def _resumable_run(cfg: Path, run: Path) -> None:
    """A run directory `hpcrl resume` accepts: its resolved configs and a complete checkpoint 1."""
    from hpcrl import checkpoint
    from hpcrl.paths import RunPaths

    assert main(["run", "@", str(cfg), "--output-dir", str(run), "--dry-run"]) == 0
    paths = RunPaths(run)
    for part in ("trainer", "orchestrator"):
        checkpoint.begin_part(paths, 1, part)
        checkpoint.mark_part_done(paths, 1, part)
    checkpoint.write_complete(paths, 1)


def _field(command: str) -> str:
    return "model" if command == "eval" else "model.name"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # what a setup step printed
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", COMMANDS)
def test_local_model_dir(command: str, hf: Path, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = _run(_argv(command, str(tiny_model_dir), tmp_path), capsys)
    assert rc == 0, err
    assert out.startswith(f"hpcrl {command}") and out.splitlines()[0].endswith(": dry run OK")
    assert f"{_field(command)}: {tiny_model_dir} is a local model directory" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_local_dir_without_config_json_is_refused(command: str, hf: Path, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    argv = _argv(command, str(empty), tmp_path)
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and "dry run OK" not in out
    assert err.count("\n") == 1, err
    assert err.startswith(f"config error: {_field(command)}: '{empty}' is a directory without config.json"), (
        err
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_cached_hub_id(command: str, hf: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = _run(_argv(command, HUB_ID, tmp_path), capsys)
    assert rc == 0, err
    snapshot = hf / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / ("0" * 40)
    assert f"{_field(command)}: {HUB_ID} is in the Hugging Face cache ({snapshot})" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_uncached_hub_id_will_be_downloaded(command: str, hf: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = _run(_argv(command, MISSING, tmp_path), capsys)
    assert rc == 0, err
    at = "submission" if command == "submit" else "start"  # a submitted job's nodes run offline
    assert f"{_field(command)}: {MISSING} {DOWNLOAD} {at}" in out.splitlines()


@pytest.mark.parametrize("command", COMMANDS)
def test_uncached_hub_id_offline_is_one_line_naming_the_field(
    command: str, hf: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = _argv(command, MISSING, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and "dry run OK" not in out
    assert err.count("\n") == 1, err
    assert err.startswith(f"config error: {_field(command)}: '{MISSING}' is not a local directory"), err
    assert "HF_HUB_OFFLINE=1" in err and str(hf / "hub") in err


def test_an_invalid_name_is_refused(hf: Path, tmp_path: Path, capsys) -> None:
    rc, _, err = _run(_argv("trainer", "not a model!", tmp_path), capsys)
    assert (
        rc == 2
        and err.startswith("config error: model.name: 'not a model!' is neither")
        and err.count("\n") == 1
    )


def test_a_name_set_in_a_roles_section_is_checked(hf: Path, tmp_path: Path, capsys) -> None:
    """model.name is shared: set in a role's section it is every role's (hpcrl.config.loader)."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text(rl_toml(5).replace('[model]\nname = "hpcrl/tiny-qwen3"\n', ""))  # no [model] name
    rc, out, err = _run(["trainer", "@", str(cfg), "--trainer.model.name", MISSING, "--dry-run"], capsys)
    assert rc == 0, err
    assert f"model.name: {MISSING} {DOWNLOAD} start" in out.splitlines()
    rc, out, err = _run(["inference", "@", str(cfg), "--inference.model.name", HUB_ID, "--dry-run"], capsys)
    assert rc == 0, err
    assert f"model.name: {HUB_ID} is in the Hugging Face cache" in out


def test_a_local_teacher_dir_is_checked_an_endpoint_name_is_not(hf: Path, tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "rl.toml"
    cfg.write_text(rl_toml(5))
    base = ["orchestrator", "@", str(cfg), "--orchestrator.algo.type", "opd",
            "--orchestrator.algo.teacher.base-url", "http://127.0.0.1:9"]  # fmt: skip
    rc, out, err = _run([*base, "--orchestrator.algo.teacher.name", "gpt-teacher", "--dry-run"], capsys)
    assert rc == 0, err
    assert "teacher:      http://127.0.0.1:9 (gpt-teacher)" in out
    assert "teacher.name:" not in out  # a name at the endpoint: nothing to look up here
    empty = tmp_path / "teacher"
    empty.mkdir()
    rc, _, err = _run([*base, "--orchestrator.algo.teacher.name", str(empty), "--dry-run"], capsys)
    assert rc == 2 and err.startswith("config error: orchestrator.algo.teacher.name: "), err
    assert "without config.json" in err and err.count("\n") == 1


def test_eval_at_an_endpoint_checks_the_tokenizer(hf: Path, tiny_model_dir: Path, capsys) -> None:
    base = ["eval", "reverse-text", "-m", "served-name", "-b", "http://127.0.0.1:9/v1", "--dry-run"]
    rc, out, err = _run([*base, "--client.tokenizer", str(tiny_model_dir)], capsys)
    assert rc == 0, err
    assert f"client.tokenizer: {tiny_model_dir} is a local model directory" in out
    assert "model: served-name" not in out.split("endpoint:")[1]  # a name at the endpoint: not looked up
    rc, out, err = _run(base, capsys)  # no tokenizer given: the model's name is loaded as one
    assert rc == 0 and f"model: served-name {DOWNLOAD} start" in out, err


def test_a_made_up_model_never_prints_a_bare_ok(hf: Path, tmp_path: Path, capsys) -> None:
    rc, out, _ = _run(_argv("run", "made-up-org/made-up-model", tmp_path), capsys)
    assert rc == 0 and "made-up-org/made-up-model is not in the Hugging Face cache" in out


# -- SFT's datasets -----------------------------------------------------------------------------------
def _sft(tmp_path: Path, data: str, *flags: str) -> list[str]:
    return ["sft", "--model.name", "hpcrl/tiny-qwen3", "--data.name", data, "--output-dir",
            str(tmp_path / "run"), "--dry-run", *flags]  # fmt: skip


def test_dataset_local_file_dir_and_saved(hf: Path, tmp_path: Path, capsys) -> None:
    f = _data_file(tmp_path)
    rc, out, err = _run(_sft(tmp_path, str(f)), capsys)
    assert rc == 0 and f"data.name: {f} is a local data file" in out, err
    rc, out, err = _run(
        _sft(tmp_path, str(tmp_path), "--val.interval", "5", "--val.data.name", str(f)), capsys
    )
    assert rc == 0, err
    assert f"data.name: {tmp_path} is a local directory of data files" in out
    assert f"val.data.name: {f} is a local data file" in out


def test_dataset_errors_are_one_line_naming_the_field(hf: Path, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "nodata"
    empty.mkdir()
    rc, out, err = _run(_sft(tmp_path, str(empty)), capsys)
    assert rc == 2 and "dry run OK" not in out and err.count("\n") == 1
    assert "data.name: directory" in err and "has no .jsonl/.json/.parquet files" in err
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    rc, _, err = _run(_sft(tmp_path, str(csv)), capsys)
    assert rc == 2 and "data.name: " in err and "unsupported file type '.csv'" in err


def test_dataset_written_later_is_said(hf: Path, tmp_path: Path, capsys) -> None:
    """A pipeline writes its data before training (scripts/demo.sh): said in one line, not refused."""
    later = tmp_path / "later" / "train.jsonl"
    rc, out, err = _run(_sft(tmp_path, str(later)), capsys)
    assert rc == 0, err
    assert f"data.name: {later} does not exist yet: start fails unless it is written first" in out


def test_dataset_in_the_datasets_cache(hf: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = _run(_sft(tmp_path, DATASET), capsys)
    assert rc == 0, err
    assert f"data.name: {DATASET} is in the Hugging Face datasets cache" in out


def test_dataset_not_cached(hf: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = _run(_sft(tmp_path, MISSING_DATASET), capsys)
    assert rc == 0, err
    assert f"data.name: {MISSING_DATASET} {DOWNLOAD} start" in out.splitlines()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = _run(_sft(tmp_path, MISSING_DATASET), capsys)
    assert rc == 2 and "dry run OK" not in out and err.count("\n") == 1, err
    assert err.startswith(f"config error: data.name: '{MISSING_DATASET}' is not a local path"), err


# -- the real command, as a process: the caches found through the environment alone -------------------
def test_subprocess_offline_dry_run_agrees_with_start(hf: Path, tmp_path: Path) -> None:
    """`hpcrl sft --dry-run` under HF_HUB_OFFLINE=1 with HF_HOME in tmp: the cached model and dataset
    pass; what start then reads (load_rows, resolve_model) finds the same ones offline."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
        "HF_HOME": str(hf),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    argv = [
        "sft",
        "--model.name",
        HUB_ID,
        "--data.name",
        DATASET,
        "--output-dir",
        str(tmp_path / "run"),
        "--dry-run",
    ]
    r = subprocess.run([sys.executable, "-m", "hpcrl.cli", *argv], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"model.name: {HUB_ID} is in the Hugging Face cache" in r.stdout
    assert f"data.name: {DATASET} is in the Hugging Face datasets cache" in r.stdout
    probe = (
        "from hpcrl.trainer.sft_data import load_rows; from hpcrl.models.resolve import resolve_model; "
        f"print(len(load_rows({DATASET!r})), resolve_model({HUB_ID!r}))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "4" and str(hf / "hub") in r.stdout
    missing = [*argv[:2], MISSING, *argv[3:]]
    r = subprocess.run([sys.executable, "-m", "hpcrl.cli", *missing], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"config error: model.name: '{MISSING}' is not a local directory")


def test_role_dry_runs_start_nothing_and_write_nothing(hf: Path, tmp_path: Path) -> None:
    """trainer / orchestrator / inference / eval --dry-run as processes: exit 0, no file written, no torch."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text(rl_toml(5, top=f'output_dir = "{tmp_path / "run"}"\n'))
    probe = (
        "import sys; from hpcrl.cli import main\n"
        f"for argv in {[['trainer', '@', str(cfg)], ['orchestrator', '@', str(cfg)], ['inference', '@', str(cfg), '--run-dir', str(tmp_path / 'run')], ['eval', 'reverse-text', '-m', 'hpcrl/tiny-qwen3']]!r}:\n"
        "    assert main([*argv, '--dry-run']) == 0, argv\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "HF_HOME": str(hf), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "False"  # no torch for a dry run
    for role in ("trainer", "orchestrator", "inference", "eval"):
        assert f"hpcrl {role}: dry run OK" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "rl.toml"], list(tmp_path.iterdir())


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_dry_run(command: str, capsys) -> None:
    assert main([command, "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out.split("command flags:")[1]
