"""Env servers (issue 29): rollouts in worker processes; faults cost only their rollouts."""

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

from hpcrl.envs.base import Turn
from hpcrl.envs.errors import EnvServerFailed
from hpcrl.orchestrator.remote_env import EnvRolloutError, RemoteEnvironment, server_spec, status_file
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml

ENV = "tests.integration.faulty_env"
DOS = ["ok", "raise", "exit", "segv", "hang", "ok"]


class SaysOk:
    """A ChatClient with no model: every turn answers 'ok'."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages, tools, sampling) -> Turn:
        self.calls += 1
        return Turn("ok", [1, 2], [3], [-0.5], [7])


def _remote(tmp_path: Path, workers: int = 1, timeout: float = 2.0, restarts: int = 3) -> RemoteEnvironment:
    spec = server_spec(ENV, {"dos": DOS}, "faulty", "train", workers, timeout, tmp_path / "faulty")
    return RemoteEnvironment(spec, max_restarts=restarts)


async def _one(env: RemoteEnvironment, i: int) -> str:
    try:
        traj = await env.rollout(env.tasks("train")[i], SaysOk(), {})
    except EnvRolloutError as e:
        return f"error: {e}"
    return f"reward {traj.reward}"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _status(tmp_path: Path) -> dict:
    return json.loads(status_file(tmp_path / "faulty").read_text())


@pytest.mark.slow
def test_each_fault_errors_its_rollout_and_the_worker_is_replaced(tmp_path: Path) -> None:
    env = _remote(tmp_path)
    assert env.tasks("train")[1].info == {"do": "raise"}

    async def main() -> list[str]:
        out = [await _one(env, i) for i in range(len(DOS))]
        await env.aclose()
        return out

    out = asyncio.run(main())
    assert out[0] == "reward 1.0" and out[5] == "reward 1.0", out
    assert "raised on purpose" in out[1]
    assert "died: exit code 3" in out[2]
    assert "killed by signal 11 (SIGSEGV)" in out[3]
    assert "rollout_timeout_s=2" in out[4]
    assert _status(tmp_path)["workers"][0]["restarts"] == 3  # exit, segv, hang; a raise keeps it
    assert "Segmentation fault" in (tmp_path / "faulty" / "worker_0.log").read_text()  # faulthandler


@pytest.mark.slow
def test_a_killed_server_errors_what_it_held_and_comes_back(tmp_path: Path) -> None:
    env = _remote(tmp_path, workers=2, restarts=1)

    async def main() -> tuple[str, str, str]:
        first = await _one(env, 0)
        hang = asyncio.ensure_future(_one(env, 4))  # held by the server when it dies
        await asyncio.sleep(0.5)
        workers = [w["pid"] for w in _status(tmp_path)["workers"]]
        os.kill(env.pid, signal.SIGKILL)
        held = await hang
        # its workers die with it, the one stuck in hung env code too (its event loop never runs)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not any(_alive(p) for p in workers), workers
        again = await _one(env, 0)  # the restarted server answers
        os.kill(env.pid, signal.SIGKILL)  # past the limit: the run must end, naming the env
        await asyncio.sleep(1.0)
        with pytest.raises(EnvServerFailed, match="'faulty'.*env_server_max_restarts"):
            await env.rollout(env.tasks("train")[0], SaysOk(), {})
        await env.aclose()
        return first, held, again

    first, held, again = asyncio.run(main())
    assert first == again == "reward 1.0"
    assert "env server for train env 'faulty' died" in held
    assert _status(tmp_path)["server"]["restarts"] == 1


def test_an_env_that_fails_to_load_is_a_one_line_error(tmp_path: Path) -> None:
    from hpcrl.envs.registry import EnvSpecError

    spec = server_spec("reverse-text", {"nope": 1}, "rt", "train", 1, 5.0, tmp_path / "rt")
    with pytest.raises(EnvSpecError, match="unknown argument 'nope'"):
        RemoteEnvironment(spec)


@pytest.mark.slow
def test_a_server_that_ends_while_the_orchestrator_stops_is_let_go(tmp_path: Path) -> None:
    """On SLURM every process of a step gets the stop's SIGTERM, the env server too. Once the
    orchestrator stops (Setup.stopping), a server that ends errors what it held, is not restarted,
    and the line is INFO: no 'died' warning on the console of a run that was told to stop."""
    env = _remote(tmp_path, restarts=3)

    async def main() -> str:
        assert await _one(env, 0) == "reward 1.0"
        hang = asyncio.ensure_future(_one(env, 4))  # held by the server when it ends
        await asyncio.sleep(0.5)
        env.stopping = True
        os.kill(env.pid, signal.SIGTERM)
        held = await hang
        with pytest.raises(EnvServerFailed, match="ended while the orchestrator stops"):
            await env.rollout(env.tasks("train")[0], SaysOk(), {})
        await env.aclose()
        return held

    held = asyncio.run(main())
    assert "ended while the orchestrator stops" in held, held
    assert env.restarts == 0


RUN = rl_toml(
    8,
    seq_len=64,
    max_tokens=8,
    batch_size=8,
    rollouts_per_example=4,
    orchestrator="env_workers = 2\n",
    tables='[orchestrator.advantage]\nzero_advantage = "keep"\n',
).replace(
    'id = "reverse-text"\n',
    'id = "tests.integration.faulty_env"\nname = "faulty"\nargs = {do = "sleep", sleep_s = 0.15, num_examples = 16}\n',
)


def _components(out: Path) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "components", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def _wait_step(out: Path, step: int, launcher: subprocess.Popen, timeout: float = 300) -> None:
    from hpcrl.monitor.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the run ended early"
        recs = read_metrics(RunPaths(out).metrics_file) if RunPaths(out).metrics_file.exists() else []
        if any(r.get("role") == "orchestrator" and r.get("step", 0) >= step for r in recs):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never came")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_of_a_worker_and_of_the_server_mid_run(tmp_path: Path) -> None:
    from hpcrl.monitor.metrics import read_metrics

    cfg, out = tmp_path / "cfg.toml", tmp_path / "run"
    cfg.write_text(RUN)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_step(out, 1, launcher)
        worker = next(r for r in _components(out) if r["role"] == "env-worker 0")
        os.kill(worker["pid"], signal.SIGKILL)
        # killed early enough that later steps need it again (under load the orchestrator runs ahead:
        # killed at step 3 of 6, a run once finished before the restart was due)
        _wait_step(out, 2, launcher)
        server = next(r for r in _components(out) if r["role"] == "env-server")
        os.kill(server["pid"], signal.SIGKILL)
        output, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    recs = [r for r in read_metrics(RunPaths(out).metrics_file) if r.get("role") == "orchestrator"]
    assert max(r["step"] for r in recs) == 8
    errored = sum(r.get("errored_rollouts/all", 0) for r in recs)
    assert errored > 0 and errored == sum(r.get("errored_rollouts/faulty", 0) for r in recs)
    rows = {r["role"]: r for r in _components(out)}
    assert rows["env-server"]["restarts"] == 1 and rows["env-server"]["env"] == "train/faulty"
    # the restarted server's workers start from 0 restarts; the first server's worker 0 restart is logged
    assert "env worker 0" in (RunPaths(out).env_server_dir("train", "faulty") / "server.log").read_text()
    placed = [json.loads(x) for x in RunPaths(out).placement_log.read_text().splitlines()]
    assert sum(p["role"] == "env-server-train" and p["env"] == "faulty" for p in placed) == 2
    cli = [sys.executable, "-m", "hpcrl.cli"]
    logs = subprocess.run(
        [*cli, "logs", str(out), "--env", "faulty", "--level", "error", "--search", "DIED", "-n", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logs.returncode == 0 and "[envs/train/faulty/server.log]" in logs.stdout, logs.stdout + logs.stderr
    assert "env worker 0" in logs.stdout and " INFO " not in logs.stdout
    status = subprocess.run([*cli, "status", str(out)], capture_output=True, text=True, timeout=60)
    assert "env servers:" in status.stdout and "env-server-train" in status.stdout


@pytest.mark.slow
def test_servers_start_together_and_a_bad_entry_is_named(tmp_path: Path) -> None:
    from hpcrl.config.schema import EnvConfig
    from hpcrl.errors import ConfigError
    from hpcrl.orchestrator.setup import close_envs, load_envs

    good = EnvConfig(id="reverse-text")
    envs = load_envs(
        [good, EnvConfig(id=ENV, name="f")],
        "orchestrator.train.env",
        server_dir=lambda k, n: tmp_path / k / n,
    )
    try:
        assert [type(e).__name__ for e in envs.values()] == ["RemoteEnvironment"] * 2
        assert len(envs["f"].tasks("train")) == 8 and envs["reverse-text"].max_turns == 1
    finally:
        close_envs(envs.values())
    bad = EnvConfig(id="reverse-text", name="bad", args={"min_len": 9, "max_len": 2})
    with pytest.raises(ConfigError) as e:
        load_envs([good, bad], "orchestrator.train.env", server_dir=lambda k, n: tmp_path / k / n)
    assert e.value.path == "orchestrator.train.env[1]"
    in_process = load_envs([EnvConfig(id="reverse-text", workers=0)], "x", server_dir=lambda k, n: tmp_path)
    assert type(in_process["reverse-text"]).__name__ == "ReverseTextEnv"


def _frozen_remote(tmp_path: Path, frozen_s: float) -> RemoteEnvironment:
    spec = server_spec(ENV, {"dos": DOS}, "faulty", "train", 1, 60.0, tmp_path / "faulty", frozen_s=frozen_s)
    return RemoteEnvironment(spec, max_restarts=2)


@pytest.mark.slow
def test_a_stopped_worker_is_named_by_pid_then_killed_and_replaced_past_frozen_s(tmp_path: Path) -> None:
    """SIGSTOP of the worker mid-rollout: the orchestrator's stall line names it (env, index, pid),
    and past frozen_s (far below rollout_timeout_s = 60 s) its server replaces it like a dead one."""
    env = _frozen_remote(tmp_path, frozen_s=2.0)

    async def main() -> tuple[str, list, str]:
        assert await _one(env, 0) == "reward 1.0"
        pid = _status(tmp_path)["workers"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        held = asyncio.ensure_future(_one(env, 0))
        await asyncio.sleep(1.0)
        busy = env.busy_workers(time.monotonic())
        t0 = time.monotonic()
        out = await held
        assert time.monotonic() - t0 < 15, "not replaced within frozen_s and a few checks"
        again = await _one(env, 0)
        await env.aclose()
        return out, busy, again + f" pid {pid}"

    out, busy, again = asyncio.run(main())
    pid = int(again.rsplit(" ", 1)[1])
    assert len(busy) == 1 and busy[0][0].startswith(
        f"env faulty worker 0 (pid {pid}): 1 rollout(s) in env code"
    )
    assert f"env worker 0 (pid {pid}) frozen (process stopped) for" in out, out
    assert again.startswith("reward 1.0")
    assert _status(tmp_path)["workers"][0]["restarts"] == 1 and not _alive(pid)


@pytest.mark.slow
def test_a_stopped_server_answers_no_ping_and_is_restarted_like_a_crashed_one(tmp_path: Path) -> None:
    env = _frozen_remote(tmp_path, frozen_s=2.0)

    async def main() -> tuple[str, int, str]:
        assert await _one(env, 0) == "reward 1.0"
        pid = env.pid
        os.kill(pid, signal.SIGSTOP)
        held = asyncio.ensure_future(_one(env, 4))  # hangs in env code: only the restart ends it
        out = await asyncio.wait_for(held, 30)
        again = await _one(env, 0)
        await env.aclose()
        return out, pid, again

    out, pid, again = asyncio.run(main())
    assert f"env server for train env 'faulty' (pid {pid}) answered no ping for" in out, out
    assert "frozen, killed" in out and again == "reward 1.0"
    assert _status(tmp_path)["server"]["restarts"] == 1 and not _alive(pid)


def test_a_server_that_answers_its_pings_is_left_alone(tmp_path: Path) -> None:
    """frozen_s shorter than the test: a live server answers every ping and is never restarted."""
    env = _frozen_remote(tmp_path, frozen_s=1.5)

    async def main() -> list[str]:
        out = [await _one(env, 0)]
        await asyncio.sleep(4.0)
        out.append(await _one(env, 0))
        await env.aclose()
        return out

    assert asyncio.run(main()) == ["reward 1.0", "reward 1.0"]
    assert _status(tmp_path)["server"]["restarts"] == 0 and env.ping_seq >= 3
