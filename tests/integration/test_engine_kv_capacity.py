"""Issue 53: the hf engine's KV capacity is real. With a budget far below what the offered requests
need they queue, the youngest running rows are preempted (and counted), and a preempted row resumes
by recompute: every completion still matches a plain forward pass token for token, and /metrics says
so under vLLM's names."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LOGPROB_ATOL = 1e-4


def _reference(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, 1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_small_kv_capacity_queues_preempts_and_stays_exact(tiny_model_dir: Path) -> None:
    from hpcrl.inference.engine import HFEngine
    from hpcrl.inference.prom import exposition
    from hpcrl.inference.protocol import SamplingParams
    from hpcrl.orchestrator.concurrency.prometheus import parse, server_load

    eng = HFEngine(str(tiny_model_dir), max_batch_size=8, max_model_len=64, kv_cache_tokens=96, device="cpu")
    peak, stop = [0], threading.Event()

    def watch() -> None:  # the budget holds between iterations (prompt + sampled tokens of running rows;
        while not stop.is_set():  # inside one, a row's just-sampled token is counted before its KV exists)
            with eng._weights_lock:
                peak[0] = max(peak[0], eng.kv_used())
            time.sleep(0.0005)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        rng = random.Random(0)
        futs = []
        for _ in range(12):  # 12 x (8..16 prompt + 30 sampled) tokens against a budget of 96
            prompt = [rng.randrange(3, eng.vocab_size) for _ in range(rng.choice([8, 12, 16]))]
            futs.append((prompt, eng.submit(prompt, SamplingParams(n=1, max_tokens=30, ignore_eos=True))))
        for prompt, fut in futs:
            (out,) = fut.result(timeout=300)
            assert len(out.token_ids) == 30
            want = _reference(eng.model, prompt, out.token_ids)
            assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < LOGPROB_ATOL
    finally:
        stop.set()
        w.join()
        eng.shutdown()
    assert eng.stats["preemptions"] > 0  # the budget bit: rows were evicted and recomputed
    assert peak[0] <= 96
    assert eng.stats["max_batch_size_seen"] < 8  # the budget, not the slots, bounded the batch
    text = exposition(
        "m", running=0, waiting=0, kv_used=eng.kv_used(), kv_capacity=eng.kv_capacity,
        preemptions=eng.stats["preemptions"], generated_tokens=eng.stats["generated_tokens"],
        max_model_len=64, max_batch_size=8,
    )  # fmt: skip
    ld = server_load(parse(text))
    assert (ld.preemptions, ld.kv_capacity_tokens, ld.kv_usage) == (eng.stats["preemptions"], 96, 0.0)
