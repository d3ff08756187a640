"""prime-rl's `sampling.extra_body`: free request fields sent with every model turn, none that the
orchestrator sets itself; its chat_template_kwargs' thinking switches become the sampling fields."""

from __future__ import annotations

import pytest

from hpcrl.config.prime_names import check_thinking
from hpcrl.config.sections.orchestrator import SamplingConfig
from hpcrl.errors import ConfigError
from hpcrl.orchestrator.chat import openai_sampling

P = "orchestrator.train.sampling"


def test_free_fields_and_template_kwargs_go_with_every_request() -> None:
    s = SamplingConfig(
        max_tokens=7,
        extra_body={
            "chat_template_kwargs": {"clear_thinking": False, "enable_thinking": False},
            "priority": 3,
        },
    )
    check_thinking(s, P)
    assert s.enable_thinking is False  # one home for the switch
    assert s.extra_body == {"chat_template_kwargs": {"clear_thinking": False}, "priority": 3}
    assert openai_sampling(s) == {
        "priority": 3,
        "max_tokens": 7,
        "temperature": 1.0,
        "chat_template_kwargs": {"clear_thinking": False, "enable_thinking": False},
    }


def test_no_extra_body_sends_what_it_sent_before() -> None:
    assert openai_sampling(SamplingConfig()) == {"max_tokens": 128, "temperature": 1.0}


@pytest.mark.parametrize(
    ("extra", "own", "field", "says"),
    [
        ({"temperature": 0.5}, {}, f"{P}.extra_body.temperature", f"set {P}.temperature"),
        (
            {"max_completion_tokens": 9},
            {},
            f"{P}.extra_body.max_completion_tokens",
            "sets it for each request",
        ),
        ({"n": 2}, {}, f"{P}.extra_body.n", "sets it for each request"),
        ({"logprobs": False}, {}, f"{P}.extra_body.logprobs", "sets it for each request"),
        ({"chat_template_kwargs": 3}, {}, f"{P}.extra_body.chat_template_kwargs", "expected a table"),
        (
            {"chat_template_kwargs": {"enable_thinking": "no"}},
            {},
            f"{P}.extra_body.chat_template_kwargs.enable_thinking",
            "must be one of True, False",
        ),
        (
            {"chat_template_kwargs": {"reasoning_effort": "max"}},
            {},
            f"{P}.extra_body.chat_template_kwargs.reasoning_effort",
            "must be one of 'low', 'medium', 'high'",
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"enable_thinking": True},
            f"{P}.extra_body.chat_template_kwargs.enable_thinking",
            f"differs from {P}.enable_thinking = True",
        ),
        (  # moved onto the field, then the two switches exclude each other as always
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning_effort": "low"},
            f"{P}.reasoning_effort",
            "excludes enable_thinking",
        ),
    ],
)
def test_refused_in_one_line_naming_the_key(extra: dict, own: dict, field: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_thinking(SamplingConfig(extra_body=extra, **own), P)
    line = str(e.value)
    assert line.startswith(field + ":") and says in line and "\n" not in line
