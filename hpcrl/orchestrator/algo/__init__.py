"""The runtime of [orchestrator.algo] (config: hpcrl.config.sections.algo): what each algorithm does to
a finished group before it is trained on.

- `credit`: advantages of the reward-based types (grpo, max_rl, rae, echo's rl part), the
  per-agent baselines of rae (checkpointed with the orchestrator's state), and the all-ones weights
  of sft; the ref_kl types (opd, opsd) assign none.
- `reference`: reference logprobs of every sampled sequence for the ref_kl types: a frozen teacher's
  (opd) or the live policy's with the demonstration prepended as a leading system message (opsd).

- `echo`: echo's cross-entropy weights on env-provided tokens of later turns, by message role (its
  rl part is grpo's, in `credit`).
- `mixed`: per-env algorithms mixing rl and ref_kl types in one run (prime-rl's per-source algo).

Which model samples (sft: the frozen `sampling.source`) is set up in hpcrl.orchestrator.setup; which
loss the tokens feed is the trainer's `LossParams.mode` (AlgoConfig.loss_mode).
"""

from hpcrl.orchestrator.algo.credit import Credit
from hpcrl.orchestrator.algo.reference import References, ReferenceScorer

__all__ = ["Credit", "References", "ReferenceScorer"]
