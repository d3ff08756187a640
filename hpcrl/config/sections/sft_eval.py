"""`hpcrl sft`'s [eval]: prime-rl's online evaluation during SFT. Every `interval` steps (and at step 0
unless skip_first_step, and at the last step) the trainer writes the policy's HF weights and scores
them on the environments with `hpcrl eval` (its own inference server), beside training; each
env's avg@k / pass@k / errored go to metrics.jsonl at that step (hpcrl.trainer.sft_eval).
prime-rl's [[eval.source]] become `env` entries (hpcrl.config.prime_shapes), its group_size is
rollouts_per_example."""

from __future__ import annotations

from typing import Annotated

import msgspec

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.evaluation import EvalInferenceConfig
from hpcrl.config.sections.orchestrator import EnvConfig, SamplingConfig


class SFTEvalConfig(Section):
    interval: Annotated[int, D("Evaluate the policy every N steps (and at the last step).", ge=1)] = 100
    skip_first_step: Annotated[bool, D("Skip the evaluation of the starting weights (step 0).")] = False
    retrigger_on_resume: Annotated[
        bool, D("On resume, evaluate the resumed step again (its evaluation may not have finished).")
    ] = False
    num_examples: Annotated[int, D("Examples per environment (-1 = all); an env's own wins.", ge=-1)] = -1
    rollouts_per_example: Annotated[
        int,
        D("Rollouts per example, the k of avg@k / pass@k (prime-rl's group_size); an env's own wins.", ge=1),
    ] = 1
    env: Annotated[
        list[EnvConfig], D("The environments to score ([[eval.env]]; prime-rl's [[eval.source]]).")
    ] = msgspec.field(default_factory=list)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    inference: Annotated[
        EvalInferenceConfig,
        D("The inference server each evaluation starts (prime-rl's top-level [inference])."),
    ] = msgspec.field(default_factory=EvalInferenceConfig)
    seq_len: Annotated[
        int | None, D("Max tokens per eval rollout (prompt + completion); unset: data.seq_len.")
    ] = None
