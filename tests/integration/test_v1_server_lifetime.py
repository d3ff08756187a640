"""verifiers' env server (broker + pool workers) never outlives the process that owns it, and never
keeps that process from exiting; a pool worker that dies restarts the server instead of leaving the
requests sent to it waiting. Real processes: V1Environment spawns verifiers' serve_env for the
offline test env tests/vf1_envs/vf1_tool_env.py (no inference needed: no rollout runs). Runs in the
0.4 venv; skipped where verifiers 0.4 is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.envs.runtime.components import alive
from hpcrl.envs.verifiers.versions import installed, major_minor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif((major_minor(installed()) or (0, 0)) < (0, 4), reason="needs verifiers 0.4"),
]
ROOT = Path(__file__).resolve().parents[2]
ENV_ID = "vf1_tool_env"
GONE_S = 30.0  # lifeline: SIGTERM at once, SIGKILL 5 s later; generous for a loaded 2-core machine

# The owner: starts the server (2 workers), records every pid in components.json, then per mode:
#   kill  waits to be killed;
#   fork  forks a child that outlives it and holds its end of verifiers' death pipe (any fork of
#         the owner does), then waits to be killed;
#   exit  keeps the V1Environment alive in a reference cycle (collector off) and exits without
#         closing it: the state in which the orchestrator used to hang at exit.
OWNER = """
import gc, os, sys, time
from pathlib import Path
from hpcrl.envs.verifiers.v1_env import V1Environment

mode, log_dir = sys.argv[1], Path(sys.argv[2])
env = V1Environment("vf1_tool_env", {"num_tasks": 2}, workers=2)
env.start(log_dir)
def workers():
    kids = []
    for task in Path(f"/proc/{env.proc.pid}/task").glob("*"):
        kids += (task / "children").read_text().split()
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
deadline = time.monotonic() + 240
while len(workers()) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
env._write_components(log_dir)  # components.json: the server's pid and its workers' pids
extra = ""
if mode == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(300)
        os._exit(0)
    extra = str(child)
(log_dir / "ready").write_text(extra)
if mode == "exit":
    gc.disable()
    env.cycle = env
    sys.exit(0)
time.sleep(600)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'vf1_envs'}")


def _server_pids(log_dir: Path) -> list[int]:
    doc = json.loads((log_dir / "components.json").read_text())
    assert len(doc["workers"]) == 2, doc  # the pool's workers are covered, not only the broker
    return [doc["server"]["pid"], *(w["pid"] for w in doc["workers"])]


def _wait_ready(owner: subprocess.Popen, log_dir: Path) -> str:
    deadline = time.monotonic() + 300
    while not (log_dir / "ready").exists():
        assert owner.poll() is None, f"the owner exited with {owner.returncode}"
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    return (log_dir / "ready").read_text()


def _survivors(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in pids if alive(p, None) == "running"]
        if not left or time.monotonic() > deadline:
            return left


@pytest.mark.parametrize("mode", ["kill", "fork"])
def test_kill_9_of_the_owner_ends_every_process_of_its_server(tmp_path: Path, mode: str) -> None:
    log_dir = tmp_path / "server"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, mode, str(log_dir)], env=_env())
    forked = None
    try:
        extra = _wait_ready(owner, log_dir)
        forked = int(extra) if extra else None
        pids = _server_pids(log_dir)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        left = _survivors(pids, GONE_S)
        assert not left, f"still running {GONE_S:g} s after kill -9 of their owner: {left} of {pids}"
    finally:
        for p in [owner.pid, *([forked] if forked else [])]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_owner_that_exits_without_closing_its_server_exits_and_takes_it_along(tmp_path: Path) -> None:
    log_dir = tmp_path / "server"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "exit", str(log_dir)], env=_env())
    try:
        _wait_ready(owner, log_dir)
        pids = _server_pids(log_dir)
        assert owner.wait(timeout=60) == 0  # before: multiprocessing's exit join waited forever
        assert not _survivors(pids, GONE_S)
    finally:
        if owner.poll() is None:
            owner.kill()


def test_a_dead_pool_worker_restarts_the_server_up_to_the_limit(tmp_path: Path, monkeypatch) -> None:
    """verifiers' pool neither replaces a dead worker nor stops sending it requests: a rollout waiting on
    it is errored within seconds and the server restarted; past env_server_max_restarts the run ends."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "vf1_envs"))
    from hpcrl.envs.errors import EnvServerFailed
    from hpcrl.envs.verifiers.v1_env import V1Environment

    env = V1Environment(ENV_ID, {"num_tasks": 2}, workers=2, max_restarts=1)

    def kill_a_worker() -> tuple[int, int]:
        deadline = time.monotonic() + 240
        while len(env._learn_workers()) < 2:
            assert time.monotonic() < deadline, "the pool's workers did not appear"
            time.sleep(0.2)
        victim = env._worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        return env.proc.pid, victim

    async def waiting_forever() -> None:
        await asyncio.sleep(3600)

    try:
        env.start(tmp_path / "server")
        first, victim = kill_a_worker()
        with pytest.raises(RuntimeError, match=rf"a worker \(pid {victim}\) of verifiers' env server"):
            asyncio.run(asyncio.wait_for(env._guarded(waiting_forever()), 60))
        assert env.restarts == 1 and env.proc.pid != first and env.proc.is_alive()
        assert alive(first, None) == "exited"
        doc = json.loads((tmp_path / "server" / "components.json").read_text())
        assert doc["server"] == {**doc["server"], "pid": env.proc.pid, "restarts": 1}

        kill_a_worker()
        with pytest.raises(EnvServerFailed, match="the limit \\(orchestrator.env_server_max_restarts\\)"):
            asyncio.run(asyncio.wait_for(env._guarded(waiting_forever()), 60))
    finally:
        env.close_now()
