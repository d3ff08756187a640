"""The demo's summary arithmetic (hpcrl.monitor.summary): windows, eval before/after, formatting."""

from __future__ import annotations

import json

import pytest

from hpcrl.monitor.summary import effective_window, format_summary, main, summarize


def _train(step: int, reward: float, t: float | None = None) -> dict:
    return {
        "role": "orchestrator",
        "step": step,
        "time": float(step) if t is None else t,
        "reward/all/mean": reward,
    }


def _eval(step: int, value: float) -> dict:
    return {
        "role": "orchestrator",
        "step": step,
        "time": 100.0 + step,
        "eval/rt/avg@2": value,
        "eval/rt/pass@2": value / 2,
    }


def test_first_and_last_windows_and_delta():
    recs = [_train(s, r) for s, r in enumerate([0.1, 0.2, 0.3, 0.5, 0.5, 0.6, 0.7, 0.8, 0.9], start=1)]
    s = summarize(recs, window=3)
    assert (s.steps, s.window) == (9, 3)
    assert s.train_first == pytest.approx(0.2) and s.train_last == pytest.approx(0.8)
    assert s.delta == pytest.approx(0.6)


def test_window_is_clamped_so_first_and_last_do_not_overlap():
    assert effective_window(100, 10) == 10
    assert effective_window(9, 10) == 3
    assert effective_window(2, 10) == 1
    s = summarize([_train(1, 0.0), _train(2, 1.0)], window=10)
    assert (s.window, s.train_first, s.train_last) == (1, 0.0, 1.0)


def test_eval_before_is_the_first_eval_and_after_the_last_only_avg():
    recs = [_eval(0, 0.25), _train(1, 0.3), _eval(5, 0.4), _train(2, 0.3), _eval(10, 0.6)]
    s = summarize(recs)
    assert s.eval_before == {"eval/rt/avg@2": (0, 0.25)} and s.eval_after == {"eval/rt/avg@2": (10, 0.6)}


def test_a_redone_step_counts_once_with_its_later_value():
    # A resumed run logs the steps after its checkpoint again; the later record is the one that counts.
    recs = [_train(1, 0.0), _train(2, 0.0), _train(2, 0.9), _train(3, 0.9)]
    s = summarize(recs, window=1)
    assert s.steps == 3 and s.train_last == pytest.approx(0.9)


def test_other_roles_and_missing_data():
    s = summarize([{"role": "trainer", "step": 1, "time": 0.0, "loss/mean": 2.0}])
    assert s.steps == 0 and s.delta is None and s.eval_before == {}
    text = format_summary(s)
    assert "eval: none logged" in text and "delta n/a" in text
    sft = summarize(
        [{"role": "trainer", "step": i, "time": 0.0, "loss/mean": 3.0 - i} for i in range(3)],
        key="loss/mean",
        role="trainer",
    )
    assert sft.train_first == 3.0 and sft.train_last == 1.0


def test_format_summary_lines(tmp_path):
    (tmp_path / "reward.png").write_bytes(b"")
    recs = [_eval(0, 0.25), *[_train(s, 0.2 if s <= 5 else 0.6) for s in range(1, 31)], _eval(30, 0.65)]
    text = format_summary(summarize(recs), wall_s=330, plots_dir=tmp_path)
    assert "eval rt/avg@2: 0.250 (policy 0) -> 0.650 (policy 30), delta +0.400; pass@2 0.125 -> 0.325" in text
    assert "(mean of 10 steps): first 0.400 -> last 0.600, delta +0.200 over 30 RL steps" in text
    assert "wall time: 330 s (5.5 min)" in text
    assert f"plots: {tmp_path}/ (reward.png)" in text


def test_cli(tmp_path, capsys):
    run, sft = tmp_path / "run", tmp_path / "sft"
    run.mkdir()
    sft.mkdir()
    recs = [_eval(0, 0.1), _train(1, 0.1), _train(2, 0.2), _train(3, 0.5), _eval(3, 0.5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (sft / "metrics.jsonl").write_text(
        json.dumps({"role": "trainer", "step": 1, "time": 0, "loss/mean": 4}) + "\n"
    )
    assert main([str(run), "--sft-dir", str(sft), "--wall-s", "12"]) == 0
    out = capsys.readouterr().out
    assert "train reward/all/mean (mean of 1 steps): first 0.100 -> last 0.500, delta +0.400" in out
    assert "SFT loss" in out and "wall time: 12 s" in out
    assert main([str(tmp_path / "nope")]) == 2


def test_main_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"summary: {tmp_path / 'metrics.jsonl'} does not exist (is {tmp_path} a run directory?)\n"
    )
