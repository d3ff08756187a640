"""echo (prime-rl's src/prime_rl/orchestrator/algo/echo.py): GRPO on the sampled tokens, plus a
weighted cross entropy on env-provided tokens of LATER turns (tool results, user feedback).

Each piece (a stitched training sequence) carries the message role of its env-provided tokens
(`Piece.env_roles`, hpcrl.orchestrator.env_roles: body tokens only where the template or renderer
attributes them). A token gets its role's `alpha` as `Piece.ce_weights` when it is not sampled, comes
after the rollout's first model response (the piece's first sampled token, or its prompt's earlier
replies in a branch sample: `Piece.after_response`; the initial prompt is excluded) and its role is in
`[orchestrator.algo.roles]`; the optional user filter (`[orchestrator.algo.filter]`) can only narrow
that. With trajectory_strategy = "branching" (one sample per turn) each env message is weighed once,
in the sample of the turn that follows it, as prime-rl trains a node its branches share once. The
weighted tokens stay outside the loss mask (the rl loss and its token count); the trainer adds
`sum(alpha * -logp) / (weighted tokens of the step)`, prime-rl's `ce` component
(hpcrl.trainer.loss.ce_loss). A piece with no weighted token ships no weights.

The filter is called once per rollout as `filter(rollout, **kwargs)` with the RolloutRecord (its
`pieces`, and `transcript.messages` for the text) and returns one keep-mask per piece, each as long as
that piece's `input_ids` (prime-rl: one per trainable branch, each spanning its token ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from hpcrl.config.algo_checks import import_object
from hpcrl.config.sections.algo import AlgoConfig
from hpcrl.orchestrator.env_roles import ROLES
from hpcrl.orchestrator.state import Piece, RolloutRecord


def role_weights(algo: AlgoConfig) -> dict[int, float]:
    """{role code: alpha} of the roles echo trains (hpcrl.orchestrator.env_roles.ROLES)."""
    return {code: cfg.alpha for name, code in ROLES.items() if (cfg := getattr(algo.roles, name)) is not None}


def piece_weights(
    piece: Piece, weights: dict[int, float], keep: Sequence[bool] | None = None
) -> list[float] | None:
    """The ce weight of every token of ``piece``; None when no token is weighted."""
    if piece.env_roles is None:
        return None
    out = [0.0] * len(piece.input_ids)
    seen_response = piece.after_response  # a branch sample: earlier replies are in its prompt
    for t, (sampled, role) in enumerate(zip(piece.loss_mask, piece.env_roles, strict=True)):
        if sampled:
            seen_response = True
        elif seen_response and role in weights and (keep is None or keep[t]):
            out[t] = weights[role]
    return out if any(out) else None


class Echo:
    """One echo algorithm's token weights (its roles, its filter)."""

    def __init__(self, algo: AlgoConfig):
        self.weights = role_weights(algo)
        self.filter: Callable[[RolloutRecord], Any] | None = None
        if algo.filter is not None:
            self.filter = partial(import_object(algo.filter.import_path), **algo.filter.kwargs)

    def weigh(self, rollouts: Sequence[RolloutRecord]) -> None:
        """Set ``ce_weights`` on every piece of ``rollouts``."""
        for r in rollouts:
            keep = self.keep_masks(r) if self.filter is not None else None
            for i, p in enumerate(r.pieces):
                p.ce_weights = piece_weights(p, self.weights, None if keep is None else keep[i])

    def rl_pruned(self, rollouts: Sequence[RolloutRecord]) -> bool:
        """A group without rl signal (advantages all zero, zero_advantage = "drop"): as prime-rl's
        filter_zero_advantages prunes zero-advantage tokens from the rl component and keeps a sample
        that still has ce weights, its sampled tokens leave the loss mask and the group trains on its
        ce weights alone (a piece without any is then dropped at packing). False: no ce weight, so
        nothing to train and the group is dropped as any other."""
        if not any(p.ce_weights for r in rollouts for p in r.pieces):
            return False
        for r in rollouts:
            for p in r.pieces:
                p.loss_mask = [False] * len(p.loss_mask)
        return True

    def keep_masks(self, r: RolloutRecord) -> list[list[bool]]:
        """The filter's masks, checked as prime-rl checks them (one per piece, each spanning it)."""
        assert self.filter is not None
        masks = self.filter(r)
        if not isinstance(masks, list) or len(masks) != len(r.pieces):
            got = len(masks) if isinstance(masks, list) else type(masks).__name__
            raise ValueError(
                f"echo filter must return one keep-mask per piece: got {got}, expected {len(r.pieces)}"
            )
        for i, (p, m) in enumerate(zip(r.pieces, masks)):
            if not isinstance(m, list) or len(m) != len(p.input_ids):
                got = len(m) if isinstance(m, list) else type(m).__name__
                raise ValueError(
                    f"echo filter mask for piece {i} must span the piece's tokens: "
                    f"got {got}, expected {len(p.input_ids)}"
                )
        return masks
