"""The wire shapes of a choice's `routed_experts` (MoE router replay), read and written in one place.

Servers send a choice's routing in one of three shapes; :func:`completion_rows` reads them all, and
:func:`prompt_rows` the prompt's rows where a shape holds them (the prefill's routes: a prompt token
the trainer routed differently would change every later token's hidden state):

* a nested list ``[tokens][layers][k]`` of the completion (hpcrl's embedded engine, chat route),
  with the prompt's beside it as ``prompt_routed_experts`` (hpcrl's own field);
* vLLM 0.33's base64 ``.npy`` string (``--enable-return-routed-experts``): ``(tokens - 1, layers, k)``
  from prompt position ``routed_experts_prompt_start`` (0 unless asked) to the last sampled token
  but one, which was never fed back;
* the dict renderers' and verifiers 0.4's clients read (``/inference/v1/generate`` of hpcrl's
  engine): ``{"data": base64 of the raw array, "dtype", "shape", "start"}``, rows from sequence
  position ``start``.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from typing import Any

import numpy as np


def encode(rows: np.ndarray, start: int) -> dict[str, Any]:
    """Rows ``[n, layers, k]`` beginning at sequence position ``start`` as the dict shape."""
    arr = np.ascontiguousarray(rows, dtype=np.int16)
    return {
        "data": base64.b64encode(arr.tobytes()).decode("ascii"),
        "dtype": "int16",
        "shape": list(arr.shape),
        "start": int(start),
    }


def _decode(payload: Any, prompt_start: int) -> tuple[np.ndarray, int] | None:
    """(rows [n, layers, k], sequence position of row 0) of any wire shape; None if unreadable."""
    try:
        if isinstance(payload, str):  # vLLM: base64 .npy
            arr = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
            return arr, prompt_start
        if isinstance(payload, dict):
            raw = payload["data"]
            raw = base64.b64decode(bytes(raw) if isinstance(raw, memoryview) else raw)
            arr = np.frombuffer(raw, dtype=np.dtype(payload.get("dtype", "uint8"))).reshape(payload["shape"])
            return arr, int(payload.get("start") or 0)
        if isinstance(payload, list):
            return np.asarray(payload), -1  # completion rows: placed by the caller
    except (KeyError, TypeError, ValueError, EOFError, OSError, binascii.Error):
        return None
    return None


def completion_rows(
    payload: Any, prompt_len: int, n: int, prompt_start: int = 0
) -> list[list[list[int]]] | None:
    """The completion's ``n`` rows ``[n][layers][k]`` (-1 where the server had none, e.g. the last
    token) from a choice's ``routed_experts`` in any shape; None when absent or malformed (the turn is
    then not replayed, never misaligned)."""
    got = _rows3(payload, prompt_start)
    if got is None:
        return None
    arr, start = got
    if start == -1:  # already the completion's rows
        return arr.astype(np.int16).tolist() if arr.shape[0] == n else None
    first = prompt_len - start  # row of the first completion token
    if first < 0:
        return None
    return _placed(n, 0, arr[first : first + n])


def prompt_rows(
    choice: Mapping[str, Any], prompt_len: int, prompt_start: int = 0
) -> list[list[list[int]]] | None:
    """The prompt's ``prompt_len`` rows ``[prompt_len][layers][k]`` (-1 before the first position the
    server reported) from hpcrl's ``prompt_routed_experts`` list or a ``routed_experts`` shape that
    starts inside the prompt; None when absent or malformed (prompt tokens then route freely)."""
    listed = choice.get("prompt_routed_experts")
    if listed is not None:
        arr = np.asarray(listed)
        return arr.astype(np.int16).tolist() if arr.ndim == 3 and arr.shape[0] == prompt_len else None
    got = _rows3(choice.get("routed_experts"), prompt_start)
    if got is None:
        return None
    arr, start = got
    if not 0 <= start < prompt_len:  # a completion-only list, or rows after the prompt
        return None
    return _placed(prompt_len, start, arr[: prompt_len - start])


def _rows3(payload: Any, prompt_start: int) -> tuple[np.ndarray, int] | None:
    """(rows [N, layers, k], the position of row 0) of a ``routed_experts`` payload in any shape; None
    when absent, malformed or not three-dimensional."""
    got = None if payload is None else _decode(payload, prompt_start)
    return got if got is not None and got[0].ndim == 3 else None


def _placed(n: int, at: int, have: np.ndarray) -> list[list[list[int]]]:
    """``n`` rows of -1 with ``have`` written from row ``at`` on."""
    rows = np.full((n, have.shape[1], have.shape[2]), -1, np.int16)
    rows[at : at + have.shape[0]] = have.astype(np.int16)
    return rows.tolist()
