"""The message role of each env-provided token of a later turn (for `[orchestrator.algo] type = "echo"`).

A later turn's prompt extends the previous prompt and completion with tokens the env provided: the
tail of the assistant turn the model did not sample, the env's messages (tool results, user
feedback) and the next generation prompt. `Turn.env_roles` gives one code per such token (aligned
with the END of the turn's prompt ids): the ROLES code of the message whose BODY the token renders
(`content`), 0 for template scaffold (role tags, separators, tool-response wraps, the generation
prompt). Like prime-rl's renderer attribution (`RenderedTokens.is_content`), only body tokens carry
a role; a message whose body cannot be located gets the role on its whole span where the renderer
gives one (prime-rl's fallback for unattributed nodes), else no role at all.

Two sources, one per rollout client:
- the chat-template path (hpcrl.orchestrator.chat.RolloutClient): each new message's content is
  found, in order, in the template's text after the sampled tokens; tokens map to characters
  through the tokenizer's offsets;
- the renderer path (hpcrl.orchestrator.renderer_client): the bridge's own `message_indices` and
  `is_content`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcrl.envs.base import Message

ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}  # code 0: no role (scaffold, sampled, prompt)
# Codes travel as bytes (one per token): a piece of a long multi-turn rollout costs one byte a token.


def _bodies(msg: Message) -> list[str]:
    """The text parts of a message's content, in order."""
    content = msg.get("content")
    if isinstance(content, str):
        return [content] if content else []
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]
        ]
    return []


def char_roles(text: str, start: int, new_messages: Sequence[Message]) -> list[int]:
    """One code per character of ``text``: each new message's body, searched in order from
    ``start`` (what precedes it is the unsampled assistant tail), gets its role's code; the rest 0.
    A body the template changed (e.g. stripped) is searched stripped; one not found stays 0."""
    codes = [0] * len(text)
    cursor = start
    for msg in new_messages:
        code = ROLES.get(str(msg.get("role")), 0)
        for body in _bodies(msg):
            at = text.find(body, cursor)
            if at < 0 and body.strip():
                body = body.strip()
                at = text.find(body, cursor)
            if at < 0:
                continue
            codes[at : at + len(body)] = [code] * len(body)
            cursor = at + len(body)
    return codes


def template_env_ids(
    tokenizer: Any, text: str, tail_len: int, new_messages: Sequence[Message]
) -> tuple[list[int], bytes | None]:
    """(token ids of ``text``, their role codes) — the ids are exactly ``encode(tokenizer, text)``;
    the codes are None when the tokenizer gives no character offsets (a slow tokenizer). A token takes
    the code of its first character."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None
    ids = list(enc["input_ids"])
    offsets = enc.get("offset_mapping")
    if offsets is None or len(offsets) != len(ids):
        return ids, None
    chars = char_roles(text, tail_len, new_messages)
    return ids, bytes(chars[s] if e > s and s < len(chars) else 0 for s, e in offsets)


def bridge_env_roles(bridged: Any, prior_len: int, new_messages: Sequence[Message]) -> bytes | None:
    """Role codes of ``bridged.token_ids[prior_len:]`` (a renderer's bridge_to_next_turn result,
    ``prior_len`` = previous prompt + completion): ``message_indices`` name the new message of each
    token (-1: scaffold), ``is_content`` (when given) keeps only body tokens. None without indices."""
    ids = list(bridged.token_ids)
    idx = list(getattr(bridged, "message_indices", None) or [])
    if len(idx) != len(ids) or prior_len > len(ids):
        return None
    content = list(getattr(bridged, "is_content", None) or [])
    attributed = len(content) == len(ids)
    out = []
    for k in range(prior_len, len(ids)):
        i = idx[k]
        code = ROLES.get(str(new_messages[i].get("role")), 0) if 0 <= i < len(new_messages) else 0
        out.append(code if not attributed or content[k] else 0)
    return bytes(out)


def piece_env_roles(turns: Sequence[Any]) -> bytes | None:
    """Role codes over one stitched piece of ``turns`` (hpcrl.envs.base.stitch_turns' layout: each
    turn's prompt extends the previous prompt + completion): the first turn's prompt (the initial
    prompt, excluded by echo) and every sampled token are 0; each later turn's env part takes that
    turn's ``env_roles``, right-aligned (a missing one leaves its part 0). None when no token has a
    role (single-turn rollouts: every run pays nothing for echo)."""
    if not any(any(t.env_roles or b"") for t in turns[1:]):
        return None
    out = bytearray(len(turns[0].prompt_token_ids) + len(turns[0].completion_token_ids))
    for t in turns[1:]:
        n = len(t.prompt_token_ids) - len(out)
        roles = bytes(t.env_roles or b"")[-n:] if n > 0 else b""
        out += bytes(n - len(roles)) + roles
        out += bytes(len(t.completion_token_ids))
    return bytes(out)


def branch_env_roles(turn: Any) -> bytes | None:
    """Role codes over a branch sample of one turn (trajectory_strategy = "branching": the turn's
    prompt, then its completion): its own env part (what the env said since the previous turn) takes
    the turn's ``env_roles``, right-aligned at the end of its prompt; the rest is 0. The earlier env
    parts of its prompt were weighed in the earlier turns' samples: as prime-rl trains a node its
    branches share once, in the first branch holding it (trajectories._loss_weights), every env message
    is weighed once per rollout, as in the stitched piece. None when no token has a role (a first turn,
    a re-rendered one: its whole prompt is initial prompt)."""
    n = len(turn.prompt_token_ids)
    roles = bytes(turn.env_roles or b"")[-n:] if n > 0 else b""
    if not any(roles):
        return None
    return bytes(n - len(roles)) + roles + bytes(len(turn.completion_token_ids))
