"""Pure pieces of the env servers (issue 29): routing, timeouts, the wire format, log filters."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime

import pytest

from hpcrl.envs.base import Task, Trajectory, Turn
from hpcrl.envs.runtime.routing import Router
from hpcrl.envs.wire import messages as wire
from hpcrl.envs.wire.frames import Outbox
from hpcrl.launch.logview import make_filter, parse_since, records


def test_runs_go_to_the_least_loaded_ready_worker_or_wait() -> None:
    r = Router()
    assert r.assign(1, "run1", 0.0) is None and r.backlog == ["run1"]  # nobody ready yet
    assert r.ready(b"a") == ["run1"] and r.backlog == []
    r.ready(b"b")
    assert r.assign(1, "run1", 0.0) == b"a"  # a tie: the first ready
    assert r.assign(2, "run2", 0.0) == b"b"
    assert r.assign(3, "run3", 0.0) == b"a"
    r.done(1)
    assert r.assign(4, "run4", 0.0) == b"a"  # after done(1) a holds {3}, b {2}: a tie again
    assert r.gone(b"a") == [3, 4] and r.assign(5, "run5", 0.0) == b"b"
    assert r.answered(3, 1.0) is None  # its worker is gone: nothing to send
    assert r.clear() == [2, 5] and not r.workers


def test_only_time_in_env_code_counts_towards_the_timeout() -> None:
    r = Router()
    r.ready(b"a")
    r.ready(b"b")
    r.assign(1, "run1", 100.0)  # a
    r.assign(2, "run2", 100.0)  # b
    r.asked_model(2)  # waits for a model turn: never overdue
    assert r.overdue(110.0, 5.0) == [b"a"]
    assert r.answered(2, 109.5) == b"b"  # back in env code from 109.5
    assert r.overdue(114.0, 5.0) == [b"a"] and r.overdue(115.0, 5.0) == [b"a", b"b"]


def test_a_trajectory_crosses_the_wire_unchanged() -> None:
    task = Task(7, [{"role": "user", "content": "hi"}], "ih", {"k": [1, 2]})
    turn = Turn(
        "ih",
        [1, 2],
        [3, 4],
        [-0.25, -1.5],
        [5, 6],
        "stop",
        [{"id": "c", "type": "function"}],
        reasoning="because",
        rerendered=True,
        routed_experts=[[[0, 3]], [[1, 2]]],
    )
    # every field of Turn crosses (a field added to Turn and not to the wire was silently dropped)
    assert [f.name for f in dataclasses.fields(Turn)] == list(wire.WTurn.__struct_fields__)
    traj = Trajectory(task, [*task.prompt, turn.message()], 1, [turn], 0.5, {"m": 1.0}, {"obj": object()})
    [msg] = wire.decode(wire.encode(wire.Done(3, [wire.to_wtraj(traj)])))
    assert isinstance(msg, wire.Done) and msg.rid == 3
    back = wire.from_wtraj(task, msg.trajectories[0])
    assert back.turns[0] == turn and back.messages == traj.messages and back.reward == 0.5
    assert back.state["obj"].startswith("<object object")  # non-msgpack state travels as text
    [run] = wire.decode(wire.encode(wire.Run(1, wire.to_wtask(task), {"max_tokens": 4}, 2, True, "sys")))
    assert wire.from_wtask(run.task) == task and run.system_prompt == "sys"


class _Sock:
    """A ZMQ socket's send side as hpcrl.envs.wire.frames uses it (zmq.asyncio returns a future)."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> asyncio.Future:
        self.sent.append(frames)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def test_messages_put_in_one_loop_iteration_leave_as_one_frame_per_peer_in_order() -> None:
    async def main() -> _Sock:
        sock = _Sock()
        box = Outbox(sock, routed=True)
        box.put(wire.Stop(), b"w1")
        box.put(wire.Ready(7), b"w2")
        box.put(wire.Kill("w1", "slow"), b"w1")
        assert sock.sent == []  # nothing leaves before the iteration ends
        await asyncio.sleep(0)
        box.put(wire.Ready(8), b"w1")  # the next iteration: its own frame
        await asyncio.sleep(0)
        assert box.frames == 3
        return sock

    sent = asyncio.run(main()).sent
    assert [f[0] for f in sent] == [b"w1", b"w2", b"w1"]
    assert wire.decode(sent[0][1]) == [wire.Stop(), wire.Kill("w1", "slow")]
    assert wire.decode(sent[1][1]) == [wire.Ready(7)] and wire.decode(sent[2][1]) == [wire.Ready(8)]


