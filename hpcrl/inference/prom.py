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
# hpcrl's own: log lines the server's process could not write (its log's disk full, read-only or over
# quota: hpcrl.storage's tolerant handlers drop them), a counter labelled with the last refusal. The
# orchestrator's poller names it on the console and in `hpcrl status` (the server's log cannot).
LOG_LINES_LOST = "hpcrl:log_lines_lost"
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
    log_lost: tuple[int, str | None] = (0, None),
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
        _lost_row(lab, log_lost),
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


_LOST_HELP = "Log lines this server's process could not write (disk full, read-only, over quota)."


def _lost_row(base: str, log_lost: tuple[int, str | None]) -> tuple:
    n, why = log_lost
    lab = base[:-1] + "," + _labels({"reason": why or ""})[1:]
    return ("counter", LOG_LINES_LOST, _LOST_HELP, [(LOG_LINES_LOST + "_total", lab, n)])


def register_lost_lines(registry: object = None) -> None:
    """vLLM's /metrics (prometheus_client's registry in its API server process) reports this
    process's lost log lines under the embedded engine's name: a collector read at each scrape."""
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily

    from hpcrl.storage import dropped_log_lines

    class LostLines:
        def collect(self):  # noqa: ANN202 - prometheus_client's protocol
            n, why = dropped_log_lines()
            family = CounterMetricFamily(LOG_LINES_LOST, _LOST_HELP, labels=["reason"])
            family.add_metric([why or ""], n)
            yield family

    reg = registry if registry is not None else REGISTRY
    try:
        reg.register(LostLines())  # type: ignore[attr-defined]
    except ValueError:  # registered already (build_app called twice in one process)
        pass
