"""``trainer.enable_token_export``: every trained sample's tokens with the trainer's numbers for them,
for debugging a run token by token (prime-rl's token export, schema version 1).

After each micro-batch's forward, each sample with loss tokens becomes one JSON line of
``token_exports/step_N/rank_R.jsonl`` (RunPaths.token_export_file): its token ids and positions, loss
mask, advantages, the sampler's and the trainer's logprobs, entropy, the importance log ratio and
ratio and the mismatch KL exactly as the loss computes them (hpcrl.trainer.loss), and whether the
default loss's trust region masked the token (null where the loss has no such mask). Columns are
aligned with ``token_ids``; null where a value does not exist (no advantage in opd, a logprob of a
sample's first token). Once every rank has written its step, rank 0 writes ``STABLE`` beside the
files. Under cp only cp rank 0 of each group writes (its tokens' trainer numbers; the others' are null).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer.loss import (
    LossParams,
    importance_log_ratio,
    sample_masks,
    token_ratio_mask,
    trust_region_mask,
)

SCHEMA_VERSION = 1


def _floats(t: Tensor | None, n: int) -> list[float | None]:
    if t is None:
        return [None] * n
    return [v if math.isfinite(v) else None for v in t.detach().float().cpu().tolist()]


class TokenExporter:
    def __init__(
        self, paths: RunPaths, rank: int, params: LossParams, env_names: list[str], write: bool = True
    ):
        self.paths, self.rank, self.params, self.env_names = paths, rank, params, env_names
        self.write = write  # False: a cp rank other than its group's first (it only joins the barrier)
        self._files: dict[int, Path] = {}

    @classmethod
    def for_rank(
        cls, paths: RunPaths, tr: Any, params: LossParams, env_names: list[str] | None = None
    ) -> TokenExporter:
        write = tr.cp is None or tr.cp.rank == 0
        return cls(paths, tr.dist.rank, params, env_names or [], write=write)

    def export(self, step: int, micro_step: int, mb: Any, logprobs: Tensor, entropy: Tensor | None) -> int:
        """One JSON line per sample of ``mb`` with loss tokens; returns the lines written."""
        if not self.write:
            return 0
        cols = self.columns(mb, logprobs, entropy)
        lines = []
        start = 0
        for i, n in enumerate(mb.seq_lens.tolist()):
            end = start + n
            if any(cols["loss_mask"][start:end]):
                env = int(mb.env_index[i]) if mb.env_index is not None else -1
                record = {
                    "schema_version": SCHEMA_VERSION,
                    "step": step,
                    "rank": self.rank,
                    "micro_step": micro_step,
                    "micro_sequence_idx": i,
                    "env_name": self.env_names[env] if 0 <= env < len(self.env_names) else None,
                    **{k: v[start:end] for k, v in cols.items()},
                }
                lines.append(json.dumps(record, separators=(",", ":"), allow_nan=False))
            start = end
        if lines:
            path = self.paths.token_export_file(step, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a" if step in self._files else "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            self._files[step] = path
        return len(lines)

    def columns(self, mb: Any, logprobs: Tensor, entropy: Tensor | None) -> dict[str, list[Any]]:
        """The per-token columns of one micro-batch, each a list of its T tokens."""
        n = mb.num_tokens
        mask = mb.loss_mask.bool()
        lp = logprobs.detach().float()
        out: dict[str, list[Any]] = {
            "token_ids": mb.input_ids.tolist(),
            "position_ids": mb.position_ids.tolist(),
            "loss_mask": mask.tolist(),
            "advantages": _floats(mb.advantages, n),
            "inference_logprobs": _floats(mb.inference_logprobs, n),
            "trainer_logprobs": _floats(torch.where(mask, lp, torch.nan), n),
            "entropy": _floats(None if entropy is None else torch.where(mask, entropy.float(), torch.nan), n),
        }
        none = [None] * n
        out |= {
            "log_importance_ratio": none,
            "importance_ratio": none,
            "mismatch_kl": none,
            "is_masked": none,
        }
        if mb.inference_logprobs is None:
            return out
        inf = mb.inference_logprobs.to(lp.device).float()
        log_ratio = importance_log_ratio(lp, inf, self.params.max_log_ratio)
        ratio = log_ratio.exp()
        off = torch.tensor(torch.nan, device=lp.device)
        out["log_importance_ratio"] = _floats(torch.where(mask, log_ratio, off), n)
        out["importance_ratio"] = _floats(torch.where(mask, ratio, off), n)
        out["mismatch_kl"] = _floats(torch.where(mask, torch.expm1(log_ratio) - log_ratio, off), n)
        if self.params.type == "default" and self.params.mode == "rl" and mb.advantages is not None:
            adv = mb.advantages.to(lp.device).float()
            masked = trust_region_mask(ratio, adv, self.params.eps_low, self.params.eps_high) & mask
            p = self.params  # and the mismatch masks (MIS) the loss applies before it
            masked |= token_ratio_mask(ratio, mask, p.token_mask_low, p.token_mask_high)
            if p.masks_samples and getattr(mb, "seq_lens", None) is not None:
                masked |= sample_masks(p, log_ratio, mask, mb.seq_lens.to(lp.device)) & mask
            out["is_masked"] = [m if k else None for m, k in zip(masked.tolist(), mask.tolist(), strict=True)]
        return out

    def finish(self, step: int) -> None:
        """Collective: once every rank has written step ``step``, rank 0 marks it ``STABLE``."""
        parallel.barrier()
        if self.rank == 0:
            d = self.paths.token_export_file(step, 0).parent
            d.mkdir(parents=True, exist_ok=True)
            (d / "STABLE").touch()
        self._files.pop(step, None)
