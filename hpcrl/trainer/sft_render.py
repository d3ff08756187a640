"""SFT loss masks from the renderer's training-sample builder (`renderers.build_training_sample`).

A typed renderer renders the whole conversation once and says, per token, which message it belongs to
and whether the model would have sampled it (`sampled_mask`: an assistant turn's body and its closing
<|im_end|>, not the `<|im_start|>assistant\\n` header the server writes nor the "\\n" after it). A
token is trained when it is sampled, its message's role is on in [loss_mask], and the message is not
part of a prompt/completion row's prompt. Unlike hpcrl's incremental rendering this accepts templates
that rewrite history: with Qwen3's template an earlier assistant turn is trained as the template
renders it in the final conversation (its <think> block dropped once a later user query follows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def tokenize_with_renderer(renderer: Any, conv: Any, role_mask: Mapping[str, bool]) -> Any:
    """`conv` (hpcrl.trainer.sft_data.Conversation) -> TokenizedSample (input_ids, loss_mask)."""
    from renderers import build_training_sample

    from hpcrl.trainer.sft_data import ROLE_ALIASES, TokenizedSample

    def trained(message: Mapping[str, Any]) -> bool:
        role = message.get("role") or ""
        return bool(role_mask.get(ROLE_ALIASES.get(role, role), False))

    sample = build_training_sample(
        renderer,
        conv.messages,
        tools=conv.tools,
        role_to_mask=trained,
        message_loss_mask=[k >= conv.num_prompt_messages for k in range(len(conv.messages))],
    )
    mask = list(sample.loss_mask)
    if mask:
        mask[0] = False  # nothing predicts a sample's first token
    return TokenizedSample(np.asarray(sample.token_ids, dtype=np.int32), np.asarray(mask, dtype=bool))