def test_log_records_keep_their_tracebacks_and_filter_whole() -> None:
    lines = [
        "10:00:01 INFO    [a] started",
        "10:00:02 ERROR   [a] rollout 3 errored",
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "10:05:00 WARNING [a] slow worker",
    ]
    recs = list(records(lines))
    assert [len(r.lines) for r in recs] == [1, 3, 1]
    keep = make_filter("warning", None, None, None)
    assert [r.lines[0][:8] for r in recs if keep(r)] == ["10:00:02", "10:05:00"]
    assert [r.level for r in recs if make_filter(None, "LINE 1", None, None)(r)] == [40]  # in the traceback
    assert len([r for r in recs if make_filter(None, None, r"slow \w+", None)(r)]) == 1
    since = parse_since("10:01", datetime(2026, 1, 1, 12))
    assert [r.lines[0][:8] for r in recs if make_filter(None, None, None, since)(r)] == ["10:05:00"]


def test_since_durations_and_errors() -> None:
    now = datetime(2026, 1, 1, 12, 30, 0)
    assert parse_since("10m", now) == 12 * 3600 + 20 * 60
    assert parse_since("2h", now) == 10 * 3600 + 30 * 60
    assert parse_since("1d", now) == 0.0  # yesterday: every record of today's file
    with pytest.raises(ValueError, match="--since 'soon'"):
        parse_since("soon", now)


def test_hosted_compute_size_sets_env_workers() -> None:
    from hpcrl.config.hosted import to_native
    from hpcrl.errors import ConfigError

    hosted = {"model": "m", "batch_size": 8, "env": [{"id": "reverse-text"}]}
    for size, n in (("S", 1), ("M", 2), ("L", 4)):
        out, notes = to_native({**hosted, "infrastructure": {"compute_size": size}}, "c.toml")
        assert out["orchestrator"]["env_workers"] == n and "infrastructure" not in out
        assert any("compute_size" in note for note in notes)
    with pytest.raises(ConfigError, match="expected S, M or L, got 'XL'"):
        to_native({**hosted, "infrastructure": {"compute_size": "XL"}}, "c.toml")


def test_components_reads_every_env_server_and_worker(tmp_path) -> None:
    import json
    import os

    from hpcrl.envs.runtime.components import env_rows
    from hpcrl.launch.logview import table

    d = tmp_path / "envs" / "train" / "faulty"
    d.mkdir(parents=True)
    doc = {
        "env": "faulty",
        "kind": "train",
        "server": {"pid": os.getpid(), "node": None, "restarts": 1, "log_lines_lost": 3},
        "workers": [
            {"index": 0, "pid": os.getpid(), "node": None, "ready": True, "restarts": 2},
            {"index": 1, "pid": 2**22 + 12345, "node": None, "ready": True, "restarts": 0},  # no such pid
        ],
    }
    (d / "components.json").write_text(json.dumps(doc))
    rows = env_rows(tmp_path / "envs")
    assert [(r["role"], r["state"], r["restarts"]) for r in rows] == [
        ("env-server", "running (3 log line(s) lost)", 1),  # its log refused (disk full, quota)
        ("env-worker 0", "running", 2),
        ("env-worker 1", "exited", 0),
    ]
    assert all(r["env"] == "train/faulty" for r in rows)
    assert table(rows)[0].split() == ["role", "env", "pid", "node", "state", "restarts"]


def test_errored_rollouts_per_env_count_what_was_generated() -> None:
    from hpcrl.orchestrator.batch import StepCounts
    from hpcrl.orchestrator.metrics import step_metrics
    from hpcrl.orchestrator.state import GroupRecord, RolloutRecord

    def group(env: str, errors: list[bool]) -> GroupRecord:
        rs = [
            RolloutRecord(index=i, pieces=[], error="worker died" if e else None)
            for i, e in enumerate(errors)
        ]
        return GroupRecord(env=env, example_id=0, task_index=0, task_epoch=0, rollouts=rs)

    kept = group("a", [False, True])
    dropped = [group("a", [True, True]), group("b", [True, True])]  # all errored: never trained
    m = step_metrics([kept], [kept, *dropped], 1, StepCounts(), 0.0, 1.0, 1, 1, {})
    assert m["errored_rollouts/all"] == 5.0
    assert (m["errored_rollouts/a"], m["errored_rollouts/b"]) == (3.0, 2.0)
