"""tmux.sh: a detached session whose panes follow a run's logs, files created after it started."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

TMUX_SH = Path(__file__).resolve().parents[2] / "tmux.sh"
pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux not installed (apt-get install tmux)"
)


@pytest.fixture
def tmux_env():
    """A private tmux server (own socket), killed at the end: never touches the user's sessions."""
    socket = f"hpcrl-test-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    env.update(TMUX_NO_ATTACH="1", HPCRL_TMUX_SOCKET=socket)
    yield socket, env
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


def panes(socket: str, session: str) -> dict[str, str]:
    """pane title -> visible text."""
    out = subprocess.run(
        ["tmux", "-L", socket, "list-panes", "-t", session, "-F", "#{pane_index} #{pane_title}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    text = {}
    for line in out.splitlines():
        index, title = line.split(" ", 1)
        cap = subprocess.run(
            ["tmux", "-L", socket, "capture-pane", "-p", "-t", f"{session}:logs.{index}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        text[title] = cap.stdout
    return text


def wait_for_panes(socket, session, expected: dict[str, str], timeout=15.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        seen = panes(socket, session)
        if all(want in seen.get(title, "") for title, want in expected.items()):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"panes never showed {expected}: {seen}")
        time.sleep(0.3)


@pytest.mark.timeout(60)
def test_tmux_follows_logs_created_later(tmp_path, tmux_env):
    socket, env = tmux_env
    run = tmp_path / "run"  # does not exist yet: tail -F must wait for the files
    p = subprocess.run(
        ["bash", str(TMUX_SH), "job1", str(run)], env=env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    assert "attach with" in p.stdout  # TMUX_NO_ATTACH: it did not attach
    assert set(panes(socket, "job1")) == {"trainer", "orchestrator", "inference", "envs"}

    logs = run / "logs"
    (logs / "envs" / "train").mkdir(parents=True)
    for name, line in [
        ("trainer", "step 1 loss 0.5"),
        ("orchestrator", "rollouts 64"),
        ("inference", "GET /v1"),
    ]:
        with open(logs / f"{name}.log", "a") as f:
            f.write(line + "\n")
    (logs / "envs" / "train" / "reverse.log").write_text("env reverse ok\n")
    wait_for_panes(
        socket,
        "job1",
        {
            "trainer": "step 1 loss 0.5",
            "orchestrator": "rollouts 64",
            "inference": "GET /v1",
            "envs": "env reverse ok",
        },
    )

    # appended lines show up too, and a second env log started later joins the envs pane
    with open(logs / "trainer.log", "a") as f:
        f.write("step 2 loss 0.4\n")
    (logs / "envs" / "eval").mkdir()
    (logs / "envs" / "eval" / "sort.log").write_text("env sort eval\n")
    wait_for_panes(socket, "job1", {"trainer": "step 2 loss 0.4", "envs": "env sort eval"})
    # env servers on env nodes of their own (deployment.env_nodes): the env host's log and the
    # server's own log are under logs/envs/ too, on the shared filesystem
    (logs / "envs" / "host_0.log").write_text("env host 0 watching\n")
    (logs / "envs" / "train" / "reverse").mkdir()
    (logs / "envs" / "train" / "reverse" / "server.log").write_text("worker 0 started\n")
    wait_for_panes(socket, "job1", {"envs": "env host 0 watching"})
    wait_for_panes(socket, "job1", {"envs": "worker 0 started"})


@pytest.mark.timeout(60)
def test_tmux_flags_and_reuse(tmp_path, tmux_env):
    socket, env = tmux_env
    cmd = ["bash", str(TMUX_SH), "-s", "job2", "-o", str(tmp_path)]
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30).returncode == 0
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and "reusing" in again.stdout
    sessions = subprocess.run(
        ["tmux", "-L", socket, "ls", "-F", "#{session_name}"], capture_output=True, text=True
    )
    assert sessions.stdout.split() == ["job2"]
    bad = subprocess.run(["bash", str(TMUX_SH), "only-one-arg"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
