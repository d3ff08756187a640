"""The pure half of scripts/bench/e2e.py: fake metrics.jsonl records -> medians, pipeline ratio,
reward at the wall-clock budget, target verdicts. Numbers are chosen so every value is checkable by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "e2e.py"
_spec = importlib.util.spec_from_file_location("bench_e2e", _PATH)
e2e = importlib.util.module_from_spec(_spec)
sys.modules["bench_e2e"] = e2e  # dataclasses resolve string annotations through sys.modules
_spec.loader.exec_module(e2e)


def fake_run(periods, gen, train_busy, rewards, t0=1000.0, samples=128, wait=0.5, fb_frac=0.5, bcast=0.1):
    """Records as hpcrl writes them: trainer step N ends at t0 + sum(periods[:N]); the orchestrator's
    batch N is stamped `wait` seconds before the trainer's step N ends."""
    recs, t = [], t0
    for i, dt in enumerate(periods):
        n, t = i + 1, t + dt
        recs.append(
            {
                "role": "orchestrator",
                "step": n,
                "time": t - wait,
                "reward/all/mean": rewards[i],
                "time/generate": gen[i],
                "batch/samples": samples,
            }
        )
        recs.append(
            {
                "role": "trainer",
                "step": n,
                "time": t,
                "time/step": train_busy[i] + wait,
                "time/wait_for_batch": wait,
                "time/forward_backward": fb_frac * train_busy[i],
                "time/broadcast": bcast,
            }
        )
    return recs


def test_median_ignores_missing_values():
    assert e2e.median([3.0, None, 1.0, 2.0]) == 2.0
    assert e2e.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert e2e.median([None]) is None
    assert e2e.median([]) is None


def test_step_one_is_excluded_and_medians_are_per_step():
    # Step 1 is a 10 s warm-up with slow generation; steps 2..5 take 2, 2, 4, 2 s.
    recs = fake_run(
        periods=[10.0, 2.0, 2.0, 4.0, 2.0],
        gen=[9.0, 1.8, 1.6, 1.7, 3.0],
        train_busy=[5.0, 1.0, 1.2, 1.1, 0.9],
        rewards=[0.1] * 5,
    )
    s = e2e.summarize(recs, budget_s=100.0, launched_at=990.0)
    assert s.steps == 5
    assert s.step_s == 2.0  # median of 2, 2, 4, 2
    assert s.samples_per_s == 64.0  # median of 128/2, 128/2, 128/4, 128/2
    assert s.gen_s == pytest.approx(1.75)  # median of 1.8, 1.6, 1.7, 3.0
    assert s.train_s == pytest.approx(1.05)  # time/step - time/wait_for_batch: median of 1.0, 1.2, 1.1, 0.9
    assert s.pipeline_ratio == pytest.approx(2.0 / 1.75)
    assert s.fb_bcast_s == pytest.approx(0.5 * 1.05 + 0.1)
    assert s.startup_s == pytest.approx(20.0)  # launch at 990, step 1 ends at 1010


def test_pipeline_ratio_uses_the_slower_side():
    # Training-bound: the ratio divides by the trainer's busy time.
    recs = fake_run(periods=[5.0, 3.0, 3.0, 3.0], gen=[1.0] * 4, train_busy=[2.5] * 4, rewards=[0.0] * 4)
    assert e2e.summarize(recs, 100.0).pipeline_ratio == pytest.approx(3.0 / 2.5)
    # A serial loop (gen then train): ratio = (gen + train) / max(gen, train).
    recs = fake_run(periods=[5.0, 3.0, 3.0, 3.0], gen=[2.0] * 4, train_busy=[1.0] * 4, rewards=[0.0] * 4)
    assert e2e.summarize(recs, 100.0).pipeline_ratio == pytest.approx(1.5)


def test_reward_at_budget_counts_only_batches_generated_before_the_deadline():
    # Step 1 ends at t=1001; with a 5 s budget the deadline is 1006. Batches are stamped 0.5 s before
    # their trainer step ends: batch N at 1000 + N - 0.5, so batches 1..6 (t <= 1005.5) count.
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    recs = fake_run(periods=[1.0] * 8, gen=[0.5] * 8, train_busy=[0.5] * 8, rewards=rewards)
    s = e2e.summarize(recs, budget_s=5.0, window=3)
    assert s.reward_at_budget == pytest.approx((0.4 + 0.5 + 0.6) / 3)
    assert s.steps_in_budget == 6  # trainer steps ending at 1001..1006
    assert s.reward_first == pytest.approx((0.1 + 0.2 + 0.3) / 3)


