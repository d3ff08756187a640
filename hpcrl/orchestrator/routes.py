"""Router replay on the orchestrator side: the experts the inference server routed each sampled
token to (``routed_experts`` of a completion: [tokens][layers][k]) laid out along a training
sequence, one flat row of layers*k ids per token, -1 on tokens nobody sampled (prompt, environment
turns) and where the server did not know (a turn's last token). Multi-turn rollouts carry them per
turn: a stitched sequence takes each turn's rows at that turn's completion tokens.

A server's wire shapes of a choice's routing are read by :mod:`hpcrl.inference.routed`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcrl.envs.base import Turn


def _rows(turn: Turn) -> np.ndarray | None:
    r = turn.routed_experts
    if r is None:
        return None
    arr = np.asarray(r, dtype=np.int16)
    n = len(turn.completion_token_ids)
    if arr.ndim != 3 or arr.shape[0] != n:
        return None  # a server that answered something else: no replay for this turn
    return arr.reshape(n, -1)


def width(turns: Sequence[Turn]) -> int | None:
    """layers * k of the first turn with routes (None: no turn has any)."""
    for t in turns:
        rows = _rows(t)
        if rows is not None:
            return int(rows.shape[1])
    return None


def turn_routes(turn: Turn, w: int) -> list[list[int]]:
    """One turn as its own sequence (prompt rows -1)."""
    rows = _rows(turn)
    n = len(turn.completion_token_ids)
    comp = rows if rows is not None and rows.shape[1] == w else np.full((n, w), -1, np.int16)
    prompt = np.full((len(turn.prompt_token_ids), w), -1, np.int16)
    return np.concatenate([prompt, comp]).tolist()


def stitched_routes(turns: Sequence[Turn], w: int, total: int) -> list[list[int]]:
    """The rows of a stitched rollout (each turn's prompt extends the previous sequence)."""
    out = np.full((total, w), -1, np.int16)
    pos = 0
    for t in turns:
        pos = len(t.prompt_token_ids)
        rows = _rows(t)
        n = len(t.completion_token_ids)
        if rows is not None and rows.shape[1] == w:
            out[pos : pos + n] = rows
        pos += n
    return out.tolist()
