"""The reader of saved rollouts (hpcrl.monitor.rollout_files): the byte-offset index, paging, a torn
last line or a stale index, what a page asks for."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.monitor import rollout_files as rf
from hpcrl.paths import RunPaths


def _rec(step: int, example: int, index: int, reward: float) -> dict:
    return {
        "id": f"train-{step}-e-{example}-{index}",
        "step": step,
        "split": "train",
        "env": {"id": "e", "name": "e"},
        "task": {"example_id": example},
        "group": {"id": f"e/{example}", "index": index},
        "ok": True,
        "trained": True,
        "reward": reward,
        "advantage": reward - 0.5,
        "messages": [{"role": "user", "content": "x" * (10 + index)}],
    }


def _write(root: Path, step: int, recs: list[dict], sidecar: bool = True) -> Path:
    """As the orchestrator's writer does (traces.jsonl, then its index)."""
    from hpcrl.orchestrator.rollout_log import write_step

    lines = [json.dumps(r).encode() + b"\n" for r in recs]
    rows, off = [], 0
    for r, line in zip(recs, lines):
        rows.append(rf.row_of(rf.summary_of(r, off, len(line))))
        off += len(line)
    index = {"format": rf.INDEX_FORMAT, "size": off, "columns": list(rf.COLUMNS), "rows": rows}
    paths = RunPaths(root)
    write_step(paths, step, "train", b"".join(lines), json.dumps(index).encode())
    if not sidecar:
        paths.saved_rollouts_index(step, "train").unlink()
    return paths.saved_rollouts_file(step, "train")


RECS = [_rec(3, e, i, float(i % 2)) for e in range(4) for i in range(5)]


def test_steps_splits_and_groups(tmp_path: Path) -> None:
    _write(tmp_path, 3, RECS)
    _write(tmp_path, 10, RECS[:2])
    (tmp_path / "rollouts" / "step_11").mkdir()  # bus batches only: no saved rollouts
    assert rf.steps(tmp_path) == [3, 10] and rf.splits(tmp_path, 3) == ["train"]
    idx = rf.index(tmp_path, 3, "train")
    assert len(idx) == 20 and idx.groups()[("e", 2)] == [10, 11, 12, 13, 14]
    assert rf.index(tmp_path, 99, "eval").rows == ()


def test_paging_reads_only_the_asked_records(tmp_path: Path, monkeypatch) -> None:
    _write(tmp_path, 3, RECS)
    assert rf.read(tmp_path, 3, "train", 7, 4) == RECS[7:11]
    assert rf.read(tmp_path, 3, "train", 18, 10) == RECS[18:]
    assert rf.read(tmp_path, 3, "train", 40, 10) == []
    assert rf.read(tmp_path, 3, "train") == RECS == list(rf.iter_records(tmp_path, 3, "train"))
    # a page reads the bytes of its rows, not the file
    rf.clear_cache()
    idx = rf.index(tmp_path, 3, "train")
    reads: list[int] = []
    real_open = open

    def counting_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)  # type: ignore[method-assign]
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    page = rf.read_rows(idx.path, idx.rows[5:7])
    assert page == RECS[5:7] and reads == [idx.rows[5].length + idx.rows[6].length]


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = _write(tmp_path, 3, RECS[:4])
    with open(path, "ab") as f:
        f.write(json.dumps(RECS[4]).encode()[:30])  # a writer killed mid-line (no newline)
    rf.clear_cache()
    idx = rf.index(tmp_path, 3, "train")  # the index no longer matches the size: scanned
    assert len(idx) == 4 and rf.read(tmp_path, 3, "train", 2, 5) == RECS[2:4]
    assert list(rf.iter_records(tmp_path, 3, "train")) == RECS[:4]


def test_no_index_or_a_bad_one_means_a_scan(tmp_path: Path) -> None:
    path = _write(tmp_path, 3, RECS, sidecar=False)
    with open(path, "ab") as f:
        f.write(b"not json\n")
    rf.clear_cache()
    assert len(rf.index(tmp_path, 3, "train")) == 20
    RunPaths(tmp_path).saved_rollouts_index(3, "train").write_text("{broken")
    rf.clear_cache()
    assert rf.read(tmp_path, 3, "train", 19, 1) == RECS[19:]


def test_the_index_follows_a_rewritten_file(tmp_path: Path) -> None:
    _write(tmp_path, 3, RECS)
    assert len(rf.index(tmp_path, 3, "train")) == 20
    _write(tmp_path, 3, RECS[:3])  # a resumed step, written whole again
    assert len(rf.index(tmp_path, 3, "train")) == 3 and rf.read(tmp_path, 3, "train", 2, 5) == RECS[2:3]
    assert rf.file_size(tmp_path, 3, "train") > 0 and rf.file_size(tmp_path, 4, "train") == 0