def test_eval_records_and_gaps_do_not_pollute_the_step_series():
    recs = fake_run(periods=[4.0, 2.0, 2.0, 2.0, 2.0], gen=[1.0] * 5, train_busy=[1.0] * 5, rewards=[0.2] * 5)
    recs.append({"role": "orchestrator", "step": 3, "time": 1e9, "eval/reverse-text/avg@1": 0.9})
    # Drop trainer step 4: periods 3->5 must not be counted as one (twice as long) step.
    recs = [r for r in recs if not (r["role"] == "trainer" and r["step"] == 4)]
    s = e2e.summarize(recs, 100.0)
    assert s.step_s == 2.0 and s.samples_per_s == 64.0
    assert s.reward_at_budget == pytest.approx(0.2)


def test_empty_run_summarises_to_nothing():
    s = e2e.summarize([], 60.0)
    assert (
        s.steps == 0 and s.samples_per_s is None and s.pipeline_ratio is None and s.reward_at_budget is None
    )


def _summary(rate, ratio):
    return e2e.Summary(10, 10, rate, 1.0, 1.0, 1.0, 1.0, ratio, 0.5, 0.1, 5.0)


def test_verdicts_say_below_target_when_missed():
    results = {
        "hpcrl async0": _summary(150.0, 1.9),
        "hpcrl async1": _summary(250.0, 1.3),
        "trl": _summary(100.0, 2.0),
    }
    lines = e2e.verdicts(results)
    assert "hpcrl async0: samples/s = 1.50x TRL (target >= 2x): below target" in lines
    assert "hpcrl async1: samples/s = 2.50x TRL (target >= 2x): meets target" in lines
    assert "hpcrl async1: pipeline ratio = 1.30 (target <= 1.15): below target" in lines
    assert not any(line.startswith("hpcrl async0: pipeline") for line in lines)  # serial by design
    assert not any(line.startswith("trl") for line in lines)


def test_table_has_one_row_per_system_and_speedups():
    results = {"hpcrl async1": _summary(250.0, 1.1), "trl": _summary(100.0, 2.0)}
    table = e2e.format_table(results, 60.0)
    lines = table.splitlines()
    assert len(lines) == 4 and "samples/s" in lines[0]
    assert "2.50x" in lines[2] and lines[3].startswith("trl")
    # Without TRL there is no speedup to show.
    assert (
        "x"
        not in e2e.format_table({"hpcrl async1": _summary(250.0, 1.1)}, 60.0).splitlines()[2].split("|")[8]
    )


