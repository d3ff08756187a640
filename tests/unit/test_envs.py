"""Built-in environments, the step API driver, tool parsing and the registry."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest

from hpcrl.envs import Task, Turn, load_environment, stitch_turns, validate_env_spec
from hpcrl.envs.builtin._common import extract_number, levenshtein, similarity
from hpcrl.envs.builtin.calculator import calculate, safe_eval
from hpcrl.envs.registry import resolve_factory
from hpcrl.envs.tools import parse_tool_calls


def render(messages: list[dict]) -> list[int]:
    """A toy chat template: one token per character of 'role:content\\n'."""
    return [ord(c) for m in messages for c in f"{m['role']}:{m.get('content') or ''}\n"]


class ScriptedClient:
    """ChatClient that answers with reply(messages) and fake but consistent token ids."""

    def __init__(self, reply: Callable[[list[dict]], str], step: int = 3) -> None:
        self.reply, self.step, self.calls = reply, step, 0

    async def chat(self, messages, tools, sampling):
        self.calls += 1
        text = self.reply(messages)
        ids = [ord(c) for c in f"assistant:{text}\n"]
        return Turn(
            text=text,
            prompt_token_ids=render(messages),
            completion_token_ids=ids,
            completion_logprobs=[-0.5] * len(ids),
            policy_steps=[self.step],
            finish_reason="stop",
        )


def run(env, task, reply, **sampling):
    return asyncio.run(env.rollout(task, ScriptedClient(reply), sampling))


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# --- text helpers -------------------------------------------------------------------------------


def test_levenshtein_and_similarity():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert similarity("abc", "abc") == 1.0
    assert similarity("", "") == 1.0
    assert similarity("abcd", "abxd") == pytest.approx(0.75)
    assert similarity(["a", "b"], ["b", "a"]) == 0.0


@pytest.mark.parametrize(
    "text,want",
    [
        ("so the answer is\n#### 42", "42"),
        ("#### 1,000", "1000"),
        ("x \\boxed{17} y", "17"),
        ("first 3 then 5.0", "5"),
        ("no number", None),
        ("<think>7</think> it is 8", "8"),
        ("-4", "-4"),
    ],
)
def test_extract_number(text, want):
    assert extract_number(text) == want


# --- reverse-text -------------------------------------------------------------------------------


def test_reverse_text_rewards_and_determinism():
    env = load_environment("reverse-text", num_examples=50, num_eval_examples=10, num_val_examples=5)
    tasks = env.tasks("train")
    assert len(tasks) == 50 and [t.example_id for t in tasks] == list(range(50))
    assert all(3 <= len(t.info["text"]) <= 6 and t.info["text"].islower() for t in tasks)
    again = load_environment("reverse-text", num_examples=50, num_eval_examples=10, num_val_examples=5)
    assert [t.answer for t in again.tasks("train")] == [t.answer for t in tasks]
    assert [t.answer for t in env.tasks("train", seed=1)] != [t.answer for t in tasks]
    # splits are disjoint; "test" is an alias of eval
    assert not {t.info["text"] for t in tasks} & {t.info["text"] for t in env.tasks("eval")}
    assert env.tasks("test") == env.tasks("eval")

    task = Task(0, [{"role": "user", "content": "abcd"}], answer="dcba")
    reward, metrics = env.rubric.score(task, assistant(" dcba\n"), {})
    assert reward == 1.0 and metrics == {"reverse_similarity": 1.0, "exact_match": 1.0}
    reward, metrics = env.rubric.score(task, assistant("dcbx"), {})
    assert reward == pytest.approx(0.75) and metrics["exact_match"] == 0.0
    assert env.rubric.score(task, assistant("abcd"), {})[0] == 0.0

    traj = run(env, tasks[0], lambda m: m[-1]["content"][::-1])
    assert traj.reward == 1.0 and len(traj.turns) == 1 and traj.completion == assistant(tasks[0].answer)


def test_reverse_text_args():
    env = load_environment(
        "reverse-text", difficulty="hard", num_examples=5, num_eval_examples=0, num_val_examples=0
    )
    assert all(2 <= len(t.info["text"].split()) <= 5 for t in env.tasks())
    with pytest.raises(ValueError, match="min_len"):
        load_environment("reverse-text", min_len=5, max_len=2)
    with pytest.raises(ValueError, match="difficulty"):
        load_environment("reverse-text", difficulty="insane")
    with pytest.raises(ValueError, match="distinct tasks"):
        load_environment("reverse-text", min_len=1, max_len=1, num_examples=100).tasks()


# --- alphabet-sort (multi-turn) ----------------------------------------------------------------


def test_alphabet_sort_multi_turn():
    env = load_environment(
        "primeintellect/alphabet-sort",
        min_turns=3,
        max_turns=3,
        num_examples=20,
        num_eval_examples=0,
        num_val_examples=0,
    )
    task = env.tasks()[0]
    expected = task.info["expected"]
    assert len(expected) == 3 and expected[-1] == sorted(expected[-1])
    assert env.max_turns == 3

    perfect = run(env, task, lambda m: "\n".join(expected[sum(x["role"] == "assistant" for x in m)]))
    assert perfect.reward == 1.0 and perfect.metrics["all_turns_exact"] == 1.0
    assert len(perfect.turns) == 3
    assert [m["role"] for m in perfect.completion] == ["assistant", "user", "assistant", "user", "assistant"]

    # right on turn 1 only, nothing after: (1 + 0 + 0) / 3
    wrong = run(env, task, lambda m: "\n".join(expected[0]) if len(m) == 2 else "")
    assert wrong.reward == pytest.approx(1 / 3)

    # turns are stitched into one sequence; env tokens are masked out
    st = stitch_turns(perfect.turns)
    assert st is not None and st.loss_mask.sum() == sum(len(t.completion_token_ids) for t in perfect.turns)
    assert (st.policy_steps[st.loss_mask] == 3).all() and (st.policy_steps[~st.loss_mask] == -1).all()
    assert st.input_ids.tolist()[: st.prompt_len] == perfect.turns[0].prompt_token_ids


def test_alphabet_sort_parsing_is_lenient():
    env = load_environment(
        "alphabet-sort", min_turns=1, max_turns=1, num_examples=1, num_eval_examples=0, num_val_examples=0
    )
    task = Task(0, [], info={"expected": [["Ada", "Bea", "Zoe"]]})
    assert env.rubric.score(task, assistant("1. Ada\n2. Bea\n- Zoe"), {})[0] == 1.0
    assert env.rubric.score(task, assistant("Ada, Bea, Zoe"), {})[0] == 1.0
    assert env.rubric.score(task, assistant("Zoe\nBea\nAda"), {})[0] == pytest.approx(1 / 3)


def test_stitch_returns_none_when_history_is_re_rendered():
    t1 = Turn("a", [1, 2], [3], [-1.0], [0])
    t2 = Turn("b", [1, 9, 3, 4], [5], [-1.0], [1])
    assert stitch_turns([t1, t2]) is None


# --- arithmetic ----------------------------------------------------------------------------------


def test_arithmetic_rewards():
    env = load_environment(
        "arithmetic", num_examples=30, num_eval_examples=5, num_val_examples=0, format_weight=0.1
    )
    assert type(env).__name__ == "ArithmeticEnv"
    task = env.tasks()[0]
    assert task.answer.lstrip("-").isdigit()
    good = env.rubric.score(task, assistant(f"Let me see.\n#### {task.answer}"), {})
    assert good == (pytest.approx(1.1), {"correct_answer": 1.0, "uses_hash_format": 1.0})
    assert env.rubric.score(task, assistant(f"it is \\boxed{{{task.answer}}}"), {})[0] == 1.0
    assert env.rubric.score(task, assistant(f"#### {int(task.answer) + 1}"), {})[0] == pytest.approx(0.1)
    assert env.rubric.score(task, assistant("I don't know"), {})[0] == 0.0


# --- calculator (tools) --------------------------------------------------------------------------


def test_safe_eval():
    assert safe_eval("2 * (3 + 4) - 1") == 13
    assert calculate("7 / 2") == "3.5" and calculate("6 / 2") == "3" and calculate("2^10") == "1024"
    for bad in ("__import__('os')", "9**9**9", "1/0", "a + 1", "[1]", "2 ** 100", "x" * 300):
        with pytest.raises(ValueError):
            safe_eval(bad)


def test_parse_tool_calls_structured_and_text():
    structured = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'},
            }
        ],
    }
    assert parse_tool_calls(structured) == [
        {"id": "c1", "name": "calculate", "arguments": {"expression": "1+1"}}
    ]
    text = {
        "role": "assistant",
        "content": 'ok <tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>',
    }
    assert parse_tool_calls(text, 2) == [
        {"id": "call_2_0", "name": "calculate", "arguments": {"expression": "2*3"}}
    ]
    assert parse_tool_calls({"role": "assistant", "content": "#### 5"}) == []


def test_calculator_tool_rollout():
    env = load_environment("calculator", num_examples=10, num_eval_examples=0, num_val_examples=0)
    task = env.tasks()[0]
    expr = task.info["expression"]
    assert env.tools[0]["function"]["name"] == "calculate"
    assert env.tools[0]["function"]["parameters"]["required"] == ["expression"]

    def agent(messages):
        if messages[-1]["role"] == "tool":
            return f"#### {messages[-1]['content']}"
        return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expr}"}}}}</tool_call>'

    traj = run(env, task, agent)
    assert traj.reward == 1.0
    assert traj.metrics["num_tool_calls"] == 1.0 and traj.metrics["tool_errors"] == 0.0
    tool_msg = traj.completion[1]
    assert (
        tool_msg["role"] == "tool"
        and tool_msg["content"] == task.answer
        and tool_msg["tool_call_id"] == "call_0_0"
    )

    # a broken call gets an error message back, never an exception; wrong answer scores 0
    bad = run(
        env,
        task,
        lambda m: (
            "#### 0"
            if m[-1]["role"] == "tool"
            else '<tool_call>{"name": "calculate", "arguments": {"expression": "os.system(1)"}}</tool_call>'
        ),
    )
    assert bad.completion[1]["content"].startswith("Error") and bad.metrics["tool_errors"] == 1.0
    assert bad.reward == (1.0 if task.answer == "0" else 0.0)

    # never answering: stops at max_turns, reward 0
    loop = run(
        env, task, lambda m: '<tool_call>{"name": "calculate", "arguments": {"expression": "1"}}</tool_call>'
    )
    assert len(loop.turns) == env.max_turns and loop.reward == 0.0


# --- registry ------------------------------------------------------------------------------------


def test_registry_ids_and_errors():
    assert resolve_factory("reverse-text") is resolve_factory("primeintellect/reverse_text")
    assert resolve_factory("hpcrl/arithmetic") is resolve_factory("arithmetic")
    assert resolve_factory("hpcrl.envs.builtin.calculator:load_environment") is resolve_factory("calculator")
    assert resolve_factory("hpcrl.envs.builtin.arithmetic") is resolve_factory(
        "arithmetic"
    )  # a module with load_environment
    with pytest.raises(ValueError, match=r"unknown environment 'nope-env'.*reverse-text") as e:
        load_environment("nope-env")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"unknown argument 'min_length'; accepted: min_len, max_len"):
        load_environment("reverse-text", min_length=3)
    with pytest.raises(ValueError, match="no callable 'nope'"):
        resolve_factory("hpcrl.envs.builtin.calculator:nope")
    with pytest.raises(ValueError, match="'someone/reverse-text' is not installed"):
        resolve_factory("someone/reverse-text")  # another owner's env is not our built-in


def test_validate_env_spec_is_cheap_and_checks_values():
    validate_env_spec("alphabet-sort", {"min_turns": 2, "max_turns": 4})
    validate_env_spec("arithmetic", {"split": "train"})
    with pytest.raises(ValueError, match="min_turns"):
        validate_env_spec("alphabet-sort", {"min_turns": 5, "max_turns": 4})
    with pytest.raises(ValueError, match="split 'bogus'"):
        validate_env_spec("arithmetic", {"split": "bogus"})


def test_owner_name_loads_the_installed_package(tmp_path, monkeypatch):
    """`owner/my-env` imports module my_env (as `prime env install` installs it), before any alias."""
    pkg = tmp_path / "site"
    (pkg / "reverse_text").mkdir(parents=True)
    (pkg / "reverse_text" / "__init__.py").write_text(
        "from hpcrl.envs.builtin.arithmetic import load_environment as _a\n"
        "def load_environment(**kw):\n    return _a(**kw)\n"
    )
    (pkg / "judge_env.py").write_text("def load_environment(api_key: str = ''):\n    return api_key\n")
    monkeypatch.syspath_prepend(str(pkg))
    import reverse_text

    from hpcrl.envs.registry import alias_note

    # teardown forgets these modules again (otherwise later tests would find the fake package)
    monkeypatch.setitem(sys.modules, "reverse_text", reverse_text)
    monkeypatch.setitem(sys.modules, "judge_env", None)
    del sys.modules["judge_env"]

    assert resolve_factory("primeintellect/reverse-text") is reverse_text.load_environment
    assert alias_note("primeintellect/reverse-text") is None  # installed: no alias
    assert resolve_factory("reverse-text") is not reverse_text.load_environment  # built-in by its own name
    assert resolve_factory("someone/judge-env")(api_key="k") == "k"


def test_aliases_are_named_and_unknown_hub_ids_fail():
    from hpcrl.envs.registry import alias_note

    note = alias_note("primeintellect/alphabet-sort")
    assert note is not None and "alias" in note and "built-in 'alphabet-sort'" in note
    assert alias_note("alphabet-sort") is None and alias_note("hpcrl/alphabet-sort") is None
    for env_id in ("primeintellect/gsm8k", "primeintellect/math-env", "gsm8k"):
        with pytest.raises(ValueError) as e:
            resolve_factory(env_id)
        assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"'primeintellect/gsm8k' is not installed \(no module 'gsm8k'.*"
        r"prime env install primeintellect/gsm8k",
    ):
        resolve_factory("primeintellect/gsm8k")


def test_env_args_reference_environment_variables(monkeypatch):
    """`${env:NAME}` in args is resolved where the env is built; a missing variable names both."""
    from hpcrl.envs.builtin import reverse_text

    seen = {}

    def factory(api_key: str, prompt: str = ""):
        seen.update(api_key=api_key, prompt=prompt)
        return reverse_text.load_environment()

    monkeypatch.setattr("hpcrl.envs.registry.resolve_factory", lambda env_id: factory)
    monkeypatch.setenv("HPCRL_TEST_KEY", "sk-real-value")
    load_environment("judge", api_key="${env:HPCRL_TEST_KEY}", prompt="key ${env:HPCRL_TEST_KEY}!")
    assert seen == {"api_key": "sk-real-value", "prompt": "key sk-real-value!"}
    monkeypatch.delenv("HPCRL_TEST_KEY")
    with pytest.raises(
        ValueError, match=r"args.api_key: references \$\{env:HPCRL_TEST_KEY\} but HPCRL_TEST_KEY is not set"
    ):
        load_environment("judge", api_key="${env:HPCRL_TEST_KEY}")
