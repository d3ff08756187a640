"""Pure parts of `hpcrl eval` / `hpcrl gepa`: summary math (hand-checked), command-line translation,
the GEPA budget rule and reflection records, and the system prompt override every env takes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpcrl.config.schema import EvalRunConfig, GepaRunConfig
from hpcrl.envs import load_environment
from hpcrl.envs.base import Task, with_system_prompt
from hpcrl.errors import ConfigError
from hpcrl.evaluation import summary as S
from hpcrl.evaluation.args import EVAL_FLAGS, GEPA_FLAGS, load_run, split_argv
from hpcrl.evaluation.gepa_adapter import BudgetStopper, feedback
from hpcrl.orchestrator.state import RolloutRecord
from tests.vf_classic import classic_verifiers


def group(*rewards: float | None) -> list[RolloutRecord]:
    """None = an errored rollout."""
    return [
        RolloutRecord(index=i, pieces=[], reward=r or 0.0, error=None if r is not None else "boom")
        for i, r in enumerate(rewards)
    ]


def test_avg_pass_std_and_uniform_fraction_by_hand() -> None:
    groups = [group(1.0, 0.0, 0.0), group(0.5, 0.5, 0.5), group(0.0, None, 0.0), group(1.0, 1.0, 1.0)]
    s = S.summarize_env(groups, 3, threshold=0.99)
    # rewards (errored = 0): 1,0,0 | .5,.5,.5 | 0,0,0 | 1,1,1 -> sum 5.5 over 12
    assert s["avg@3"] == pytest.approx(5.5 / 12)
    assert s["pass@3"] == pytest.approx(2 / 4)  # examples 0 and 3 have a reward >= 0.99
    assert s["reward_mean"] == pytest.approx(5.5 / 12)
    flat = [1, 0, 0, 0.5, 0.5, 0.5, 0, 0, 0, 1, 1, 1]
    mean = sum(flat) / 12
    assert s["reward_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in flat) / 12))
    assert s["example_std"] == pytest.approx((math.sqrt(2 / 9) + 0 + 0 + 0) / 4)  # std of (1,0,0) = sqrt(2)/3
    assert s["uniform_fraction"] == pytest.approx(3 / 4)
    assert s["errored"] == 1 and s["num_rollouts"] == 12 and s["num_examples"] == 4


def test_pass_threshold_and_single_rollouts() -> None:
    s = S.summarize_env([group(0.98), group(0.99)], 1, threshold=0.99)
    assert s["avg@1"] == pytest.approx(0.985) and s["pass@1"] == pytest.approx(0.5)
    assert s["uniform_fraction"] is None  # k = 1: "all k equal" says nothing
    assert S.recommendation(s, 0.5) is None


def test_recommendation_names_the_cause() -> None:
    hard = S.summarize_env([group(0.0, 0.0), group(0.0, 0.0), group(1.0, 0.0)], 2, 0.99)
    assert "too hard" in S.recommendation(hard, 0.5) and "67%" in S.recommendation(hard, 0.5)
    easy = S.summarize_env([group(1.0, 1.0), group(1.0, 1.0)], 2, 0.99)
    assert "too easy" in S.recommendation(easy, 0.5)
    mid = S.summarize_env([group(0.5, 0.5), group(0.5, 0.5)], 2, 0.99)
    assert "temperature" in S.recommendation(mid, 0.5)
    assert S.recommendation(mid, 1.01) is None
    broken = S.summarize_env([group(None, None)], 2, 0.99)
    assert "errored" in S.recommendation(broken, 0.5)
    assert S.table_rows({"rev": mid})[0][:4] == ["rev", "2 x 2", "0.500", "0.000"]


def test_short_flags_and_positional_envs() -> None:
    rest, extra = split_argv(
        [
            "reverse-text",
            "arithmetic",
            "-m",
            "M",
            "-n",
            "8",
            "-r",
            "3",
            "-a",
            '{"seed": 1}',
            "--sampling.temperature",
            "0.5",
            "-b",
            "http://x:1/v1",
            "@",
            "c.toml",
        ],
        EvalRunConfig,
        EVAL_FLAGS,
    )
    assert rest == ["--sampling.temperature", "0.5", "@", "c.toml"]
    assert extra == {
        "model": "M",
        "num_examples": "8",
        "rollouts_per_example": "3",
        "client": {"base_url": "http://x:1/v1"},
        "env": [{"id": "reverse-text", "args": {"seed": 1}}, {"id": "arithmetic", "args": {"seed": 1}}],
    }
    _, g = split_argv(
        ["reverse-text", "-M", "R", "-B", "30", "-N", "4", "--state-columns", "text,answer"],
        GepaRunConfig,
        GEPA_FLAGS,
    )
    assert g["gepa"] == {
        "reflection_model": "R",
        "max_calls": "30",
        "num_val": "4",
        "state_columns": ["text", "answer"],
    }


def test_load_run_types_values_and_reports_one_line_errors() -> None:
    cfg = load_run(
        ["reverse-text", "-m", "hpcrl/tiny-qwen3", "-n", "8", "-r", "3"], EvalRunConfig, EVAL_FLAGS
    ).config
    assert (cfg.num_examples, cfg.rollouts_per_example, cfg.env[0].id) == (8, 3, "reverse-text")
    with pytest.raises(ConfigError, match="rollouts_per_example"):
        load_run(["reverse-text", "-m", "M", "-r", "zero"], EvalRunConfig, EVAL_FLAGS)
    with pytest.raises(ConfigError, match="^model: required"):
        load_run(["reverse-text"], EvalRunConfig, EVAL_FLAGS)
    with pytest.raises(ConfigError, match="env.args: -a expects a JSON object"):
        load_run(["reverse-text", "-m", "M", "-a", "{bad"], EvalRunConfig, EVAL_FLAGS)
    with pytest.raises(ConfigError, match=r"env\[0\].*unknown argument 'nope'"):
        load_run(["reverse-text", "-m", "M", "-a", '{"nope": 1}'], EvalRunConfig, EVAL_FLAGS)
    with pytest.raises(ConfigError, match="gepa.minibatch_size"):
        load_run(["reverse-text", "-m", "M", "--minibatch-size", "0"], GepaRunConfig, GEPA_FLAGS)


def test_budget_stopper_stops_before_an_iteration_that_could_overrun() -> None:
    class State:
        total_num_evals = 0

    stop = BudgetStopper(max_calls=30, minibatch_size=3, num_val=6)  # worst iteration: 3 + 3 + 6
    for used, expected in ((6, False), (18, False), (19, True), (30, True)):
        State.total_num_evals = used
        assert stop(State) is expected


def test_reflection_record_has_feedback_and_state_columns() -> None:
    task = Task(
        3, [{"role": "system", "content": "S"}, {"role": "user", "content": "abc"}], "cba", {"text": "abc"}
    )
    row = {
        "prompt": task.prompt,
        "completion": [{"role": "assistant", "content": "abd"}],
        "reward": 0.5,
        "metrics": {"exact": 0.0},
        "error": None,
        "truncated": True,
        "answer": "cba",
    }
    rec = feedback(row, task, ["text", "answer", "missing"])
    assert rec["Inputs"] == "[user] abc" and rec["Generated Outputs"] == "[assistant] abd"
    assert "Reward 0.500 (exact=0)" in rec["Feedback"] and "expected answer was: cba" in rec["Feedback"]
    assert "cut off" in rec["Feedback"]
    assert (rec["text"], rec["answer"], rec["missing"]) == ("abc", "cba", "(not available)")


def test_system_prompt_override_and_file(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "old"}, {"role": "user", "content": "u"}]
    assert with_system_prompt(msgs, "new")[0] == {"role": "system", "content": "new"}
    assert with_system_prompt(msgs, "") == [{"role": "user", "content": "u"}]
    assert with_system_prompt(msgs[1:], "new") == [{"role": "system", "content": "new"}, msgs[1]]
    assert with_system_prompt(msgs, None) == msgs
    f = tmp_path / "best_prompt.txt"
    f.write_text("Write the letters backwards.\n")
    env = load_environment("reverse-text", system_prompt_file=str(f), num_examples=4)
    task = env.tasks("train")[0]
    assert env.initial_messages(task)[0] == {"role": "system", "content": "Write the letters backwards."}
    with pytest.raises(ValueError, match="not both"):
        load_environment("reverse-text", system_prompt="a", system_prompt_file=str(f))
    with pytest.raises(ValueError, match="system_prompt_file"):
        load_environment("reverse-text", system_prompt_file=str(tmp_path / "nope.txt"))


def test_verifiers_env_takes_a_system_prompt_it_has_no_argument_for(tmp_path: Path) -> None:
    classic_verifiers()
    f = tmp_path / "p.txt"
    f.write_text("Spell it backwards.")
    env = load_environment(
        "tests.integration.vf_env_fixture:load_environment", num_examples=2, system_prompt_file=str(f)
    )
    task = env.tasks("train")[0]
    assert task.prompt[0]["content"] == "Reverse the text."  # the dataset keeps its own
    assert env._rollout_input(task)["prompt"][0] == {"role": "system", "content": "Spell it backwards."}


def test_gepa_config_file_with_a_gepa_section(tmp_path: Path) -> None:
    f = tmp_path / "gepa.toml"
    f.write_text(
        'model = "hpcrl/tiny-qwen3"\noutput_dir = "out/g"\n[sampling]\nmax_tokens = 16\n'
        '[[env]]\nid = "reverse-text"\nargs = { num_examples = 20 }\n'
        '[gepa]\nmax_calls = 40\nnum_val = 5\nstate_columns = ["text"]\nperfect_score = 1.0\n'
    )
    cfg = load_run(["@", str(f), "-B", "50"], GepaRunConfig, GEPA_FLAGS).config
    assert (cfg.gepa.max_calls, cfg.gepa.num_val, cfg.gepa.state_columns) == (50, 5, ["text"])
    assert cfg.env[0].args == {"num_examples": 20} and cfg.sampling.max_tokens == 16
    f.write_text(f.read_text() + "budget = 3\n")
    with pytest.raises(ConfigError, match="unknown field"):
        load_run(["@", str(f)], GepaRunConfig, GEPA_FLAGS)
