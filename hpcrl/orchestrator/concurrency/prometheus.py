"""One reader of Prometheus text for vLLM's /metrics and the embedded engine's (same names, vLLM 0.33):
`parse` turns the exposition into samples, `server_load` into the few facts the controller reads.

Pure functions: no HTTP, no clock; tests feed them a recorded vLLM text (tests/golden/vllm_0_33_metrics.txt)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# vLLM 0.33's names, declared where the embedded engine writes them. A counter's samples carry the
# `_total` suffix prometheus_client adds.
from hpcrl.inference.prom import (
    CACHE_CONFIG,
    KV_USAGE,
    LOG_LINES_LOST,
    PREEMPTIONS,
    RUNNING,
    WAITING,
    WAITING_BY_REASON,
)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class ServerLoad:
    """One server's load at one scrape: raw facts only (thresholds live in the controller)."""

    kv_usage: float  # 0..1
    running: int
    waiting: int
    waiting_capacity: int | None  # waiting for KV/slot capacity (vLLM's by-reason gauge), None if absent
    preemptions: int  # cumulative counter
    kv_capacity_tokens: int | None  # from cache_config_info (None if not reported)
    log_lines_lost: int = 0  # cumulative: lines its process could not write (hpcrl's servers only)
    log_lost_why: str | None = None  # the last refusal (path, errno)


def _labels(text: str) -> tuple[dict[str, str], int]:
    """Parse `{a="x",b="y"}` from text[0] == '{'; return the labels and the index after '}'."""
    labels: dict[str, str] = {}
    i = 1
    while True:
        while text[i] in " ,":
            i += 1
        if text[i] == "}":
            return labels, i + 1
        eq = text.index("=", i)
        key = text[i:eq].strip()
        i = eq + 1
        while text[i] != '"':
            i += 1
        i += 1
        out = []
        while text[i] != '"':
            if text[i] == "\\":
                nxt = text[i + 1]
                out.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
            else:
                out.append(text[i])
                i += 1
        labels[key] = "".join(out)
        i += 1


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments and blank lines skipped; a line that
    does not parse is skipped too: a scrape must never crash the orchestrator)."""
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            brace = line.find("{")
            space = line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                name = line[:brace]
                labels, end = _labels(line[brace:])
                rest = line[brace + end :].split()
            else:
                name, *rest = line.split()
                labels = {}
            value = float(rest[0])  # NaN / +Inf parse too; an optional timestamp follows
        except (ValueError, IndexError):
            continue
        out.append(Sample(name, labels, value))
    return out


def _sum(samples: list[Sample], name: str) -> float | None:
    vals = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
    return sum(vals) if vals else None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    v = labels.get(key, "")
    return int(v) if v.isdigit() else None


def kv_capacity(samples: list[Sample]) -> int | None:
    """KV tokens of the server, summed over its engines: `kv_cache_size_tokens` when present, else
    num_gpu_blocks x block_size (prime-rl's inference_metrics.build_load_sample, #3307)."""
    total = 0
    for s in samples:
        if s.name != CACHE_CONFIG:
            continue
        size = _int_label(s.labels, "kv_cache_size_tokens")
        blocks, block = _int_label(s.labels, "num_gpu_blocks"), _int_label(s.labels, "block_size")
        if size is not None:
            total += size
        elif blocks is not None and block is not None:
            total += blocks * block
    return total or None


def server_load(samples: list[Sample]) -> ServerLoad:
    """The controller's facts from one scrape. Several engines (data-parallel vLLM: an `engine`
    label each) add up, except usage: the fullest engine's (the one that preempts first)."""
    usage = [s.value for s in samples if s.name == KV_USAGE and math.isfinite(s.value)]
    by_reason = [
        s.value for s in samples if s.name == WAITING_BY_REASON and s.labels.get("reason") == "capacity"
    ]
    preempt = _sum(samples, PREEMPTIONS + "_total")
    if preempt is None:  # an exposition without the counter suffix (older clients)
        preempt = _sum(samples, PREEMPTIONS)
    lost = [s for s in samples if s.name == LOG_LINES_LOST + "_total" and math.isfinite(s.value)]
    return ServerLoad(
        kv_usage=max(usage, default=0.0),
        running=int(_sum(samples, RUNNING) or 0),
        waiting=int(_sum(samples, WAITING) or 0),
        waiting_capacity=int(sum(by_reason)) if by_reason else None,
        preemptions=int(preempt or 0),
        kv_capacity_tokens=kv_capacity(samples),
        log_lines_lost=int(sum(x.value for x in lost)),
        log_lost_why=next((x.labels["reason"] for x in lost if x.value and x.labels.get("reason")), None),
    )
