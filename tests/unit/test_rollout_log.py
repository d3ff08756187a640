"""Saved rollouts (issue 51): the record of a multi-turn tool rollout kept whole, the writer (whole
files, atomically; a resumed step rewritten, never duplicated; retention), and the bus leaving
them alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.envs.base import Environment, Rubric, Task, Trajectory, Turn
from hpcrl.envs.wire.messages import from_wtraj, to_wtraj
from hpcrl.fileio import TMP_MARK
from hpcrl.monitor import rollout_files as rf
from hpcrl.orchestrator import rollout_log as rl
from hpcrl.orchestrator.rollout import _errored
from hpcrl.orchestrator.state import GroupRecord
from hpcrl.orchestrator.stitching import to_record
from hpcrl.paths import RunPaths

PROMPT = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "2*3-1?"}]
TASK = Task(example_id=7, prompt=PROMPT, answer="5", info={"expression": "2*3-1"})
CALL = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2*3-1"}'}}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def tool_rollout(reward: float = 1.0) -> Trajectory:
    """Two turns: a tool call, the tool's answer, the final answer (turn 2 extends turn 1's ids)."""
    t1 = Turn("", [1, 2, 3], [10, 11], [-0.5, -0.25], [4], "tool_calls", tool_calls=[CALL])
    t2 = Turn("5", [1, 2, 3, 10, 11, 20, 21], [12, 13, 14], [-0.125, -1.0, -0.01], [5, 5, 5])
    messages = [
        *PROMPT,
        t1.message(),
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        t2.message(),
    ]
    return Trajectory(
        TASK,
        messages,
        len(PROMPT),
        [t1, t2],
        reward=reward,
        metrics={"correct": reward, "format": 0.5, "num_turns": 2.0},
        reward_weights={"correct": 1.0, "format": 0.0},
    )


def tool_group() -> GroupRecord:
    recs = [to_record(i, tool_rollout(r), started=100.0, finished=101.5) for i, r in enumerate([1.0, 0.0])]
    recs.append(_errored(2, ValueError("tool exploded"), "calc", TASK, started=100.0))
    return GroupRecord(
        env="calc", example_id=7, task_index=3, task_epoch=1, rollouts=recs, advantages=[0.5, -0.5, 0.0]
    )


def test_a_multi_turn_tool_rollout_is_saved_whole() -> None:
    g = tool_group()
    rec = rl.rollout_record(
        4, "train", g, g.rollouts[0], trained=True, task=TASK, env_id="hpcrl/calc", tools=TOOLS
    )
    assert rec["messages"] == tool_rollout().messages  # every turn, the tool call and its result
    assert rec["messages"][2]["tool_calls"] == [CALL] and rec["messages"][3]["role"] == "tool"
    assert rec["num_prompt_messages"] == 2 and rec["tools"] == TOOLS
    assert rec["id"] == "train-4-calc-7.1-0" and rec["env"] == {"id": "hpcrl/calc", "name": "calc"}
    assert rec["task"] == {"example_id": 7, "epoch": 1, "answer": "5", "info": {"expression": "2*3-1"}}
    assert rec["group"] == {"id": "calc/7", "index": 0, "size": 3}
    assert (rec["ok"], rec["trained"], rec["reward"], rec["advantage"], rec["errors"]) == (
        True,
        True,
        1.0,
        0.5,
        [],
    )
    assert rec["rewards"] == {
        "correct": {"score": 1.0, "weight": 1.0},
        "format": {"score": 0.5, "weight": 0.0},
    }
    assert rec["metrics"] == {"num_turns": 2.0}
    assert rec["policy"] == {"start": 4, "end": 5} and rec["run"]["work"]["policy"] == rec["policy"]
    # one stitched sample of 10 tokens, 5 of them sampled
    assert (rec["num_input_tokens"], rec["num_output_tokens"], rec["num_total_tokens"]) == (5, 5, 10)
    assert rec["timing"] == {"start": 100.0, "end": 101.5, "duration": 1.5}
    (trace,) = rec["traces"]
    assert [t["completion_ids"] for t in trace["turns"]] == [[10, 11], [12, 13, 14]]
    assert [t["logprobs"] for t in trace["turns"]] == [[-0.5, -0.25], [-0.125, -1.0, -0.01]]
    assert [t["finish_reason"] for t in trace["turns"]] == ["tool_calls", "stop"]
    assert [t["prompt_len"] for t in trace["turns"]] == [3, 7]
    assert (trace["reward"], trace["advantage"]) == (1.0, 0.5)
    json.dumps(rec, allow_nan=False)  # plain JSON


def test_token_texts_and_no_tokens() -> None:
    g = tool_group()
    rec = rl.rollout_record(
        4, "train", g, g.rollouts[0], trained=True, decode=lambda ids: [f"<{i}>" for i in ids]
    )
    assert rec["traces"][0]["turns"][1]["tokens"] == ["<12>", "<13>", "<14>"]
    bare = rl.rollout_record(4, "train", g, g.rollouts[0], trained=True, tokens=False)
    assert (
        "completion_ids" not in bare["traces"][0]["turns"][0]
        and bare["traces"][0]["turns"][0]["num_tokens"] == 2
    )


def test_an_errored_rollout_keeps_its_prompt_and_cause() -> None:
    g = tool_group()
    rec = rl.rollout_record(4, "train", g, g.rollouts[2], trained=True)
    assert rec["ok"] is False and rec["errors"] == [{"type": "ValueError", "message": "tool exploded"}]
    assert rec["messages"] == PROMPT and rec["reward"] == 0.0 and rec["num_total_tokens"] == 0
    assert rec["timing"]["start"] == 100.0 and rec["timing"]["end"] >= 100.0


def test_reward_weights_come_from_the_env_and_cross_the_wire() -> None:
    env = Environment(Rubric([(lambda t, c, s: 1.0, 0.5)]))
    traj = env.with_weights(Trajectory(TASK, [], 2, [], metrics={"<lambda>": 1.0}))
    assert traj.reward_weights == {"<lambda>": 0.5}
    assert from_wtraj(TASK, to_wtraj(tool_rollout())).reward_weights == {"correct": 1.0, "format": 0.0}
    own = env.with_weights(tool_rollout())  # a trajectory's own weights win
    assert own.reward_weights == {"correct": 1.0, "format": 0.0}


# -- which groups go into step N's file -------------------------------------------------------------
def _g(example: int) -> GroupRecord:
    return GroupRecord(env="e", example_id=example, task_index=example, task_epoch=0, rollouts=[])


def test_each_group_is_saved_once_trained_dropped_or_carried() -> None:
    carried_in, new_a, new_b, dropped, carried_out = _g(1), _g(2), _g(3), _g(4), _g(5)
    items = rl.train_items(
        trained=[carried_in, new_a, new_b],
        generated=[new_a, new_b, dropped, carried_out],
        carried=[carried_out],
        task_of=lambda g: None,
    )
    assert [(g.example_id, trained) for g, _, trained in items] == [
        (1, True),
        (2, True),
        (3, True),
        (4, False),
    ]


# -- the writer ------------------------------------------------------------------------------------
def _log(tmp_path: Path, **kw) -> tuple[rl.RolloutLog, RunPaths]:
    paths = RunPaths(tmp_path)
    return rl.RolloutLog(paths, task_of=lambda g: TASK, **kw), paths


def test_writer_writes_whole_files_and_a_resumed_step_is_rewritten(tmp_path: Path) -> None:
    log, paths = _log(tmp_path)
    g1, g2 = tool_group(), tool_group()
    g2.example_id = 8
    log.train(3, [g1, g2], [g1, g2], [])
    log.flush()
    assert [r["task"]["example_id"] for r in rf.iter_records(tmp_path, 3, "train")] == [7] * 3 + [8] * 3
    assert not list(paths.rollout_step_dir(3).rglob(f"*{TMP_MARK}*"))  # written by rename
    # the resumed run generates step 3 again: one file, the new rollouts only
    log.forget_after(2, evaluated=[])
    assert rf.steps(tmp_path) == []
    g3 = tool_group()
    log.train(3, [g3], [g3], [])
    log.close()
    recs = list(rf.iter_records(tmp_path, 3, "train"))
    assert len(recs) == 3 and {r["task"]["example_id"] for r in recs} == {7}
    assert len(rf.index(tmp_path, 3, "train")) == 3


def test_forget_after_keeps_what_the_checkpoint_holds(tmp_path: Path) -> None:
    log, paths = _log(tmp_path)
    for s in (1, 2, 3, 4):
        log.train(s, [tool_group()], [], [])
    log.eval(2, [("calc", [TASK], [tool_group().rollouts])])
    log.eval(4, [("calc", [TASK], [tool_group().rollouts])])
    log.flush()
    assert rf.splits(tmp_path, 2) == ["train", "eval"] and rf.splits(tmp_path, 4) == ["train", "eval"]
    log.forget_after(2, evaluated=[2])
    log.close()
    assert rf.steps(tmp_path) == [1, 2] and rf.splits(tmp_path, 2) == ["train", "eval"]
    assert not paths.rollout_step_dir(4).exists()


def test_eval_records(tmp_path: Path) -> None:
    log, _ = _log(tmp_path)
    log.eval(5, [("calc", [TASK], [tool_group().rollouts])])
    log.close()
    recs = list(rf.iter_records(tmp_path, 5, "eval"))
    assert [(r["split"], r["trained"], r["advantage"], r["id"]) for r in recs][0] == (
        "eval",
        False,
        None,
        "eval-5-calc-7-0",
    )
    assert recs[0]["task"]["answer"] == "5"


def test_retention_keeps_the_newest_steps(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, keep=2)
    for s in range(1, 6):
        log.train(s, [tool_group()], [], [])
    log.close()
    assert rf.steps(tmp_path) == [4, 5]
    assert rl.keep_steps(None, 3, 10) == 30 and rl.keep_steps(4, 3, 10) == 4
    assert rl.keep_steps(None, 3, None) is None and rl.keep_steps(None, None, 5) is None


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, enabled=False)
    log.train(1, [tool_group()], [], [])
    log.close()
    assert rf.steps(tmp_path) == []


def test_a_refused_write_is_named_and_the_run_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    import errno

    log, _ = _log(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(rl, "write_atomic", full)
    with caplog.at_level("WARNING"):
        log.train(1, [tool_group()], [], [])
        log.train(2, [tool_group()], [], [])
        log.flush()
    named = [r.getMessage() for r in caplog.records if "disk full" in r.getMessage()]
    assert len(named) == 1, named  # once per cause
    monkeypatch.undo()
    log.train(3, [tool_group()], [], [])
    log.close()
    assert rf.steps(tmp_path) == [3]


# -- the bus leaves saved rollouts alone -------------------------------------------------------------
def test_bus_cleanup_and_move_aside_spare_saved_rollouts(tmp_path: Path) -> None:
    from hpcrl.bus import Bus
    from tests.unit.test_bus_api import make_batch

    paths = RunPaths(tmp_path)
    bus = Bus(paths, "orchestrator", listen=False)
    log = rl.RolloutLog(paths)
    for s in range(1, 6):
        bus.publish_batch(s, 0, make_batch(step=s))
        log.train(s, [tool_group()], [], [])
    log.close()
    bus.cleanup(before_step=3)
    assert not paths.rollout_file(1, 0).exists() and not paths.rollout_file(2, 0).exists()
    assert rf.steps(tmp_path) == [1, 2, 3, 4, 5]
    moved = bus.move_aside_after(3, tag="resume_3")
    aside = paths.moved_aside_dir("resume_3")
    assert sorted(p.relative_to(aside).as_posix() for p in moved) == [
        "rollouts/step_4/rank_0.msgpack",
        "rollouts/step_5/rank_0.msgpack",
    ]
    assert rf.steps(tmp_path) == [1, 2, 3, 4, 5] and paths.rollout_file(3, 0).exists()
    bus.close()


@pytest.mark.parametrize("n", [0, 1])
def test_index_rows_match_the_records(tmp_path: Path, n: int) -> None:
    log, _ = _log(tmp_path)
    log.train(1, [tool_group()] * n, [], [])
    log.close()
    idx = rf.index(tmp_path, 1, "train")
    assert len(idx) == 3 * n
    assert [(r.example_id, r.index, r.reward, r.advantage, r.ok, r.trained) for r in idx.rows] == [
        (7, 0, 1.0, 0.5, True, True),
        (7, 1, 0.0, -0.5, True, True),
        (7, 2, 0.0, 0.0, False, True),
    ][: 3 * n]
