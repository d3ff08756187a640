"""The orchestrator's state at a batch boundary, and its part of a step_N checkpoint.

A boundary is the moment right after batch B was published and before any task of batch B+1 is
drawn. Nothing is in flight then, so the state is small and exact:

- the buffer (sampler cursors + epochs, env mixer counts, filter decision counter, counters);
- groups already generated and accepted but not yet trained (carried over to the next batch);
- progress counters and which policies were already evaluated;
- the algorithm's own state (rae: each agent's reward baseline);
- the batches published but possibly not yet trained: N+1..B for a checkpoint of step N.

All randomness is counter-based (buffer draws keyed by seed + counter, sampling seeds derived from
(seed, step, example, rollout, turn)), so there is no RNG object to save. The checkpoint part is

    checkpoints/step_N/orchestrator/state.json                      (msgspec JSON, format 1)
    checkpoints/step_N/orchestrator/rollouts/step_M/rank_R.msgpack  (the exact published bytes)

No pickle anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from hpcrl import checkpoint
from hpcrl.errors import ConfigError
from hpcrl.orchestrator.transcript import Transcript
from hpcrl.paths import RunPaths

STATE_FORMAT = 1
STATE_FILE = "state.json"


class Piece(msgspec.Struct, kw_only=True):
    """One training sequence of a rollout (a whole stitched rollout, or one turn of one that could
    not be stitched exactly)."""

    input_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    teacher_logprobs: list[float] | None = None
    routed_experts: list[list[int]] | None = None  # MoE router replay: [T][layers*k], -1 = none
    trace: int = 0  # multi-agent: the rollout's trained trace this sequence belongs to
    # Per token: the message role of env-provided tokens of later turns (hpcrl.orchestrator.env_roles;
    # 0 elsewhere), None when none is attributed; echo turns them into ce_weights (algo.echo).
    env_roles: bytes | None = None  # one code a token
    # A branch sample of a later turn (trajectory_strategy = "branching"): its prompt already holds
    # the rollout's earlier replies, so its env tokens follow a model response (echo weighs them).
    after_response: bool = False
    ce_weights: list[float] | None = None  # per token: echo's cross-entropy weight (0 = not trained)
    images: list[str] | None = None  # the sequence's images in prompt order (data URLs): VLM RL


class RolloutRecord(msgspec.Struct, kw_only=True):
    """One finished rollout, scored; everything the batch builder and the metrics need."""

    index: int  # rollout index inside its group (0..n-1): part of the deterministic order
    pieces: list[Piece]
    reward: float = 0.0
    policy_version: int = 0  # oldest policy that produced any of its tokens
    num_turns: int = 0
    completion_tokens: int = 0
    truncated: bool = False
    error: str | None = None
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    bridge_breaks: int = 0  # later turns re-rendered (rollout/bridge_breaks): each starts a new sample
    trace_rewards: list[float] | None = None  # multi-agent: one reward per trained trace (Piece.trace)
    transcript: Transcript | None = None  # the conversation and tokens as saved (rollout_log), not trained

    def piece_reward(self, piece: Piece) -> float:
        tr = self.trace_rewards
        return tr[piece.trace] if tr is not None and piece.trace < len(tr) else self.reward

    @property
    def errored(self) -> bool:
        return self.error is not None

    @property
    def empty(self) -> bool:
        return self.error is None and self.completion_tokens == 0


class GroupRecord(msgspec.Struct, kw_only=True):
    """All rollouts of one task. `advantages` is set (one per rollout) once the group is accepted."""

    env: str
    example_id: int
    task_index: int
    task_epoch: int
    rollouts: list[RolloutRecord]
    advantages: list[float] | None = None
    # multi-agent rollouts (trace_rewards): per rollout, one advantage per trace, each against the
    # same trace of the group's other rollouts; None: every piece takes its rollout's advantage
    trace_advantages: list[list[float]] | None = None

    def piece_advantage(self, rollout: RolloutRecord, piece: Piece) -> float:
        assert self.advantages is not None, "judge_group sets advantages before a group is used"
        ta = self.trace_advantages
        if ta is not None and piece.trace < len(ta[rollout.index]):
            return ta[rollout.index][piece.trace]
        return self.advantages[rollout.index]


class OrchestratorState(msgspec.Struct, kw_only=True):
    format: int = STATE_FORMAT
    step: int  # last published batch B
    checkpoint_step: int  # N of the checkpoint this state belongs to
    world_size: int
    batch_size: int
    rollouts_per_example: int
    buffer: dict[str, Any]
    ready: list[GroupRecord]
    progress: dict[str, int]
    evaluated: list[int]
    pending_steps: list[int]  # N+1..B, saved as files beside this state
    algo: dict[str, Any] = msgspec.field(default_factory=dict)  # the algorithm's own (rae's baselines)


def _pending_file(paths: RunPaths, ckpt_step: int, step: int, rank: int) -> Path:
    return paths.orchestrator_ckpt_dir(ckpt_step) / "rollouts" / f"step_{step}" / f"rank_{rank}.msgpack"


def save_part(paths: RunPaths, state: OrchestratorState, pending: dict[int, list[bytes]]) -> Path:
    """Write the orchestrator part of checkpoint `state.checkpoint_step` (then its DONE marker)."""
    n = state.checkpoint_step
    missing = [m for m in state.pending_steps if m not in pending]
    assert not missing, f"pending batches {missing} of checkpoint {n} are not in memory"
    d = checkpoint.begin_part(paths, n, "orchestrator")
    for m in state.pending_steps:
        for rank, data in enumerate(pending[m]):
            checkpoint.atomic_write_bytes(_pending_file(paths, n, m, rank), data)
    checkpoint.atomic_write_bytes(d / STATE_FILE, msgspec.json.encode(state))
    checkpoint.mark_part_done(paths, n, "orchestrator")
    return d


def load_part(paths: RunPaths, ckpt_step: int) -> tuple[OrchestratorState, dict[int, list[bytes]]]:
    """The state and the raw bytes of the pending batches of checkpoint `ckpt_step`."""
    d = paths.orchestrator_ckpt_dir(ckpt_step)
    f = d / STATE_FILE
    if not f.is_file():
        raise ConfigError("ckpt.resume_step", f"checkpoint step_{ckpt_step} has no orchestrator state ({f})")
    state = msgspec.json.decode(f.read_bytes(), type=OrchestratorState)
    if state.format != STATE_FORMAT:
        raise ConfigError(
            "ckpt.resume_step",
            f"{f}: orchestrator state format {state.format}, this build reads {STATE_FORMAT}",
        )
    if state.checkpoint_step != ckpt_step:
        raise ConfigError(
            "ckpt.resume_step", f"{f} belongs to checkpoint {state.checkpoint_step}, not {ckpt_step}"
        )
    pending = {
        m: [_pending_file(paths, ckpt_step, m, r).read_bytes() for r in range(state.world_size)]
        for m in state.pending_steps
    }
    return state, pending


def check_compatible(state: OrchestratorState, batch_size: int, rollouts_per_example: int) -> None:
    """A resumed run must cut batches the same way, or the prompt stream would silently change.
    (The trainer world size may change: pending batches are re-packed, see OrchestratorLoop.restore.)"""
    for name, saved, now in (
        ("orchestrator.batch_size", state.batch_size, batch_size),
        ("orchestrator.rollouts_per_example", state.rollouts_per_example, rollouts_per_example),
    ):
        if saved != now:
            raise ConfigError(
                name,
                f"checkpoint step_{state.checkpoint_step} was taken with {name} = {saved}, "
                f"this run has {now}; resume with the same value",
            )
