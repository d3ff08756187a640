"""The embedded engine's tokenizer, shared between request threads, with its caches.

HF fast tokenizers are not safe to share between threads, so every call holds one lock. Two caches
make the hot paths cheap: RL asks for the same chat prompt once per rollout of a group (rendering the
jinja template and tokenizing again each time is pure overhead), and logprob answers name every
sampled token (its text and raw bytes).
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from hpcrl.inference.errors import InvalidRequest

CHAT_CACHE_SIZE = 4096  # distinct prompts remembered; cleared when full (RL prompts repeat within a step)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-char table used by byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Tokens:
    """Thread-safe encode / decode / per-token text of one tokenizer, memoised where it pays."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._token_cache: dict[int, tuple[str, list[int]]] = {}
        self._chat_cache: dict[bytes, tuple[int, ...]] = {}

    @staticmethod
    def chat_key(*args: Any) -> bytes | None:
        """Cache key of an encode_chat call (None when the arguments are not plain JSON)."""
        try:
            return msgspec.json.encode(args)
        except (TypeError, msgspec.EncodeError):
            return None

    def cached_chat(self, key: bytes | None) -> list[int] | None:
        hit = self._chat_cache.get(key) if key is not None else None
        return list(hit) if hit is not None else None

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        key = self.chat_key(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        ids = self.cached_chat(key)
        if ids is None:
            ids = self._encode_chat(
                messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
            if key is not None:
                if len(self._chat_cache) >= CHAT_CACHE_SIZE:
                    self._chat_cache.clear()
                self._chat_cache[key] = tuple(ids)
        return ids

    def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict | None,
    ) -> list[int]:
        with self._lock:
            text = self.chat_text(
                messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict | None,
    ) -> str:
        """The chat template's text of `messages` (the caller holds `_lock`): a template that fails is
        the request's error, naming `messages`."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, bad message shapes
            raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from e

    def encode_text(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_info(self, tid: int) -> tuple[str, list[int]]:
        """(text, raw bytes) of one token; raw bytes come from the byte-level alphabet when possible."""
        hit = self._token_cache.get(tid)
        if hit is None:
            with self._lock:
                piece = self.tokenizer.convert_ids_to_tokens(tid)
                text = self.tokenizer.decode([tid], skip_special_tokens=False)
            if (
                isinstance(piece, str)
                and piece
                and all(c in self._byte_of for c in piece)
                and piece not in self.tokenizer.all_special_tokens
            ):
                raw = [self._byte_of[c] for c in piece]
            else:
                raw = list(text.encode())
            hit = self._token_cache[tid] = (text, raw)
        return hit
