"""The Qwen3-template tiny model: Qwen3's added tokens and chat template, built locally, token for token
what the `renderers` package's real `qwen3` renderer produces (so that renderer is tested offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("renderers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
THINK_TOOL = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "sum 1 2"},
    {
        "role": "assistant",
        "content": "<think>\nuse the tool\n</think>\n\n",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    },
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "<think>\ngot it\n</think>\n\nthe sum is 3"},
    {"role": "user", "content": "thanks"},
]
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    THINK_TOOL,
    THINK_TOOL[:5],  # the last assistant turn after the last query keeps its think block
]


@pytest.fixture(scope="module")
def tok():
    from hpcrl.models.tiny import build_tokenizer

    return build_tokenizer("qwen3")


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("agp", [True, False])
def test_template_equals_the_qwen3_renderer(tok, conv, tools, agp) -> None:
    from renderers import Qwen3RendererConfig, create_renderer

    messages = CONVERSATIONS[conv]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False)
    renderer = create_renderer(tok, Qwen3RendererConfig())
    assert tok.encode(text, add_special_tokens=False) == renderer.render_ids(
        messages, tools=tools, add_generation_prompt=agp
    )


def test_added_tokens_are_single_ids_kept_by_decode(tok) -> None:
    ids = tok.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>"])
    assert len(set(ids)) == 5 and all(i >= 400 for i in ids)
    assert tok.encode("<think>\nx</think>", add_special_tokens=False)[0] == ids[0]
    assert (
        tok.decode(ids, skip_special_tokens=True) == "<think></think><tool_call></tool_call><tool_response>"
    )


def test_earlier_think_blocks_are_stripped(tok) -> None:
    """What makes re-rendering break: the first turn's reasoning is gone once a new user query comes."""
    first = tok.apply_chat_template(CONVERSATIONS[1][:2], tokenize=False)
    later = tok.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert "add them" in first and "add them" not in later
    assert not later.startswith(first)


def test_cli_builds_the_qwen3_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hpcrl.models.tiny import main

    assert main([str(tmp_path / "m"), "--template", "qwen3"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert (
        tok.convert_tokens_to_ids("<tool_response>")
        < json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"]
    )
    assert "last_query_index" in tok.chat_template
    assert json.loads((tmp_path / "m" / "hpcrl_tiny.json").read_text())["template"] == "qwen3"
