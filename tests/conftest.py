"""Shared fixtures: a tiny model built once per session, and a fresh run directory per test."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest


def rl_toml(
    max_steps: int | str = 5,
    *,
    seq_len: int = 128,
    model: str = "hpcrl/tiny-qwen3",
    batch_size: int = 16,
    rollouts_per_example: int = 4,
    max_tokens: int = 16,
    top: str = "",
    orchestrator: str = "",
    tables: str = "",
    plots: bool = False,
) -> str:
    """The base RL config the tests share (tiny model, reverse-text), as TOML text.

    `top`: extra top-level lines (before [model]); `orchestrator`: extra lines of [orchestrator];
    `tables`: appended after the environment (its `args = ...` first, then more tables). Give a
    str ("{steps}", "{model}") to leave a placeholder for str.format; braces in the extras then
    need doubling. With the defaults the text is exactly what test_config_errors' line numbers
    expect. `plots`: the end-of-run PNGs (`[log] plots`, ~1 CPU-second per run); off unless a test
    looks at them, and then the text has no [log] table (a test may add its own)."""
    log = "" if plots else "[log]\nplots = false\n"
    return (
        f"max_steps = {max_steps}\nseq_len = {seq_len}\n{top}{log}"
        f'[model]\nname = "{model}"\n'
        f"[orchestrator]\nbatch_size = {batch_size}\nrollouts_per_example = {rollouts_per_example}\n{orchestrator}"
        f"[orchestrator.train.sampling]\nmax_tokens = {max_tokens}\n"
        f'[[orchestrator.train.env]]\nid = "reverse-text"\n{tables}'
    )


# A rank's variables, set when the suite itself runs under torchrun or inside a SLURM task: a child
# `hpcrl` started by a test would take them for its own and wait for peers that never come.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID")


def child_env(*drop: str, **extra: str) -> dict[str, str]:
    """os.environ for a child process a test starts: unbuffered, without RANK_VARS (nor `drop`),
    with `extra` set (e.g. OMP_NUM_THREADS="1")."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    for var in (*RANK_VARS, *drop):
        env.pop(var, None)
    return env


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 model + tokenizer (HF directory), built locally once per test session."""
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """An empty run output directory with the standard layout (RunPaths.make_dirs)."""
    from hpcrl.paths import RunPaths

    root = tmp_path / "run"
    RunPaths(root).make_dirs()
    return root


@pytest.fixture(autouse=True, scope="session")
def _hpcrl_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Built-in model names resolve into a per-session cache, never the user's ~/.cache."""
    if "HPCRL_CACHE" not in os.environ:
        os.environ["HPCRL_CACHE"] = str(tmp_path_factory.mktemp("hpcrl_cache"))


class InferenceServer:
    """A real `hpcrl.inference.server` subprocess on 127.0.0.1 (free port), stopped by `stop()`."""

    def __init__(
        self,
        model_dir: Path,
        run_dir: Path,
        *args: str,
        index: int = 0,
        timeout: float = 90.0,
        threads: int | None = 1,
        any_weights_path: bool = True,
    ):
        import json
        import subprocess
        import sys
        import time

        from hpcrl.paths import RunPaths

        self.run_dir = Path(run_dir)
        info_file = RunPaths(run_dir).server_file(index)
        self.log_path = self.run_dir / f"inference_{index}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        if threads is not None:  # tests share 2 cores with other test processes: one thread each
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [
            sys.executable,
            "-m",
            "hpcrl.inference.server",
            "--model.name",
            str(model_dir),
            "--server.host",
            "127.0.0.1",
            "--server.port",
            "0",
            "--run-dir",
            str(run_dir),
            "--server-index",
            str(index),
            *args,
        ]
        if any_weights_path:  # most tests load weights built in their own tmp dirs, outside run_dir
            cmd.append("--server.allow-any-weights-path")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not info_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"inference server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        info = json.loads(info_file.read_text())
        self.base_url: str = info["base_url"]
        self.port: int = info["port"]

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def inference_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A shared hf-backend server on the tiny model. Read-only: never change its weights or pause it."""
    server = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("inference_run"))
    yield server
    server.stop()


# Test files whose items use a module-scoped fixture but are spread over both workers on purpose: each
# reliability chain is its own item so the chains run on both workers (they share one reference run
# through a file lock).
_SPREAD = {"tests/integration/test_reliability.py"}


def _module_fixture_user(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture (a run, a server, a model built once per file)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope == "module":
            return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Under pytest-xdist (scripts/test.sh runs the suite on two workers, `--dist loadgroup`):
    - the tests that submit jobs to the one local SLURM cluster run on one worker, one after another;
    - the tests of a file that share a module-scoped fixture (a whole run, a server, a built model)
      run on one worker, so the fixture is set up once, not once per worker (xdist hands out the
      first quarter of the suite round-robin, one test at a time: a file's tests land on both).
    A test that names its own xdist_group keeps it (one group per test: xdist joins several names)."""
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.get_closest_marker("xdist_group") is not None:
                continue
            if item.get_closest_marker("slurm") is not None:
                item.add_marker(pytest.mark.xdist_group("slurm"))
                continue
            path = item.nodeid.split("::")[0]
            if path not in _SPREAD and _module_fixture_user(item):
                item.add_marker(pytest.mark.xdist_group(path))
    result = yield
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            _stick_group(item)
    return result


def _stick_group(item: pytest.Item) -> None:
    """xdist (3.8) groups a test by a "@group" suffix it writes to `item._nodeid`; pytest 9 keeps the
    id in `item._id`, so that write is lost and every group was spread over both workers (SLURM
    jobs at the same time, shared fixtures set up twice). Write the suffix where pytest 9 reads it."""
    names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
    if not names or "@" in item.nodeid.rpartition("]")[2].rpartition("::")[2]:
        return  # no group, or xdist's own suffix took (pytest before 9)
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """HPCRL_TEST_TIMELINE=FILE: one JSON line per test (worker, start, wall, CPU of this process and
    of the children it reaped), for scripts/bench/test_timeline.py: which tests wait, which compute."""
    path = os.environ.get("HPCRL_TEST_TIMELINE")
    if not path:
        return (yield)
    t0, c0 = time.time(), os.times()
    try:
        return (yield)
    finally:
        c1 = os.times()
        row = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": round(t0, 2),
            "wall": round(time.time() - t0, 2),
            "cpu": round(sum(c1[:4]) - sum(c0[:4]), 2),
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Torch in this process computes on one thread. The suite runs two workers, a waiting lane and
    the processes they start on 2 cores: torch's default of a thread per core spun against the
    others (tests/unit with -n 2: 116 -> 91 CPU-s). Processes the tests start keep their own
    settings (the launcher's OMP_NUM_THREADS share, or the test's)."""
    import sys

    torch = sys.modules.get("torch")  # never imported here: a test that needs torch has imported it
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
