"""Env servers on env nodes (deployment.env_nodes): orders, exit reports, placement (pure, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.envs.runtime.host import exit_file, my_orders
from hpcrl.envs.runtime.hosting import HostedServer, job_tag, read_exit, write_json
from hpcrl.errors import ConfigError
from hpcrl.launch.placement import local_placement, slurm_placement
from hpcrl.orchestrator.remote_env import server_spec
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml


def _spec(tmp_path: Path, connect: str = "tcp://127.0.0.1:5000", restarts: int = 0):
    import msgspec

    spec = server_spec("reverse-text", {}, "rt", "train", 1, 10.0, tmp_path / "logs")
    return msgspec.structs.replace(spec, connect=connect, restarts=restarts)


def test_an_order_reaches_only_its_node_and_job(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    HostedServer(paths.env_spec_file("train", "a"), paths.env_exit_file("train", "a"), 0, "7.0").start(
        _spec(tmp_path)
    )
    HostedServer(paths.env_spec_file("eval", "b"), paths.env_exit_file("eval", "b"), 1, "7.0").start(
        _spec(tmp_path)
    )
    HostedServer(paths.env_spec_file("train", "old"), paths.env_exit_file("train", "old"), 0, "7.1").start(
        _spec(tmp_path)
    )
    (paths.env_specs_dir / "train--half.json").write_text('{"node": 0, "sp')  # not fully visible yet
    assert list(my_orders(paths.env_specs_dir, 0, "7.0")) == [paths.env_spec_file("train", "a")]
    assert list(my_orders(paths.env_specs_dir, 1, "7.0")) == [paths.env_spec_file("eval", "b")]
    assert list(my_orders(paths.env_specs_dir, 0, "7.1")) == [paths.env_spec_file("train", "old")]
    assert my_orders(tmp_path / "missing", 0, "") == {}
    doc = json.loads(paths.env_spec_file("train", "a").read_text())
    assert doc["node"] == 0 and doc["spec"]["connect"] == "tcp://127.0.0.1:5000"
    assert exit_file(paths.env_spec_file("train", "a")) == paths.env_exit_file("train", "a")


def test_an_exit_report_counts_only_for_the_same_server(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    ex = paths.env_exit_file("train", "a")
    h = HostedServer(paths.env_spec_file("train", "a"), ex, 0, "")
    h.start(_spec(tmp_path, restarts=1))
    assert h.exit_code() is None and h.pid is None and h.where() == "env node 0"
    write_json(ex, {"connect": "tcp://127.0.0.1:5000", "restarts": 0, "code": -9})  # its predecessor
    assert h.exit_code() is None
    write_json(ex, {"connect": "tcp://127.0.0.1:6000", "restarts": 1, "code": -9})  # a requeued job's
    assert h.exit_code() is None
    write_json(ex, {"connect": "tcp://127.0.0.1:5000", "restarts": 1, "code": -9})
    assert h.exit_code() == -9
    h.stop(timeout=0)  # reported: the order is withdrawn at once
    assert not paths.env_spec_file("train", "a").exists()
    assert read_exit(tmp_path / "nothing") is None


def test_job_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert job_tag() == ""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert job_tag() == "42.0"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert job_tag() == "42.3"


def _cfg(tmp_path: Path, deployment: str):
    from hpcrl.launch.checks import load

    f = tmp_path / "c.toml"
    f.write_text(rl_toml(tables=f"[deployment]\n{deployment}\n[slurm]\ngpus_per_node = 0\n"))
    return load([str(f), "--output-dir", str(tmp_path / "run")]).config


def test_env_nodes_are_a_component_of_their_own(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "env_nodes = 2")
    p = slurm_placement(cfg, nodes=4)  # --nodes counts the env nodes: 1 trainer + 1 inference + 2
    assert (p.train_nodes, p.infer_nodes, p.env_nodes) == (1, 1, 2)
    assert p.resources("envs") == {"nodes": 2, "ntasks_per_node": 1, "gpus_per_node": None}
    assert "env servers:  on 2 CPU node(s) of their own (component envs)" in p.summary()
    with pytest.raises(ConfigError, match=r"--nodes: 3: 2 env node\(s\).*fewer than 2"):
        slurm_placement(cfg, nodes=3)
    with pytest.raises(ConfigError, match="deployment.env_nodes: 2: .*hpcrl submit"):
        local_placement(cfg)
    assert slurm_placement(_cfg(tmp_path, "env_nodes = 0"), nodes=2).env_nodes == 0
