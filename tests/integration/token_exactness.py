"""Compare what the inference server sampled (HPCRL_GENERATE_LOG) with the token ids of the rollout
files the trainer reads: every trainable span of every sample must be a completion the server
returned for exactly the ids before it, with the same logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcrl.bus.files import read_message
from hpcrl.bus.messages import TrainBatch


def server_samples(log: Path) -> dict[tuple[int, ...], list[tuple[list[int], list[float]]]]:
    out: dict[tuple[int, ...], list[tuple[list[int], list[float]]]] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        for ids, lps in zip(rec["token_ids"], rec["logprobs"]):
            out.setdefault(tuple(rec["prompt_token_ids"]), []).append((ids, lps))
    return out


def trainable_spans(batch: TrainBatch):
    """(context ids, span ids, span logprobs) for every run of loss-masked tokens of every sample."""
    start = 0
    for n in batch.seq_lens.tolist():
        ids = batch.input_ids[start : start + n].tolist()
        mask = batch.loss_mask[start : start + n]
        lps = batch.inference_logprobs[start : start + n]
        edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(np.int8), 0]))
        for s, e in zip(edges[::2], edges[1::2]):
            yield ids[:s], ids[s:e], lps[s:e].tolist()
        start += n


def capture_rollouts(rollouts_dir: Path, into: Path) -> None:
    """Copy every rollout file that appeared (the trainer deletes consumed steps behind it; a file is
    renamed into place only once complete, so what is there is whole)."""
    import shutil

    for f in rollouts_dir.glob("step_*/rank_*.msgpack"):
        dest = into / f.parent.name / f.name
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)


def compare(captured: Path, log: Path) -> dict[str, int]:
    """`captured`: a directory of step_N/rank_R.msgpack files (capture_rollouts)."""
    sampled = server_samples(log)
    counts = {"steps": 0, "samples": 0, "spans": 0, "tokens": 0, "mismatches": 0}
    counts["steps"] = len({f.parent for f in captured.glob("step_*/rank_*.msgpack")})
    for f in sorted(captured.glob("step_*/rank_*.msgpack")):
        batch = read_message(f, TrainBatch)
        counts["samples"] += len(batch.seq_lens)
        for context, span, lps in trainable_spans(batch):
            counts["spans"] += 1
            counts["tokens"] += len(span)
            ok = any(
                ids == span and np.allclose(got, lps, atol=1e-5)
                for ids, got in sampled.get(tuple(context), [])
            )
            counts["mismatches"] += not ok
    return counts
