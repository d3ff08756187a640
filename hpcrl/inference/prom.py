"""The embedded engine's /metrics: Prometheus text exposition under vLLM 0.33's names
(vllm/v1/metrics/loggers.py), so one reader (hpcrl.orchestrator.concurrency.prometheus) serves both
backends. Names live here, their one home; the reader imports them."""

from __future__ import annotations

from collections.abc import Mapping

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
PREEMPTIONS = "vllm:num_preemptions"  # a counter: its sample is vllm:num_preemptions_total
CACHE_CONFIG = "vllm:cache_config_info"
GENERATION_TOKENS = "vllm:generation_tokens"  # a counter
BLOCK_SIZE = 1  # the embedded engine counts single tokens


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def exposition(
    model: str,
    *,
    running: int,
    waiting: int,
    kv_used: int,
    kv_capacity: int,
    preemptions: int,
    generated_tokens: int,
    max_model_len: int,
    max_batch_size: int,
) -> str:
    """One scrape, as vLLM writes it (model_name / engine labels; counters with `_total`)."""
    base = {"engine": "0", "model_name": model}
    lab = _labels(base)
    cache = {
        "block_size": str(BLOCK_SIZE),
        "engine": "0",
        "kv_cache_size_tokens": str(kv_capacity),
        "max_model_len": str(max_model_len),
        "max_num_seqs": str(max_batch_size),
        "num_gpu_blocks": str(kv_capacity // BLOCK_SIZE),
    }
    rows = [
        ("gauge", RUNNING, "Number of requests in model execution batches.", [(RUNNING, lab, running)]),
        ("gauge", WAITING, "Number of requests waiting to be processed.", [(WAITING, lab, waiting)]),
        (
            "gauge",
            WAITING_BY_REASON,
            "Number of waiting requests by reason.",
            [
                (WAITING_BY_REASON, _labels({**base, "reason": "capacity"}), waiting),
                (WAITING_BY_REASON, _labels({**base, "reason": "deferred"}), 0),
            ],
        ),
        (
            "gauge",
            KV_USAGE,
            "KV-cache usage. 1 means 100 percent usage.",
            # read mid-iteration, the rows' just-sampled tokens count before their KV is written
            [(KV_USAGE, lab, min(1.0, kv_used / kv_capacity) if kv_capacity else 0.0)],
        ),
        (
            "counter",
            PREEMPTIONS,
            "Cumulative number of preemption from the engine.",
            [(PREEMPTIONS + "_total", lab, preemptions)],
        ),
        (
            "counter",
            GENERATION_TOKENS,
            "Number of generation tokens processed.",
            [(GENERATION_TOKENS + "_total", lab, generated_tokens)],
        ),
        (
            "gauge",
            CACHE_CONFIG,
            "Information of the LLMEngine CacheConfig",
            [(CACHE_CONFIG, _labels(cache), 1)],
        ),
    ]
    out: list[str] = []
    for kind, name, help_, samples in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        out += [f"{n}{lbl} {float(v)!r}" for n, lbl, v in samples]
    return "\n".join(out) + "\n"
