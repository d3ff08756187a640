"""Router replay on the orchestrator side: the experts the inference server routed each token to
laid out along a training sequence, one flat row of layers*k ids per token. A turn carries its
completion's routes (``routed_experts``: [tokens][layers][k], from the decode steps) and, where the
server reports them (hpcrl's engine), its prompt's (``prompt_routed_experts``, from the prefill):
a prompt token the trainer routed differently would change the hidden states of every later token.
-1 where nobody knows (a server without prompt routes; a turn's last token, never fed back).

Multi-turn rollouts carry them per turn. A stitched sequence takes each turn's completion rows at
that turn's completion tokens and its prompt rows where no earlier turn set one (environment tokens,
the previous turn's last token): the routes the engine computed a token with first are those the
logprobs of that turn's tokens came from.

A server's wire shapes of a choice's routing are read by :mod:`hpcrl.inference.routed`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcrl.envs.base import Turn


def _rows(turn: Turn, prompt: bool = False) -> np.ndarray | None:
    r = turn.prompt_routed_experts if prompt else turn.routed_experts
    if r is None:
        return None
    arr = np.asarray(r, dtype=np.int16)
    n = len(turn.prompt_token_ids if prompt else turn.completion_token_ids)
    if arr.ndim != 3 or arr.shape[0] != n:
        return None  # a server that answered something else: no replay for these tokens
    return arr.reshape(n, -1)


def width(turns: Sequence[Turn]) -> int | None:
    """layers * k of the first turn with routes (None: no turn has any)."""
    for t in turns:
        rows = _rows(t)
        if rows is not None:
            return int(rows.shape[1])
    return None


def turn_routes(turn: Turn, w: int) -> list[list[int]]:
    """One turn as its own sequence."""
    return stitched_routes([turn], w, len(turn.prompt_token_ids) + len(turn.completion_token_ids))


def stitched_routes(turns: Sequence[Turn], w: int, total: int) -> list[list[int]]:
    """The rows of a stitched rollout (each turn's prompt extends the previous sequence)."""
    out = np.full((total, w), -1, np.int16)
    for t in turns:
        pos, n = len(t.prompt_token_ids), len(t.completion_token_ids)
        prompt = _rows(t, prompt=True)
        if prompt is not None and prompt.shape[1] == w:
            unset = (out[:pos] < 0).all(1)
            out[:pos][unset] = prompt[unset]
        rows = _rows(t)
        if rows is not None and rows.shape[1] == w:
            out[pos : pos + n] = rows
    return out.tolist()
