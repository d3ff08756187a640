"""An inference server's lost log lines (its log's disk full, read-only, over quota): written into
its /metrics, read back by the orchestrator's one Prometheus reader, and named at the right times."""

from __future__ import annotations

from pathlib import Path

from hpcrl.inference.prom import LOG_LINES_LOST, exposition
from hpcrl.orchestrator.concurrency.poller import LOST_REPEAT_S, LostLines
from hpcrl.orchestrator.concurrency.prometheus import parse, server_load

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm_0_33_metrics.txt"
LOAD = dict(
    running=1, waiting=0, kv_used=3, kv_capacity=64, preemptions=0, generated_tokens=9,
    max_model_len=64, max_batch_size=4,
)  # fmt: skip


def test_lost_lines_round_trip_through_the_exposition_with_an_awkward_reason() -> None:
    why = 'disk full at /r/"odd"\\dir/logs/inference.log (No space left on device), ENOSPC'
    text = exposition("m", **LOAD, log_lost=(7, why))
    assert f'{LOG_LINES_LOST}_total{{engine="0",model_name="m",reason=' in text
    load = server_load(parse(text))
    assert (load.log_lines_lost, load.log_lost_why) == (7, why)
    assert load.running == 1  # the other facts unchanged by the new row


def test_nothing_lost_reads_as_zero_and_no_reason() -> None:
    load = server_load(parse(exposition("m", **LOAD)))
    assert (load.log_lines_lost, load.log_lost_why) == (0, None)
    vllm = server_load(parse(GOLDEN.read_text()))  # vLLM's own text: no such counter
    assert (vllm.log_lines_lost, vllm.log_lost_why) == (0, None)


def test_named_when_it_starts_to_grow_then_at_most_every_repeat_interval() -> None:
    lost, why, R = LostLines(), "disk full at /x (No space left on device)", LOST_REPEAT_S
    seen = [
        lost.note("server0", n, why, t)
        for n, t in [
            (0, 0),
            (3, 5),  # starts to grow: said at once
            (5, 10),  # still growing
            (5, 15),  # not growing
            (9, 20),  # grows again 10 s later (a server logging every 10 s): not news
            (12, 5 + R),  # growing, a repeat interval after the last line: said again
            (12, 5 + 2 * R),
            (14, 5 + 3 * R),  # grows after a quiet spell: said at once
            (15, 6 + 3 * R),  # another cause: said at once
        ]
    ]
    assert seen == [
        None,
        f"3 log line(s) lost: {why} (3 in all)",
        None,
        None,
        None,
        f"9 log line(s) lost: {why} (12 in all)",
        None,
        f"2 log line(s) lost: {why} (14 in all)",
        None,
    ]
    assert lost.note("server0", 16, "read-only filesystem at /x (Read-only file system)", 7 + 3 * R) == (
        "2 log line(s) lost: read-only filesystem at /x (Read-only file system) (16 in all)"
    )


def test_servers_and_processes_are_counted_apart() -> None:
    lost = LostLines()
    assert lost.note("server0 pid 10", 4, "w", 0) == "4 log line(s) lost: w (4 in all)"
    assert lost.note("server1 pid 11", 2, None, 1) == "2 log line(s) lost: its log refused them (2 in all)"
    # server0 restarted as pid 12 while its log is still full: its own count, said at once
    assert lost.note("server0 pid 12", 20, "w", 2) == "20 log line(s) lost: w (20 in all)"
    assert lost.note("server0 pid 12", 20, "w", 3) is None


def test_status_shows_a_servers_lost_lines_beside_its_state(tmp_path: Path) -> None:
    import json
    import time

    from hpcrl.launch.stallview import health_lines
    from hpcrl.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.progress_dir.mkdir(parents=True)
    name = "inference server 0 (http://127.0.0.1:8000)"
    doc = {
        "role": "orchestrator", "state": "running", "step": 4, "last": "published batch 4",
        "time": time.time(), "servers": {name: "answering"}, "servers_log_lost": {name: 12},
        "inflight": {name: [2, 1]},
    }  # fmt: skip
    (paths.progress_dir / "orchestrator.json").write_text(json.dumps(doc))
    lines = health_lines(paths, running=True)
    assert (
        f"    {name}: answering (12 log line(s) lost), 2 request(s) in flight, oldest unanswered 1 s" in lines
    )
    doc["servers_log_lost"] = {}
    (paths.progress_dir / "orchestrator.json").write_text(json.dumps(doc))
    assert f"    {name}: answering, 2 request(s) in flight, oldest unanswered 1 s" in health_lines(
        paths, True
    )
