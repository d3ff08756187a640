"""Per-env algorithms that mix the rl types (grpo, max_rl, rae) with the ref_kl types (opd, opsd) in
one run (prime-rl's per-source algo, e.g. configs/debug/algo/mixed_grpo_opd.toml).

The trainer runs one loss: the rl loss (the run's [orchestrator.algo] is an rl type). A ref_kl env's
signal is per token: the trainer's opd mode would compute `teacher_logprob - inference_logprob` on each
loss token and use it as that token's advantage in the same policy-gradient loss (hpcrl.trainer.loss).
Here the orchestrator computes exactly that per-token advantage for the ref_kl envs' samples
(`reference_advantages`), so both kinds pack into one batch for the rl loss.

prime-rl normalizes each loss component by its own global token count (rl by the rl tokens, ref_kl by
the ref_kl tokens), where hpcrl's trainer divides the step's loss by all its loss tokens. With N tokens
of which N_rl are rl and N_kl ref_kl, `component_scales` multiplies the rl advantages by N / N_rl and the
ref_kl ones by N / N_kl over the packed batches of the step (all ranks), so the trainer's
sum / N is prime-rl's sum_rl / N_rl + sum_kl / N_kl. A positive scale keeps each token's sign, so the
trust-region masks are unchanged. (The entropy bonus and the KL penalty, run-wide, are not scaled.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import numpy as np

from hpcrl.bus import TrainBatch
from hpcrl.orchestrator.packing import Sample


def reference_advantages(samples: Sequence[Sample], kl_envs: Collection[str]) -> list[Sample]:
    """Samples of `kl_envs` get the per-token advantage teacher_logprob - inference_logprob on their
    loss tokens (0 elsewhere) and no teacher_logprobs; the others are unchanged."""
    out = []
    for s in samples:
        if s.env_name not in kl_envs:
            out.append(s)
            continue
        if s.teacher_logprobs is None:
            raise ValueError(f"env {s.env_name!r}: a ref_kl sample without reference logprobs")
        mask = np.asarray(s.loss_mask, dtype=bool)
        adv = np.where(mask, np.asarray(s.teacher_logprobs, np.float32) - s.inference_logprobs, 0.0)
        out.append(replace(s, advantage=adv.astype(np.float32), teacher_logprobs=None))
    return out


def _component_masks(b: TrainBatch, kl_envs: Collection[str]) -> np.ndarray:
    """[T] True on tokens of ref_kl samples."""
    per_sample = np.asarray([n in kl_envs for n in b.env_names], dtype=bool)
    return np.repeat(per_sample, b.seq_lens)


def component_scales(batches: Sequence[TrainBatch], kl_envs: Collection[str]) -> tuple[float, float]:
    """(rl scale, ref_kl scale) of a step's batches (all ranks): N / N_rl and N / N_kl (1 where a
    component has no token), and applies them to the batches' advantages in place."""
    n_kl = sum(int(np.count_nonzero(b.loss_mask & _component_masks(b, kl_envs))) for b in batches)
    n = sum(int(np.count_nonzero(b.loss_mask)) for b in batches)
    n_rl = n - n_kl
    rl = n / n_rl if n_rl else 1.0
    kl = n / n_kl if n_kl else 1.0
    for b in batches:
        kl_tok = _component_masks(b, kl_envs)
        b.advantages = (b.advantages * np.where(kl_tok, kl, rl)).astype(np.float32)
    return rl, kl
