"""Task samplers, env mixing, difficulty filter, staleness, and exact resume."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from hpcrl.orchestrator.buffer import Buffer, BufferConfig, EnvMixer, TaskRef, TaskSampler, is_stale


def test_sampler_epochs_are_permutations_and_deterministic():
    s = TaskSampler(5, seed=3)
    first = [s.next() for _ in range(10)]
    epoch0 = [i for i, e in first if e == 0]
    epoch1 = [i for i, e in first if e == 1]
    assert sorted(epoch0) == sorted(epoch1) == [0, 1, 2, 3, 4]
    assert epoch0 != epoch1  # reshuffled per epoch (for this seed)
    again = TaskSampler(5, seed=3)
    assert [again.next() for _ in range(10)] == first
    assert [TaskSampler(5, seed=4).next() for _ in range(5)] != first[:5]
    plain = TaskSampler(3, seed=0, shuffle=False)
    assert [plain.next()[0] for _ in range(4)] == [0, 1, 2, 0]


def test_sampler_state_round_trip():
    s = TaskSampler(7, seed=1)
    for _ in range(9):
        s.next()
    state = json.loads(json.dumps(s.state_dict()))
    assert state == {"epoch": 1, "cursor": 2, "num_tasks": 7}
    resumed = TaskSampler(7, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(12)] == [s.next() for _ in range(12)]
    with pytest.raises(ValueError, match="7 tasks"):
        TaskSampler(8, seed=1).load_state_dict(state)


def test_env_mixer_follows_ratios_exactly():
    m = EnvMixer([0.6, 0.4], seed=0)
    draws = [m.next() for _ in range(10)]
    assert Counter(draws) == {0: 6, 1: 4}
    for k in range(1, 11):  # every prefix is within one task of the target
        assert abs(draws[:k].count(0) - 0.6 * k) < 1
    m2 = EnvMixer([0.6, 0.4], seed=0)
    assert [m2.next() for _ in range(10)] == draws
    m3 = EnvMixer([1, 0, 1], seed=2)
    assert {m3.next() for _ in range(20)} == {0, 2}
    with pytest.raises(ValueError, match="env_ratios"):
        EnvMixer([0, 0], seed=0)


def test_difficulty_filter_drops_easy_and_hard_by_fraction():
    cfg = BufferConfig(
        online_difficulty_filtering=True,
        easy_threshold=0.8,
        hard_threshold=0.2,
        easy_fraction=0.0,
        hard_fraction=1.0,
    )
    b = Buffer({"a": 4}, cfg)
    assert b.accept_group([1, 1, 1, 0.5]) is False  # mean 0.875: easy, kept with p=0
    assert b.accept_group([0, 0, 0, 0]) is True  # hard, kept with p=1
    assert b.accept_group([1, 0]) is True  # mean 0.5: normal
    assert b.accept_group([0.8]) is False  # the threshold itself is easy
    m = b.metrics()
    assert (m["buffer/groups_seen"], m["buffer/groups_easy"], m["buffer/groups_dropped_easy"]) == (4, 2, 2)
    assert (m["buffer/groups_hard"], m["buffer/groups_dropped_hard"]) == (1, 0)

    # fraction 0.5: about half kept, reproducibly with the seed
    half = BufferConfig(online_difficulty_filtering=True, easy_fraction=0.5)
    b1, b2 = Buffer({"a": 1}, half), Buffer({"a": 1}, half)
    k1 = [b1.accept_group([1.0]) for _ in range(400)]
    assert k1 == [b2.accept_group([1.0]) for _ in range(400)]
    assert 150 < sum(k1) < 250

    off = Buffer({"a": 1}, BufferConfig(online_difficulty_filtering=False))
    assert off.accept_group([1.0]) and off.accept_group([0.0])


def test_staleness_is_strict_per_sample():
    # current step 10, bound 2: steps 8, 9, 10 are fine, 7 is stale
    assert not is_stale(8, 10, 2) and is_stale(7, 10, 2)
    b = Buffer({"a": 1}, BufferConfig(max_off_policy_steps=2))
    keep = b.filter_stale(np.array([10, 8, 7, 3]), current_step=10)
    assert keep.tolist() == [True, True, False, False]
    assert b.metrics()["buffer/samples_stale"] == 2 and b.metrics()["buffer/samples_checked"] == 4
    assert Buffer({"a": 1}, BufferConfig(max_off_policy_steps=0)).filter_stale([4, 5], 5).tolist() == [
        False,
        True,
    ]


def test_buffer_multi_env_stream_and_oversampling():
    b = Buffer({"sort": 3, "math": 5}, BufferConfig(env_ratios=(0.5, 0.5), oversampling_factor=1.5, seed=1))
    assert b.num_tasks_to_request(8) == 12 and b.num_tasks_to_request(3) == 5
    refs = b.next_tasks(16)
    assert Counter(r.env for r in refs) == {"sort": 8, "math": 8}
    sort_epoch0 = [r.index for r in refs if r.env == "sort" and r.epoch == 0]
    assert sorted(sort_epoch0) == [0, 1, 2]
    with pytest.raises(ValueError, match="env_ratios has 1 entries"):
        Buffer({"a": 1, "b": 1}, BufferConfig(env_ratios=(1.0,)))
    with pytest.raises(ValueError, match="hard_threshold"):
        BufferConfig(easy_threshold=0.2, hard_threshold=0.5)


def test_buffer_resume_continues_exactly_and_reissues_in_flight():
    cfg = BufferConfig(env_ratios=(2, 1), seed=5, online_difficulty_filtering=True, easy_fraction=0.5)
    sizes = {"a": 4, "b": 3}
    live = Buffer(sizes, cfg)
    first = live.next_tasks(6)
    for ref in first[:4]:  # two tasks still in flight at checkpoint time
        live.complete(ref)
        live.accept_group([1.0])
    state = json.loads(json.dumps(live.state_dict()))  # JSON-able, as the checkpoint stores it
    assert state["pending"] == [[r.env, r.index, r.epoch] for r in first[4:]]

    # the uninterrupted run: finishes the in-flight tasks, then continues
    cont = live.next_tasks(10)
    resumed = Buffer(sizes, cfg)
    resumed.load_state_dict(state)
    # after resume the in-flight tasks come first, then exactly the same stream
    assert resumed.next_tasks(12) == first[4:] + cont
    assert resumed.metrics()["buffer/tasks_issued"] == live.metrics()["buffer/tasks_issued"]
    assert [resumed.accept_group([1.0]) for _ in range(20)] == [live.accept_group([1.0]) for _ in range(20)]

    # every task of an epoch is handed out exactly once across the interruption
    seen = [(r.env, r.index, r.epoch) for r in first[:4]] + [
        (r.env, r.index, r.epoch) for r in first[4:] + cont
    ]
    assert len(seen) == len(set(seen))
    assert isinstance(first[0], TaskRef)
    with pytest.raises(ValueError, match="envs"):
        Buffer({"x": 4, "b": 3}, cfg).load_state_dict(state)
