"""Causes of errored rollouts: one line each, grouped with numbers masked, a systematic one ends the
run naming env, cause and fix; occasional ones are only counted."""

from __future__ import annotations

import logging

import pytest

from hpcrl.launch.stallview import read_causes
from hpcrl.orchestrator.causes import Causes, SystematicFailure, cause_key, cause_of

TOOLS = "InterceptionError: DefaultRenderer does not support tools"


def test_cause_is_one_line_and_never_empty() -> None:
    assert cause_of("ReadError: ") == "ReadError (no message)"
    assert cause_of("") == "unknown error (no message)"
    assert cause_of("ValueError: bad\ntraceback...") == "ValueError: bad"
    assert cause_key("RequestFailed: http://127.0.0.1:4711 failed") == cause_key(
        "RequestFailed: http://127.0.0.1:5123 failed"
    )


def test_first_occurrence_warns_once_with_count_and_fix(caplog: pytest.LogCaptureFixture) -> None:
    c = Causes(window=0)
    with caplog.at_level(logging.WARNING, "hpcrl.orchestrator"):
        for _ in range(12):
            c.observe("tool-env", [TOOLS, None])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the first, and the 10th
    assert "env tool-env: rollout errored: " + TOOLS in lines[0] and "first occurrence; 1 so far" in lines[0]
    assert 'orchestrator.renderer.name = "qwen3"' in lines[0]
    assert "10 so far" in lines[1]
    assert c.metrics() == {f"errors/tool-env/{cause_key(TOOLS)}": 12.0}
    c.check()  # window 0: never ends the run


def test_systematic_failure_names_env_cause_and_fix(tmp_path) -> None:
    c = Causes(window=8)
    c.observe("tool-env", [TOOLS] * 7)
    c.check()  # not yet a full window
    c.observe("tool-env", [TOOLS])
    with pytest.raises(SystematicFailure) as e:
        c.check()
    msg = str(e.value)
    assert msg.startswith(
        "env tool-env: every rollout fails (8 errored, none succeeded since the run started)"
    )
    assert TOOLS in msg and 'orchestrator.renderer.name = "qwen3"' in msg
    c.write(tmp_path / "causes.json")
    assert read_causes(tmp_path / "causes.json") == [("tool-env", TOOLS, 8)]


def test_occasional_errors_are_tolerated() -> None:
    c = Causes(window=8)
    for _ in range(20):
        c.observe("env", ["ValueError: flaky", "ValueError: flaky", None])
        c.check()
    c.observe("env", ["KeyError: a", "ValueError: flaky"] * 8)  # two causes: not one systematic one
    c.check()
    c.observe("env", ["ValueError: flaky"] * 8)  # after successes: 8 in a row still end it
    with pytest.raises(SystematicFailure, match="in its last 8 rollouts"):
        c.check()


def test_tools_under_a_renderer_without_them_are_refused_at_start_up() -> None:
    from types import SimpleNamespace

    from hpcrl.errors import ConfigError
    from hpcrl.orchestrator.causes import check_tools

    tool_env = SimpleNamespace(tools=[{"type": "function", "function": {"name": "add"}}])
    plain_env = SimpleNamespace(tools=None)
    no_tools = SimpleNamespace(get=lambda kw: SimpleNamespace(supports_tools=False))
    with_tools = SimpleNamespace(get=lambda kw: SimpleNamespace(supports_tools=True))
    check_tools({"calc": tool_env, "plain": plain_env}, with_tools, None)
    check_tools({"plain": plain_env}, no_tools, None)
    with pytest.raises(ConfigError, match=r'env calc declares 1 tool\(s\) .*renderer.name = "qwen3"'):
        check_tools({"calc": tool_env}, no_tools, None)
    template = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match="the tokenizer's chat template cannot render tools"):
        check_tools({"calc": tool_env}, None, template)
    check_tools({"calc": tool_env}, None, SimpleNamespace(chat_template="{% if tools %}...{% endif %}"))


def test_one_lost_worker_erroring_all_it_held_is_one_event_but_a_worker_dying_on_every_rollout_ends_it() -> (
    None
):
    """Window 8. A restart errors 20 rollouts in flight with one message (the lost pid): counted 20
    times, one window entry, and the next 7 successes fill the rest: no end. Eight different lost
    pids in a row (a worker that dies on every rollout): eight entries of one masked cause: the end."""
    lost = "EnvComponentLost: env worker 0 (pid {}) died: killed by signal 9"
    c = Causes(window=8)
    c.observe("e", [None])
    c.observe("e", [lost.format(4242)] * 20)
    assert c.metrics() == {f"errors/e/{cause_key(lost.format(1))}": 20.0}
    assert len(c.envs["e"].recent) == 2  # the success and the one event
    c.check()
    c.observe("e", [None] * 7)
    c.check()
    c.observe("e", [lost.format(100 + i) for i in range(7)])
    c.check()  # a success is still in the window: 1 + 7 events
    c.observe("e", [lost.format(200)])
    with pytest.raises(
        SystematicFailure, match=r"env e: every rollout fails \(28 errored, none succeeded in its last 8"
    ):
        c.check()
