"""SFT loss masks from the qwen3 renderer on a think-stripping template, against a hand-checked mask."""

from __future__ import annotations

import pytest

pytest.importorskip("renderers")

from hpcrl.trainer import sft_data as sd  # noqa: E402

CONVERSATION = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
]
# The conversation as Qwen3's template renders it, cut where the mask changes, with the hand-checked
# flag of each piece: the first turn's reasoning is gone (a later user query follows), the role headers
# and the "\n" after each <|im_end|> are the template's, the bodies and their <|im_end|> the model's.
HAND_CHECKED = [
    ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
    ("4<|im_end|>", True),
    ("\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n", False),
    ("<think>\nadd again\n</think>\n\n6<|im_end|>", True),
    ("\n", False),
]
ROLES = {"system": False, "user": False, "assistant": True, "tool": False}


@pytest.fixture(scope="module")
def tok():
    from hpcrl.models.tiny import build_tokenizer

    return build_tokenizer("qwen3")


def _renderer(tok):
    from renderers import Qwen3RendererConfig, create_renderer

    return create_renderer(tok, Qwen3RendererConfig())


def test_qwen3_mask_equals_the_hand_checked_mask(tok) -> None:
    from hpcrl.trainer.sft_render import tokenize_with_renderer

    sample = tokenize_with_renderer(_renderer(tok), sd.Conversation(CONVERSATION), ROLES)
    ids, mask = [], []
    for text, train in HAND_CHECKED:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [train] * len(piece)
    assert sample.input_ids.tolist() == ids
    assert sample.loss_mask.tolist() == mask
    trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "4<|im_end|><think>\nadd again\n</think>\n\n6<|im_end|>"


def test_prompt_messages_and_roles_stay_untrained(tok) -> None:
    from hpcrl.trainer.sft_render import tokenize_with_renderer

    conv = sd.Conversation(CONVERSATION, num_prompt_messages=2)  # a prompt/completion row
    sample = tokenize_with_renderer(_renderer(tok), conv, ROLES)
    trained = tok.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False
    )
    assert trained == "<think>\nadd again\n</think>\n\n6<|im_end|>"
    none = tokenize_with_renderer(
        _renderer(tok), sd.Conversation(CONVERSATION), {**ROLES, "assistant": False}
    )
    assert not none.loss_mask.any()


def test_the_incremental_template_path_refuses_what_the_renderer_accepts(tok) -> None:
    with pytest.raises(sd.TemplateError, match="not prefix-stable"):
        sd.tokenize_conversation(tok, sd.Conversation(CONVERSATION), ROLES)
