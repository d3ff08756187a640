"""The hf engine's decode batch in-process: rows of different lengths joining and leaving a running
batch (slab relayouts, swap-removes, buffer growth) keep every row's logprobs equal to a plain forward
pass, and seeded rows reproduce whatever they were batched with."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    from hpcrl.inference.engine import HFEngine

    eng = HFEngine(str(tiny_model_dir), max_batch_size=8, device="cpu")
    eng._batch.min_capacity = 4  # force relayouts and growth within a few tokens
    yield eng
    eng.shutdown()


def _reference(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, 1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_rows_joining_and_leaving_keep_exact_logprobs(engine) -> None:
    from hpcrl.inference.protocol import SamplingParams

    rng = random.Random(0)
    futs = []
    for _ in range(24):  # staggered arrivals: short and long prompts, short and long completions
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.choice([2, 5, 17, 40]))]
        params = SamplingParams(n=rng.choice([1, 3]), max_tokens=rng.choice([1, 4, 9, 30]), ignore_eos=True)
        futs.append((prompt, engine.submit(prompt, params)))
        time.sleep(rng.random() * 0.01)
    for prompt, fut in futs:
        for out in fut.result(timeout=120):
            assert len(out.logprobs) == len(out.token_ids)
            want = _reference(engine.model, prompt, out.token_ids)
            assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < LOGPROB_ATOL
    assert engine.stats["max_batch_size_seen"] == 8
    assert engine.load() == {"running": 0, "waiting": 0}


def test_seeded_rows_do_not_depend_on_their_neighbours(engine) -> None:
    from hpcrl.inference.protocol import SamplingParams

    prompt = [5, 9, 11, 20, 7]
    seeded = SamplingParams(n=2, max_tokens=12, seed=3, ignore_eos=True, temperature=0.9, top_p=0.95)
    alone = engine.submit(prompt, seeded).result(timeout=60)
    crowd = [
        engine.submit([4] * (3 + i), SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True)) for i in range(6)
    ]
    again = engine.submit(prompt, seeded).result(timeout=60)
    for f in crowd:
        f.result(timeout=60)
    assert [o.token_ids for o in alone] == [o.token_ids for o in again]
    assert alone[0].token_ids != alone[1].token_ids  # choice i draws from seed + i
