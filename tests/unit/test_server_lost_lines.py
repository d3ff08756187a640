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
    lost, why = LostLines(), "disk full at /x (No space left on device), ENOSPC"
    seen = [
        lost.note("server0", n, why, t)
        for n, t in [(0, 0), (3, 5), (5, 10), (5, 15), (9, 20), (12, 30), (15, 20 + LOST_REPEAT_S + 1)]
    ]
    assert seen == [
        None,
        f"3 log line(s) lost: {why} (3 in all)",  # it starts to grow: said at once
        None,  # still growing, 5 s later
        None,  # not growing
        f"6 log line(s) lost: {why} (9 in all)",  # grows again: said at once, the 6 since the last line
        None,  # growing, 10 s after the last line
        f"6 log line(s) lost: {why} (15 in all)",  # still growing, past the repeat interval
    ]


def test_a_restarted_server_counts_again_from_zero_and_servers_are_apart() -> None:
    lost = LostLines()
    assert lost.note("server0", 4, "w", 0) == "4 log line(s) lost: w (4 in all)"
    assert lost.note("server1", 2, None, 1) == "2 log line(s) lost: its log refused them (2 in all)"
    assert lost.note("server0", 1, "w", 2) is None  # a new process: fewer than before
    assert lost.note("server0", 3, "w", 3) == "3 log line(s) lost: w (3 in all)"  # counted from 0 again
    assert lost.note("server0", 3, "w", 4) is None
    assert lost.note("server0", 5, "w", 5) == "2 log line(s) lost: w (5 in all)"  # grows again
