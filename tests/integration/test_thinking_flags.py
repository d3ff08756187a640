"""enable_thinking / reasoning_effort reach the chat template on every turn: multi-turn rollouts
against a real server (turn 1 rendered by the server, later turns stitched by the orchestrator),
eval sampling, and SFT rendering."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from hpcrl.models.tiny import CHAT_TEMPLATE
from tests.conftest import InferenceServer

MARK = "<think></think>"
# Qwen3-style switch: with enable_thinking = false every assistant turn opens with an empty think block
# (also when the template renders the generation prompt); reasoning_effort is written into the system turn.
_SWITCH = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '" + MARK + "' }}{%- endif %}"
THINKING_TEMPLATE = (
    "{%- if house_style is defined %}{{- '<|im_start|>system\\nstyle=' + house_style + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\neffort=' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    + CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n' }}" + _SWITCH
    )
)


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("thinking_model")
    shutil.copytree(tiny_model_dir, d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(thinking_model: Path, tmp_path_factory: pytest.TempPathFactory):
    s = InferenceServer(thinking_model, tmp_path_factory.mktemp("run"))
    yield s
    s.stop()


@pytest.mark.timeout(240)
def test_every_turn_of_a_multi_turn_rollout_is_rendered_with_the_switches(
    thinking_model: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcrl.config.schema import SamplingConfig
    from hpcrl.orchestrator.rollout import openai_sampling

    sampling = openai_sampling(SamplingConfig(max_tokens=6, enable_thinking=False, reasoning_effort="low"))
    assert sampling["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "low"}
    for text in _three_turn_texts(thinking_model, server, monkeypatch, sampling):
        # one empty think block per assistant turn: the server's turn 1 and the orchestrator's turns 2, 3
        assert text.count(MARK) == 3, text
        assert text.startswith("<|im_start|>system\neffort=low")


@pytest.mark.timeout(240)
def test_extra_body_template_kwargs_reach_every_turn(
    thinking_model: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prime-rl's `[orchestrator.train.sampling.extra_body.chat_template_kwargs]` (GLM's clear_thinking,
    any template's own switch): the server's turn and the orchestrator's stitched turns alike."""
    from hpcrl.launch.checks import load
    from hpcrl.orchestrator.rollout import openai_sampling

    cfg = load(
        [
            "--model.name", "hpcrl/tiny-qwen3",
            "--orchestrator.train.env", '[{id = "reverse-text"}]',
            "--orchestrator.train.sampling.max-tokens", "6",
            "--orchestrator.train.sampling.extra-body",
            '{chat_template_kwargs = {house_style = "terse", enable_thinking = false}}',
        ]
    ).config  # fmt: skip
    s = cfg.orchestrator.train.sampling
    assert s.enable_thinking is False and s.extra_body == {"chat_template_kwargs": {"house_style": "terse"}}
    sampling = openai_sampling(s)
    assert sampling["chat_template_kwargs"] == {"house_style": "terse", "enable_thinking": False}
    for text in _three_turn_texts(thinking_model, server, monkeypatch, sampling):
        assert text.count(MARK) == 3 and text.startswith("<|im_start|>system\nstyle=terse"), text


def _three_turn_texts(thinking_model: Path, server: InferenceServer, monkeypatch, sampling) -> list[str]:
    """Three-turn alphabet-sort rollouts sampled with `sampling`: each rollout's whole text."""
    from transformers import AutoTokenizer

    from hpcrl.envs import load_environment
    from hpcrl.orchestrator.rollout import Generator, RolloutClient, ServerPool

    chat = RolloutClient.chat

    async def finished_chat(self, *a, **kw):  # the untrained model never stops: let the env answer
        turn = await chat(self, *a, **kw)
        turn.finish_reason = "stop"
        return turn

    monkeypatch.setattr(RolloutClient, "chat", finished_chat)
    tok = AutoTokenizer.from_pretrained(thinking_model)
    env = load_environment("alphabet-sort", min_turns=3, max_turns=3)

    async def go():
        pool = ServerPool([server.base_url], model=str(thinking_model), timeout=60, max_concurrent=8)
        try:
            return await Generator(pool, tok, 2048, lambda: 0, seed=1).groups(
                env, list(env.tasks("train")[:2]), 2, sampling, "t"
            )
        finally:
            await pool.aclose()

    records = [r for g in asyncio.run(go()) for r in g]
    assert records and all(not r.errored for r in records)
    texts = []
    for r in records:
        assert r.num_turns == 3 and len(r.pieces) == 1, "turns stitched exactly with the same template"
        texts.append(tok.decode(r.pieces[0].input_ids, skip_special_tokens=False))
    return texts


def test_eval_keeps_the_train_switches_unless_it_sets_its_own() -> None:
    from hpcrl.launch.checks import load

    base = [
        "--model.name",
        "hpcrl/tiny-qwen3",
        "--orchestrator.train.env",
        '[{id = "reverse-text"}]',
        "--orchestrator.eval.sampling.temperature",
        "0",
    ]
    from hpcrl.orchestrator.setup import eval_sampling_of

    # enable_thinking and reasoning_effort exclude each other (seed docs): one switch at a time
    thinking = [*base, "--orchestrator.train.sampling.enable-thinking", "false"]
    s = eval_sampling_of(load(thinking).config.orchestrator)
    assert (s.temperature, s.enable_thinking, s.reasoning_effort) == (0, False, None)
    effort = [*base, "--orchestrator.train.sampling.reasoning-effort", "high"]
    s = eval_sampling_of(load(effort).config.orchestrator)
    assert (s.temperature, s.enable_thinking, s.reasoning_effort) == (0, None, "high")
    cfg = load([*thinking, "--orchestrator.eval.sampling.enable-thinking", "true"]).config
    assert eval_sampling_of(cfg.orchestrator).enable_thinking is True


def test_sft_renders_every_turn_with_the_configured_switches(thinking_model: Path) -> None:
    from transformers import AutoTokenizer

    from hpcrl.trainer import sft_data as sd

    tok = AutoTokenizer.from_pretrained(thinking_model)
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    mask = {"system": False, "user": False, "assistant": True, "tool": False}
    conv = sd.row_to_conversation(row, "row", {"enable_thinking": False})
    sample = sd.tokenize_conversation(tok, conv, mask)
    assert tok.decode(sample.input_ids.tolist()).count(MARK) == 2
    # a row's own kwargs win over the config's
    own = sd.row_to_conversation(
        {**row, "chat_template_kwargs": {"enable_thinking": True}}, "row", {"enable_thinking": False}
    )
    assert tok.decode(sd.tokenize_conversation(tok, own, mask).input_ids.tolist()).count(MARK) == 0
