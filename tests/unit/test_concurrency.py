"""Issue 53: the adaptive in-flight controller on recorded and synthetic /metrics traces (numbers
checked by hand in the comments), the one Prometheus reader on a recorded vLLM 0.33 text, the
embedded engine's KV budget and its exposition, and the pool's gate: a shed request is sent again
exactly once and answered exactly once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hpcrl.inference import kv_budget
from hpcrl.inference.prom import exposition
from hpcrl.orchestrator.concurrency.controller import Controller, growth_factor
from hpcrl.orchestrator.concurrency.limiter import Limiter
from hpcrl.orchestrator.concurrency.prometheus import ServerLoad, parse, server_load

RECORDED = Path(__file__).resolve().parents[1] / "golden" / "vllm_0_33_metrics.txt"


def load(usage: float = 0.3, running: int = 10, waiting: int = 0, preemptions: int = 0, cap: int = 65536):
    return ServerLoad(usage, running, waiting, None, preemptions, cap)


# -- the reader -------------------------------------------------------------------------------------------
def test_recorded_vllm_text_reads_into_the_controllers_facts() -> None:
    samples = parse(RECORDED.read_text())
    ld = server_load(samples)
    # the recorded scrape: 37 running, 5 waiting (4 for capacity), usage 0.8421875, 12 preemptions
    # (the counter's sample is vllm:num_preemptions_total), 4096 blocks x 16 tokens = 65536
    assert ld == ServerLoad(0.8421875, 37, 5, 4, 12, 65536)
    ttft = [s for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert [s.labels["le"] for s in ttft] == ["0.01", "0.1", "1.0", "10.0", "+Inf"]


def test_parser_survives_odd_lines_and_escapes() -> None:
    text = (
        '# HELP x y\nvllm:num_requests_running{model_name="a \\"q\\" b",engine="1"} 3 1700000000\n'
        "garbage line here\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc NaN\n"
    )
    s = parse(text)
    assert [(x.name, x.value) for x in s][:2] == [
        ("vllm:num_requests_running", 3.0),
        ("vllm:num_requests_running", 2.0),
    ]
    assert s[0].labels == {"model_name": 'a "q" b', "engine": "1"}
    assert server_load(s).running == 5 and server_load(s).kv_usage == 0.0  # NaN ignored


def test_embedded_exposition_reads_back_through_the_same_reader() -> None:
    text = exposition(
        "m", running=3, waiting=2, kv_used=96, kv_capacity=128, preemptions=7,
        generated_tokens=10, max_model_len=64, max_batch_size=8,
    )  # fmt: skip
    assert "vllm:num_preemptions_total" in text and "# TYPE vllm:num_preemptions counter" in text
    assert server_load(parse(text)) == ServerLoad(0.75, 3, 2, 2, 7, 128)


# -- the embedded engine's budget ---------------------------------------------------------------------------
def test_kv_budget_admits_fcfs_and_preempts_the_youngest() -> None:
    # capacity 100, 20 used by 2 rows: room for a 30 and a 40 (+1 token per row each: 20+30+3 <= 100,
    # 50+40+4 = 94 <= 100), not the 10 behind them once the 30 blocks (FCFS)
    assert kv_budget.admissible([30, 40, 10], used=20, cap=100, running=2) == 2
    assert kv_budget.admissible([90, 1], used=20, cap=100, running=2) == 0
    # rows of 50, 30, 40 tokens (120 > 100): drop the youngest (age 3: the 40) -> 80 fits
    assert kv_budget.victims([50, 30, 40], [(1.0, 0), (2.0, 0), (3.0, 0)], cap=100) == [2]
    assert kv_budget.victims([90, 90], [(1.0, 0), (1.0, 1)], cap=100) == [1]  # the oldest always stays
    assert kv_budget.capacity(None, 8, 64) == 512
    with pytest.raises(Exception, match="inference.kv_cache_tokens"):
        kv_budget.capacity(32, 8, 64)


# -- the controller ----------------------------------------------------------------------------------------
def test_growth_tapers_from_60_to_80_percent() -> None:
    assert growth_factor(0.5) == 1.25 and growth_factor(0.8) == 1.0 and growth_factor(0.95) == 1.0
    assert growth_factor(0.7) == pytest.approx(1.25**0.5)  # halfway: half the exponent


def test_start_is_capacity_over_max_context() -> None:
    c = Controller(min_inflight=1, max_inflight=1000)
    d = c.observe({"server0": load()}, inflight=0, max_model_len=2048, now=0.0)
    assert d is not None and d.limit == 32 == c.limit  # 65536 / 2048
    assert Controller(min_inflight=1, max_inflight=16).observe({"s": load()}, 0, 2048, 0.0).limit == 16
    assert Controller(min_inflight=1, max_inflight=1000, initial_inflight=7).limit == 7


def test_one_full_turnover_grows_by_a_quarter() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=40)
    c.observe({"s": load(usage=0.3, running=40)}, inflight=40, max_model_len=2048, now=0.0)
    while c.turnover < 1.0:  # the pool stays full: each completion grows by 1.25^(1/pool)
        c.completed(inflight=c.limit - 1, ok=True, now=1.0)
    # the cap is 40 x 1.25^turnover: one full turnover (sum of 1/pool = 1) is x1.25, and x1.25 is
    # also the most it may grow before the next poll
    assert c.cap == pytest.approx(min(40 * 1.25**c.turnover, 50.0)) and c.limit == 50
    for _ in range(200):  # short requests, many turnovers, no poll: still 50
        c.completed(inflight=c.limit - 1, ok=True, now=1.0)
    assert c.cap == 50.0
    c.observe({"s": load(usage=0.3, running=50)}, inflight=50, max_model_len=2048, now=2.0)
    c.completed(inflight=10, ok=True, now=2.0)  # the cap does not bind (11 < 0.9 x 50): no growth
    c.completed(inflight=c.limit - 1, ok=True, now=100.0)  # the last poll is stale (> 3 x 5 s): frozen
    assert c.cap == 50.0
    c.completed(inflight=c.limit - 1, ok=True, now=3.0)  # fresh and binding: x1.25^(1/50)
    assert c.cap == pytest.approx(50 * 1.25 ** (1 / 50))


def test_growth_stops_where_the_cap_stops_binding() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=40)
    c.observe({"s": load(usage=0.3, running=40)}, 40, 2048, 0.0)
    for t in range(400):  # only 40 ever in flight (the work runs out): binding needs 40 >= 0.9 x cap,
        c.completed(inflight=39, ok=True, now=t / 100)  # true at 44 (39.6), false at 45 (40.5)
        if t % 20 == 0:
            c.observe({"s": load(usage=0.3, running=40)}, 40, 2048, t / 100)
    assert 45 <= c.cap < 45 * 1.25 ** (1 / 40) and c.limit == 45


def test_no_growth_while_anything_waits() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=40)
    c.observe({"s": load(usage=0.3, waiting=1)}, 40, 2048, 0.0)
    for _ in range(80):
        c.completed(39, True, 1.0)
    assert c.limit == 40


def test_no_growth_while_requests_are_stuck_on_the_way() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=40)
    c.observe({"s": load(usage=0.3, running=19)}, 40, 2048, 0.0)  # 19 < 0.5 x 40 reached the server
    for _ in range(80):
        c.completed(39, True, 1.0)
    assert c.limit == 40
    c.observe({"s": load(usage=0.3, running=20)}, 40, 2048, 2.0)  # 20 of 40: growth again
    c.completed(39, True, 3.0)
    assert c.cap > 40


def test_preemptions_cut_to_80_percent_and_a_repeat_to_half() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=50)
    c.observe({"s": load(preemptions=3)}, 50, 2048, 0.0)  # the first poll is the baseline
    d = c.observe({"s": load(preemptions=5)}, 50, 2048, 5.0)
    assert (d.limit, d.cancel) == (40, 10) and c.signal == "hard"  # int(50 x 0.8), shed 50 - 40
    assert c.observe({"s": load(preemptions=9)}, 45, 2048, 10.0) is None  # draining: stale churn
    c.observe({"s": load(preemptions=9)}, 40, 2048, 15.0)  # drained: calm, escalation armed
    d = c.observe({"s": load(preemptions=10)}, 40, 2048, 20.0)
    assert (d.limit, d.cancel) == (20, 20)  # a repeat within the grace: x0.5
    assert c.cuts == 2 and c.new_preemptions == 7


def test_a_persistent_queue_cuts_to_90_percent() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=50)
    for t in range(5):  # waiting 8 > 0.5 x running 10: five polls are not persistent yet
        assert c.observe({"s": load(running=10, waiting=8)}, 50, 2048, float(t)) is None
    d = c.observe({"s": load(running=10, waiting=8)}, 50, 2048, 5.0)
    assert (d.limit, d.cancel, d.reason) == (45, 5, "queue")


def test_kv_trims_soft_above_80_and_cancel_above_90() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=60)
    d = c.observe({"s": load(usage=0.85)}, 60, 2048, 0.0)
    assert (d.limit, d.cancel) == (49, 0)  # int(60 x 0.7 / 0.85) = int(49.4), let it drain
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=60)
    d = c.observe({"s": load(usage=0.95)}, 60, 2048, 0.0)
    assert (d.limit, d.cancel) == (44, 16)  # int(60 x 0.7 / 0.95) = int(44.2)


def test_recorded_scrape_trims() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=42)
    d = c.observe({"s": server_load(parse(RECORDED.read_text()))}, 42, 2048, 0.0)
    assert (d.limit, d.cancel) == (34, 0)  # usage 0.842: int(42 x 0.7 / 0.8421875) = int(34.9)


def simulate(ctl: Controller, cap_tokens: int, per_request: int, life: int, ticks: int) -> list[tuple]:
    """A synthetic server: every admitted request holds `per_request` KV tokens for `life` ticks; over
    the capacity the youngest are preempted (counted, they stay in flight) as vLLM would."""
    trace, preempted, inflight = [], 0, 0
    for t in range(ticks):
        inflight = ctl.limit  # the pool keeps the cap full (plenty of work)
        used = inflight * per_request
        if used > cap_tokens:
            preempted += (used - cap_tokens) // per_request + 1
        d = ctl.observe(
            {"s": ServerLoad(min(1.0, used / cap_tokens), inflight, 0, None, preempted, cap_tokens)},
            inflight, 2048, float(t),
        )  # fmt: skip
        if d is not None and d.cancel:
            inflight -= d.cancel
        for _ in range(max(1, inflight // life)):  # completions this tick
            ctl.completed(inflight - 1, True, float(t))
        trace.append((t, ctl.limit, used / cap_tokens, preempted))
    return trace


def test_grows_to_the_capacity_and_settles_without_preemptions() -> None:
    # 65536 tokens, 512 per request: 128 requests fill it. Start at 65536 / 2048 = 32, grow while
    # usage < 80 %: the cap must settle between 60 % (77) and 80 % (102) of 128, never preempting.
    ctl = Controller(min_inflight=1, max_inflight=4096)
    trace = simulate(ctl, 65536, 512, life=10, ticks=400)
    assert trace[0][1] == 32
    assert 77 <= trace[-1][1] <= 103 and trace[-1][3] == 0
    assert max(u for _, _, u, _ in trace) <= 0.81


def test_backs_off_when_the_start_overshoots() -> None:
    # started at 200 (a wrong initial_inflight): 200 x 512 > 65536 preempts; cuts bring it under
    ctl = Controller(min_inflight=1, max_inflight=4096, initial_inflight=200)
    trace = simulate(ctl, 65536, 512, life=10, ticks=300)
    assert trace[-1][1] <= 128 and ctl.cuts >= 1
    late = [p for t, _, _, p in trace if t >= 150]
    assert late[-1] == late[0]  # no preemption storm after the back-off


def test_never_exceeds_max_inflight() -> None:
    ctl = Controller(min_inflight=1, max_inflight=64)
    trace = simulate(ctl, 10**7, 10, life=5, ticks=300)  # a huge server: growth is only bounded by 64
    assert max(lim for _, lim, _, _ in trace) == 64


def test_fixed_mode_keeps_the_cap_and_reports() -> None:
    ctl = Controller(min_inflight=1, max_inflight=256, adaptive=False)
    trace = simulate(ctl, 65536, 512, life=10, ticks=20)
    assert {lim for _, lim, _, _ in trace} == {256} and ctl.new_preemptions > 0 and ctl.signal == "hard"


def test_per_server_caps_follow_capacity() -> None:
    c = Controller(min_inflight=1, max_inflight=1000, initial_inflight=30)
    c.observe({"a": load(cap=1000), "b": load(cap=2000)}, 0, 100, 0.0)
    assert c.per_server(["a", "b"]) == {"a": 10, "b": 20}


# -- the gate: shed requests go again, exactly once --------------------------------------------------------
def test_limiter_resizes_and_serves_in_order() -> None:
    async def main() -> list[int]:
        lim, order = Limiter(2), []
        a, b = await lim.acquire(), await lim.acquire()
        waits = [asyncio.ensure_future(lim.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        assert lim.count == 2 and not any(w.done() for w in waits)
        lim.set_limit(3)
        await asyncio.sleep(0)
        assert [w.done() for w in waits] == [True, False, False]
        lim.release(a)
        lim.release(b)
        await asyncio.sleep(0)
        assert all(w.done() for w in waits) and lim.count == 3
        return order

    asyncio.run(main())


def test_a_shed_request_is_sent_again_exactly_once() -> None:
    from hpcrl.orchestrator.pool import ServerPool

    class Fake:
        base_url = "http://fake"

        def __init__(self) -> None:
            self.calls: dict[int, int] = {}
            self.release = asyncio.Event()

        async def completion(self, rid: int) -> dict:
            self.calls[rid] = self.calls.get(rid, 0) + 1
            await self.release.wait()
            return {"id": rid}

        async def aclose(self) -> None:
            pass

    async def main() -> None:
        pool = ServerPool(["http://127.0.0.1:9"], model="m", timeout=5, max_concurrent=4)
        fake = Fake()
        pool.clients = [fake]
        answers: list[int] = []

        async def one(rid: int) -> None:
            answers.append((await pool.call(0, "completion", rid))["id"])
            await asyncio.sleep(0)

        tasks = []
        for rid in range(6):  # 4 in flight, 2 waiting
            tasks.append(asyncio.ensure_future(one(rid)))
            await asyncio.sleep(0.01)
        assert pool.limiter.count == 4 and sorted(fake.calls) == [0, 1, 2, 3]
        pool.limiter.set_limit(2)
        assert pool.limiter.shed_youngest(2) == 2  # requests 2 and 3, the youngest in flight
        await asyncio.sleep(0.01)
        assert pool.limiter.count == 2  # 2, 3 wait again, at the head of the line
        fake.release.set()
        await asyncio.gather(*tasks)
        assert sorted(answers) == [0, 1, 2, 3, 4, 5]  # every request answered once
        assert fake.calls == {0: 1, 1: 1, 2: 2, 3: 2, 4: 1, 5: 1}  # the shed ones sent exactly twice
        assert pool.limiter.shed_total == 2 and pool.limiter.count == 0

    asyncio.run(main())


def test_limiter_weighs_sequences_and_lets_a_heavy_request_go_alone() -> None:
    async def main() -> None:
        lim = Limiter(6)
        a = await lim.acquire(4)  # a request for 4 completions
        b = asyncio.ensure_future(lim.acquire(4))  # 4 + 4 > 6: waits
        c = asyncio.ensure_future(lim.acquire(1))  # fits, but FCFS: behind b
        await asyncio.sleep(0)
        assert lim.count == 4 and not b.done() and not c.done()
        lim.release(a)
        await asyncio.sleep(0)
        assert b.done() and c.done() and lim.count == 5
        lim.release(b.result())
        lim.release(c.result())
        big = await lim.acquire(10)  # heavier than the limit: alone, it goes
        assert lim.count == 10
        d = asyncio.ensure_future(lim.acquire(1))
        await asyncio.sleep(0)
        assert not d.done()
        lim.release(big)
        await asyncio.sleep(0)
        assert d.done()

    asyncio.run(main())


def test_replay_of_a_recorded_embedded_engine_trace() -> None:
    """tests/golden/hf_engine_metrics_trace.jsonl: the embedded engine's /metrics every 0.5 s while a
    fixed cap of 64 single-turn demo rollouts ran against 512 KV tokens (scripts/bench/concurrency.py's
    server; a busy 2-core machine). Replayed into a controller started at the same 64."""
    import json

    trace = [json.loads(line) for line in (RECORDED.parent / "hf_engine_metrics_trace.jsonl").open()]
    loads = [server_load(parse(r["text"])) for r in trace]
    assert [ld.preemptions for ld in loads] == [0, 11, 11, 11, 11, 11, 17, 18, 18]
    assert {ld.kv_capacity_tokens for ld in loads} == {512}
    c = Controller(min_inflight=1, max_inflight=256, initial_inflight=64)
    # poll 0: 0 of 64 requests at the server (the HTTP front lags): no growth, no preemption yet
    assert c.observe({"server0": loads[0]}, trace[0]["inflight"], 64, trace[0]["t"]) is None
    assert not c.can_grow and c.limit == 64
    decisions = [None] + [
        c.observe({"server0": ld}, r["inflight"], 64, r["t"]) for ld, r in zip(loads[1:], trace[1:])
    ]
    # poll 1: 11 new preemptions at 64 in flight -> int(64 x 0.8) = 51, the 13 youngest cancelled
    assert (decisions[1].limit, decisions[1].cancel) == (51, 13)
    # then the recorded pool (a fixed cap) never drains under 51: further preemptions are stale churn
    assert decisions[2:] == [None] * 7 and c.limit == 51 and c.cuts == 1 and c.new_preemptions == 18
