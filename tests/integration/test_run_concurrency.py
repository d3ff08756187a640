"""Issue 53 on a real `hpcrl run` of the tiny RL config: adaptive concurrency against an embedded
engine with a small KV capacity. The server's /metrics answers in Prometheus form under vLLM's names,
and metrics.jsonl carries the controller's decisions (concurrency/*) and the gauges per server
(inference/server0/*)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hpcrl.monitor.metrics import read_metrics
from hpcrl.orchestrator.concurrency.prometheus import parse, server_load
from hpcrl.paths import RunPaths
from tests.integration.tiny_run import TINY_RL

TABLES = """
[orchestrator.concurrency]
mode = "adaptive"
poll_interval_s = 0.5

[inference]
kv_cache_tokens = 256
"""
KEY = "test-concurrency-key"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_adaptive_run_reports_concurrency_and_server_gauges(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=4) + TABLES)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HPCRL_API_KEY": KEY},
    )  # fmt: skip
    scraped = None
    try:
        server_file = RunPaths(out).server_file(0)
        deadline = time.monotonic() + 300
        while scraped is None and proc.poll() is None and time.monotonic() < deadline:
            if server_file.exists():
                try:
                    url = json.loads(server_file.read_text())["base_url"]
                    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
                    if r.status_code == 200:
                        scraped = r
                except (ValueError, KeyError, httpx.HTTPError):
                    pass
            time.sleep(0.1)
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-4000:]
    assert scraped is not None, "the embedded server's /metrics never answered"
    assert scraped.headers["content-type"].startswith("text/plain")
    text = scraped.text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f"# TYPE {name} gauge" in text
    assert "# TYPE vllm:num_preemptions counter" in text and "vllm:num_preemptions_total{" in text
    assert server_load(parse(text)).kv_capacity_tokens == 256
    recs = [
        m
        for m in read_metrics(out / "metrics.jsonl")
        if m.get("role") == "orchestrator" and "batch/samples" in m
    ]
    assert len(recs) == 4
    for m in recs:
        for key in (
            "concurrency/limit", "concurrency/inflight", "concurrency/inflight_max", "concurrency/cancelled",
            "concurrency/turnover", "concurrency/preemptions", "concurrency/kv_capacity_tokens",
            "inference/server0/kv_cache_usage", "inference/server0/running", "inference/server0/waiting",
            "inference/server0/preemptions",
        ):  # fmt: skip
            assert key in m, (key, sorted(k for k in m if k.startswith(("concurrency", "inference"))))
        assert 1 <= m["concurrency/limit"] <= 256 and m["concurrency/kv_capacity_tokens"] == 256
    # the start: 256 KV tokens / 64 of max context = 4 in flight; the pool grew from there
    assert max(m["concurrency/turnover"] for m in recs) > 0