def test_reward_by_clock_and_time_to_reward():
    # launched at 1000; a step every 10 s from 1010, its batch stamped 0.5 s earlier; rewards 0.1 .. 0.6
    recs = fake_run([10.0] * 6, [1.0] * 6, [1.0] * 6, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    rows = e2e.reward_by_clock(recs, launched=1000.0, budget_s=60.0, every=20.0)
    # windows (0, 20], (20, 40], (40, 60]: batches at 9.5 + 19.5 s, 29.5 + 39.5 s, 49.5 + 59.5 s
    assert [t for t, _, _ in rows] == [20.0, 40.0, 60.0]
    assert [r for _, r, _ in rows] == pytest.approx([0.15, 0.35, 0.55])
    assert [k for _, _, k in rows] == [2, 4, 6]
    assert e2e.reward_by_clock(recs, 1000.0, 60.0, every=5.0)[0][1] is None  # no batch in (0, 5]
    # mean of the last 2 batches: 0.45 first at batch 5 (49.5 s), never 0.6
    assert e2e.time_to_reward(recs, 1000.0, 0.45, window=2) == pytest.approx(49.5)
    assert e2e.time_to_reward(recs, 1000.0, 0.6, window=2) is None
    table = e2e.format_clock_table({"hpcrl": rows, "trl": rows})
    assert "hpcrl - trl" in table.splitlines()[0] and "+0.000" in table


# --- scripts/bench/e2e_wallclock.py: the lr sweep's pure part --------------------------------------
sys.modules["e2e"] = e2e  # e2e_wallclock imports its sibling by name: give it this same module
_wspec = importlib.util.spec_from_file_location("bench_e2e_wallclock", _PATH.parent / "e2e_wallclock.py")
wall = importlib.util.module_from_spec(_wspec)
_wspec.loader.exec_module(wall)


def test_run_order_alternates_so_drift_hits_both_sides():
    assert [wall.run_order(i) for i in range(3)] == [("hpcrl", "trl"), ("trl", "hpcrl"), ("hpcrl", "trl")]


def test_cell_reads_the_last_window_and_reach_times():
    # batches at 9.5, 19.5, ... 59.5 s after launch with rewards 0.1 .. 0.6 (see fake_run)
    recs = fake_run([10.0] * 6, [1.0] * 6, [1.0] * 6, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    c = wall.cell(recs, launched=1000.0, budget_s=60.0)
    assert c["reward"] == pytest.approx(0.55) and c["steps"] == 6  # window (40, 60]: 0.5, 0.6
    # 10-batch means never reach 0.6 with 6 batches
    assert c["reach"] == {"0.6": None, "0.7": None}


def _cell(reward, steps, r6=None, r7=None):
    return {"reward": reward, "steps": steps, "reach": {"0.6": r6, "0.7": r7}, "curve": []}


def test_sweep_rows_take_medians_over_repeats_and_the_difference_of_medians():
    results = {
        "2e-3": [
            {"hpcrl": _cell(0.8, 700, 20, 30), "trl": _cell(0.7, 400, 50, None)},
            {"hpcrl": _cell(0.6, 500, 30, None), "trl": _cell(0.9, 420, 40, 60)},
            {"hpcrl": _cell(0.7, 600, 25, 35), "trl": _cell(0.8, 380, 45, 70)},
        ],
        "5e-4": [{"hpcrl": _cell(0.7, 650), "trl": _cell(None, 0)}],
    }
    rows = wall.sweep_rows(results)
    a, b = rows
    assert (a["lr"], a["runs"], a["hpcrl"], a["trl"]) == ("2e-3", 3, 0.7, 0.8)
    assert a["delta"] == pytest.approx(-0.1)
    assert (a["hpcrl steps"], a["trl steps"]) == (600, 400)
    assert (a["hpcrl reach 0.6"], a["trl reach 0.7"]) == (25, 65)  # median of the runs that got there
    assert b["trl"] is None and b["delta"] is None
    lines = wall.verdict_lines(rows, 120.0)
    assert "difference -0.100" in lines[0] and lines[0].endswith("below target")
    assert "no reward" in lines[1]
    table = wall.format_sweep(rows, 120.0).splitlines()
    assert "hpcrl @120s" in table[0] and "-0.100" in table[2] and "600 / 400" in table[2]


def test_verdicts_name_the_best_lr_of_each_side():
    rows = wall.sweep_rows(
        {
            "2e-3": [{"hpcrl": _cell(0.75, 1), "trl": _cell(0.74, 1)}],
            "5e-4": [{"hpcrl": _cell(0.72, 1), "trl": _cell(0.45, 1)}],
        }
    )
    lines = wall.verdict_lines(rows, 120.0)
    assert lines[1].endswith("meets target")  # 0.72 - 0.45
    assert "hpcrl 0.750 (lr 2e-3) vs TRL 0.740 (lr 2e-3): +0.010" in lines[-1]


def test_wallclock_cli_rejects_only_and_bad_repeats():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--mode", "wallclock", "--only", "trl"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--mode", "wallclock", "--repeats", "0"])
    for bad in ("2e-3,abc", "0", "2e-3,"):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--mode", "wallclock", "--lr", bad])
    args = e2e.parse_args(["--mode", "wallclock", "--lr", "2e-3,5e-4"])
    assert (args.budget_s, args.lr, args.repeats) == (120.0, "2e-3,5e-4", 1)


def test_a_run_that_stopped_before_the_budget_is_reported():
    recs = fake_run([10.0] * 6, [1.0] * 6, [1.0] * 6, [0.1] * 6)  # trainer records at 10 .. 60 s
    assert wall.ended_early(recs, launched=1000.0, budget_s=120.0) == pytest.approx(60.0)
    assert wall.ended_early(recs, launched=1000.0, budget_s=75.0) is None  # within the 20 s slack
    assert wall.ended_early([], launched=1000.0, budget_s=120.0) == 0.0
    assert e2e.parse_args(["--mode", "wallclock"]).steps == 100_000
    assert e2e.parse_args([]).steps == 1000


def test_the_plot_stays_under_the_output_dir_unless_docs_are_asked_for(tmp_path):
    """Running a benchmark must not dirty the checkout: docs/img/ only with --update-docs."""
    assert e2e.parse_args(["--mode", "wallclock"]).update_docs is False
    assert e2e.parse_args(["--mode", "wallclock", "--update-docs"]).update_docs is True
    assert wall.plot_paths(tmp_path, update_docs=False) == [tmp_path / "e2e_wallclock.png"]
    plot, docs = wall.plot_paths(tmp_path, update_docs=True)
    assert plot.parent == tmp_path and docs == wall.REPO / "docs" / "img" / "e2e_wallclock.png"
