"""The trainer's stability metrics by environment, under the names prime-rl logs (seed 001):
`mismatch_kl/{all,<env>}/{mean,std,max}` and `entropy/{all,<env>}/mean`.

Per loss token: the mismatch KL (exp(d) - 1 - d, d = trainer - inference logprob; the same value the
loss's stats sum) and the entropy, each with its sample's env. Counts, sums, sums of squares and
maxima are all-reduced over ranks, so every rank gets the step's numbers (two collectives, always
the same on every rank: the env names come from the config).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hpcrl.trainer import parallel


def token_envs(env_index: Tensor | None, seq_lens: Tensor, loss_mask: Tensor) -> Tensor | None:
    """Each loss token's env index (the sample's), or None when the batch carries no env."""
    if env_index is None:
        return None
    return torch.repeat_interleave(env_index.to(seq_lens.device), seq_lens)[loss_mask.bool()].cpu()


def _fold(values: Tensor, envs: Tensor | None, n: int) -> tuple[Tensor, Tensor]:
    """[n+1, 3] (count, sum, sum of squares) and [n+1] max: row 0 all tokens, row 1+i env i."""
    sums = torch.zeros(n + 1, 3, dtype=torch.float64)
    maxes = torch.full((n + 1,), -math.inf, dtype=torch.float64)
    v = values.double()
    rows = [(0, v)]
    if envs is not None and len(envs) == len(v):
        rows += [(i + 1, v[envs == i]) for i in range(n)]
    for r, x in rows:
        if x.numel():
            sums[r] = torch.stack(
                [torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * x).sum()]
            )
            maxes[r] = x.max()
    return sums, maxes


def env_metrics(
    kl: Tensor, kl_envs: Tensor | None, entropy: Tensor, ent_envs: Tensor | None, names: list[str]
) -> dict[str, float]:
    """Collective. `kl` / `entropy`: this rank's per-loss-token values; `*_envs`: their env indices."""
    n = len(names)
    kl_sums, kl_max = _fold(kl, kl_envs, n)
    ent_sums, _ = _fold(entropy, ent_envs, n)
    summed = parallel.all_reduce(torch.cat([kl_sums, ent_sums]), op="sum")
    kl_max = parallel.all_reduce(kl_max, op="max")
    kl_sums, ent_sums = summed[: n + 1], summed[n + 1 :]
    out: dict[str, float] = {}
    for r, name in enumerate(["all", *names]):
        count, total, squares = (float(x) for x in kl_sums[r])
        if count > 0:
            mean = total / count
            out[f"mismatch_kl/{name}/mean"] = mean
            out[f"mismatch_kl/{name}/std"] = math.sqrt(max(squares / count - mean * mean, 0.0))
            out[f"mismatch_kl/{name}/max"] = float(kl_max[r])
        ent_count, ent_total = float(ent_sums[r][0]), float(ent_sums[r][1])
        if ent_count > 0:
            out[f"entropy/{name}/mean"] = ent_total / ent_count
    return out
