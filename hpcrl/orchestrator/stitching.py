"""Exact multi-turn token stitching and trajectory -> training pieces (pure functions).

Turn 1 of a rollout goes to /v1/chat/completions (the server applies its chat template and returns
the prompt ids it used). Turn k > 1 goes to /v1/completions with a token-id prompt:

    prompt_k = prompt_{k-1} + completion_{k-1} + env_ids

where env_ids is the tokenization of what the chat template puts after the model's last sampled
token: the tail of the assistant turn it did not sample (e.g. "\n" after <|im_end|>) plus the
env's messages and the next generation prompt. The model is therefore conditioned on exactly the
tokens it sampled (never a re-tokenization of its text), and the rollout is one training sequence
whose loss mask covers only sampled tokens. When the template re-renders the history differently
(tool calls re-serialised, reasoning stripped), exact stitching is impossible: that turn's prompt
is the template's rendering and the rollout becomes one training sequence per turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.envs.base import Message, Trajectory, Turn, stitch_turns
from hpcrl.orchestrator import routes
from hpcrl.orchestrator.env_roles import branch_env_roles, piece_env_roles
from hpcrl.orchestrator.state import Piece, RolloutRecord
from hpcrl.orchestrator.transcript import transcript_of


def render(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text. `template_kwargs` (enable_thinking, reasoning_effort) must be the
    request's on every render: a later turn's prompt is rendered here, not by the server, and a
    template that changes with them (Qwen3's empty think block) would otherwise differ from turn 1."""
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )


def template_kwargs(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-template switches of a request's sampling fields (see openai_sampling)."""
    return dict(sampling.get("chat_template_kwargs") or {})


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def env_response_ids(
    tokenizer: Any,
    history: list[Message],
    messages: list[Message],
    tools: list[dict] | None,
    completion_ids: list[int],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int] | None:
    """Token ids the template puts after the last sampled token of `history` (which ends with the
    assistant turn that produced `completion_ids`) up to the next generation prompt of `messages`.
    None when the template does not render `history` as a prefix of `messages` plus what the model
    sampled (then no exact stitching exists)."""
    got = env_response_text(tokenizer, history, messages, tools, completion_ids, template_kwargs)
    return None if got is None else encode(tokenizer, got[0])


def env_response_text(
    tokenizer: Any,
    history: list[Message],
    messages: list[Message],
    tools: list[dict] | None,
    completion_ids: list[int],
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, int] | None:
    """The text env_response_ids tokenizes and how many of its leading characters are the unsampled
    tail of the assistant turn (the env's messages follow: hpcrl.orchestrator.env_roles)."""
    before = render(tokenizer, history[:-1], tools, True, template_kwargs)
    through = render(tokenizer, history, tools, False, template_kwargs)
    full = render(tokenizer, messages, tools, True, template_kwargs)
    if not (through.startswith(before) and full.startswith(through)):
        return None
    assistant_text = through[len(before) :]
    sampled = tokenizer.decode(completion_ids, skip_special_tokens=False)
    if not assistant_text.startswith(sampled):
        return None
    tail = assistant_text[len(sampled) :]
    return tail + full[len(through) :], len(tail)


def stitch_prompt(
    prev_prompt: Sequence[int], prev_completion: Sequence[int], env_ids: Sequence[int]
) -> list[int]:
    return [*prev_prompt, *prev_completion, *env_ids]


def pieces_from_turns(turns: Sequence[Turn], branching: bool = False) -> list[Piece]:
    """Consecutive turns whose prompt ids extend the previous turn's prompt + completion ids are one
    Piece; a turn that does not (re-rendered: the bridge or the stitching declined) starts a new one.
    Always one Piece per turn with ``branching`` (orchestrator.trajectory_strategy = "branching").
    Router replay rows (routed_experts) follow each Piece's tokens."""
    segments: list[list[Turn]] = []
    for t in turns:
        same_trace = bool(segments) and segments[-1][-1].trace == t.trace
        if same_trace and not branching and stitch_turns([*segments[-1], t]) is not None:
            segments[-1].append(t)
        else:
            segments.append([t])
    w = routes.width(turns)
    pieces = []
    for seg in segments:
        whole = stitch_turns(seg)
        assert whole is not None
        # echo: a branch sample's own env part (hpcrl.orchestrator.env_roles.branch_env_roles)
        roles = branch_env_roles(seg[0]) if branching else piece_env_roles(seg)
        pieces.append(
            Piece(
                input_ids=whole.input_ids.tolist(),
                loss_mask=whole.loss_mask.tolist(),
                logprobs=whole.logprobs.tolist(),
                routed_experts=None if w is None else routes.stitched_routes(seg, w, len(whole.input_ids)),
                trace=seg[0].trace,
                env_roles=roles,
                after_response=branching and roles is not None,
                images=seg[-1].images,  # the last prompt holds every image of the sequence
            )
        )
    return pieces


def to_record(
    index: int, traj: Trajectory, branching: bool = False, started: float = 0.0, finished: float = 0.0
) -> RolloutRecord:
    """The scored rollout the batch builder uses; `started` / `finished` (Unix times) go to its
    transcript (the saved rollout)."""
    sampled = [t for t in traj.turns if t.completion_token_ids]
    return RolloutRecord(
        index=index,
        pieces=pieces_from_turns(traj.turns, branching) if sampled else [],
        reward=float(traj.reward),
        policy_version=min((t.oldest_policy_step for t in sampled), default=0),
        num_turns=len(traj.turns),
        completion_tokens=sum(len(t.completion_token_ids) for t in traj.turns),
        truncated=traj.truncated,
        error=traj.error,
        metrics={k: float(v) for k, v in traj.metrics.items()},
        bridge_breaks=sum(t.rerendered for t in traj.turns),
        trace_rewards=None if traj.trace_rewards is None else [float(r) for r in traj.trace_rewards],
        transcript=transcript_of(traj, started, finished),
    )
