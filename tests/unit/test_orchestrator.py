"""Orchestrator pure parts: token stitching, staleness, filters, eval scores, checkpoint state."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from hpcrl.bus import TrainBatch, decode, encode
from hpcrl.config.schema import AdvantageConfig
from hpcrl.config.sections.algo import AlgoConfig
from hpcrl.envs.base import Turn
from hpcrl.orchestrator.algo import Credit
from hpcrl.orchestrator.batch import StepCounts, build_batches, fill_batch, judge_group, to_samples
from hpcrl.orchestrator.buffer import Buffer, BufferConfig
from hpcrl.orchestrator.eval import avg_and_pass_at_k
from hpcrl.orchestrator.rollout import derive_seed, env_response_ids, pieces_from_turns, stitch_prompt
from hpcrl.orchestrator.state import (
    GroupRecord,
    OrchestratorState,
    Piece,
    RolloutRecord,
    load_part,
    save_part,
)
from hpcrl.paths import RunPaths


# -- stitching ---------------------------------------------------------------------------------
def turn(prompt: list[int], completion: list[int], step: int = 0) -> Turn:
    return Turn(
        text="",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        policy_steps=[step],
    )


def test_turns_that_extend_each_other_stitch_into_one_sample() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn(stitch_prompt([1, 2, 3], [10, 11], [4, 5]), [12], step=1)
    (piece,) = pieces_from_turns([t1, t2])
    assert piece.input_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert piece.loss_mask == [False, False, False, True, True, False, False, True]
    assert piece.logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]


def test_turns_that_do_not_extend_each_other_become_one_sample_per_turn() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn([1, 2, 3, 99, 4], [12])  # history re-rendered: 10, 11 became 99
    pieces = pieces_from_turns([t1, t2])
    assert [p.input_ids for p in pieces] == [[1, 2, 3, 10, 11], [1, 2, 3, 99, 4, 12]]
    assert [p.loss_mask for p in pieces] == [[False] * 3 + [True] * 2, [False] * 5 + [True]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tok, msgs, gen: bool) -> list[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_stitched_prompt_equals_the_chat_template_of_the_whole_conversation(tokenizer) -> None:
    tok = tokenizer
    msgs = [{"role": "system", "content": "Sort names."}, {"role": "user", "content": "Sort: Bea, Ada"}]
    prompt = _ids(tok, msgs, gen=True)
    # What the model sampled: its reply and the end-of-turn token (the server stops on it).
    completion = tok("Ada\nBea<|im_end|>", add_special_tokens=False)["input_ids"]
    history = [*msgs, {"role": "assistant", "content": "Ada\nBea"}]
    full = [*history, {"role": "user", "content": "Add: Cy"}]
    env_ids = env_response_ids(tok, history, full, None, completion)
    assert env_ids is not None
    assert stitch_prompt(prompt, completion, env_ids) == _ids(tok, full, gen=True)


def test_stitching_keeps_sampled_ids_where_the_template_would_tokenize_differently(tokenizer) -> None:
    """The documented difference: a non-canonical tokenization the model sampled is kept as sampled
    (training on what the policy produced), so only the text - not the ids - matches the template."""
    tok = tokenizer
    msgs = [{"role": "user", "content": "Say hello"}]
    prompt = _ids(tok, msgs, gen=True)
    chars = [tok.convert_tokens_to_ids(c) for c in "hello"]  # one token per letter: not how BPE splits it
    completion = [*chars, tok.convert_tokens_to_ids("<|im_end|>")]
    history = [*msgs, {"role": "assistant", "content": "hello"}]
    full = [*history, {"role": "user", "content": "again"}]
    stitched = stitch_prompt(prompt, completion, env_response_ids(tok, history, full, None, completion))
    assert tok.decode(stitched) == tok.decode(_ids(tok, full, gen=True))
    assert stitched[len(prompt) : len(prompt) + len(completion)] == completion


def test_no_exact_stitching_when_the_reply_is_not_what_the_template_renders(tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    history = [*msgs, {"role": "assistant", "content": "something else"}]
    completion = tokenizer("hello<|im_end|>", add_special_tokens=False)["input_ids"]
    assert (
        env_response_ids(tokenizer, history, [*history, {"role": "user", "content": "x"}], None, completion)
        is None
    )


def test_request_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(0, "train", 3, "env", 0, 7, 1) == derive_seed(0, "train", 3, "env", 0, 7, 1)
    assert derive_seed(0, "train", 3, "env", 0, 7, 1) != derive_seed(0, "train", 3, "env", 0, 7, 2)
    assert 0 <= derive_seed("x") < 2**31


# -- groups, staleness, packing ----------------------------------------------------------------
def rollout(i: int, reward: float, version: int = 0, error: str | None = None) -> RolloutRecord:
    pieces = (
        []
        if error
        else [
            Piece(
                input_ids=[1, 2, 3, 4], loss_mask=[False, False, True, True], logprobs=[0.0, 0.0, -0.1, -0.2]
            )
        ]
    )
    return RolloutRecord(
        index=i,
        pieces=pieces,
        reward=reward,
        policy_version=version,
        completion_tokens=2,
        num_turns=1,
        error=error,
    )


def group(example_id: int, rewards: list[float], version: int = 0) -> GroupRecord:
    return GroupRecord(
        env="e",
        example_id=example_id,
        task_index=example_id,
        task_epoch=0,
        rollouts=[rollout(i, r, version) for i, r in enumerate(rewards)],
    )


def test_stale_samples_are_dropped_and_counted() -> None:
    buf = Buffer({"e": 10}, BufferConfig(max_off_policy_steps=2))
    fresh, stale = group(0, [1.0, 0.0], version=7), group(1, [1.0, 0.0], version=6)
    counts = StepCounts()
    for g in (fresh, stale):
        assert judge_group(g, buf, Credit(AlgoConfig(), AdvantageConfig()), counts)
    # Batch 10 is trained from policy 9: lag 2 (policy 7) is allowed, lag 3 (policy 6) is not.
    samples = to_samples(
        [stale, fresh], step=10, max_off_policy_steps=2, temperature=1.0, buffer=buf, counts=counts
    )
    assert counts.stale_dropped == 2
    assert [s.example_id for s in samples] == [0, 0] and [s.policy_version for s in samples] == [7, 7]


def test_advantages_filters_and_errored_rollouts() -> None:
    buf = Buffer({"e": 10}, BufferConfig())
    counts = StepCounts()
    g = GroupRecord(
        env="e",
        example_id=0,
        task_index=0,
        task_epoch=0,
        rollouts=[rollout(0, 1.0), rollout(1, 0.0, error="boom"), rollout(2, 0.0)],
    )
    assert judge_group(g, buf, Credit(AlgoConfig(), AdvantageConfig()), counts)
    assert g.advantages == [0.5, 0.0, -0.5]  # the errored rollout is outside the baseline
    uniform = group(1, [0.3, 0.3])
    assert not judge_group(uniform, buf, Credit(AlgoConfig(), AdvantageConfig(zero_advantage="drop")), counts)
    assert counts.filtered["zero_advantage"] == 1
    assert uniform.advantages == [0.0, 0.0]  # ready to be the last-resort filler of a starved batch
    hard = Buffer({"e": 10}, BufferConfig(online_difficulty_filtering=True))
    too_hard = group(2, [0.0, 0.1])
    assert not judge_group(too_hard, hard, Credit(AlgoConfig(), AdvantageConfig()), counts)
    assert too_hard.advantages is None  # difficulty-filtered groups are never used
    assert counts.filtered["hard"] == 1
    sft = group(3, [0.0, 0.0])
    assert judge_group(
        sft, buf, Credit(AlgoConfig(type="sft"), AdvantageConfig()), counts
    ) and sft.advantages == [1.0, 1.0]


def test_fill_with_uniform_takes_just_enough_groups() -> None:
    from hpcrl.orchestrator.batch import fill_with_uniform

    ready = [group(0, [1.0, 0.0])]
    uniform = [group(i, [0.5, 0.5, 0.5]) for i in (1, 2, 3)]
    out, n = fill_with_uniform(ready, uniform, missing=4)  # 3 + 3 rollouts cover 4
    assert n == 2 and [g.example_id for g in out] == [0, 1, 2]
    assert fill_with_uniform(ready, uniform, missing=0) == (ready, 0)


def test_fill_batch_takes_whole_groups_and_carries_the_rest() -> None:
    groups = [group(i, [1.0, 0.0]) for i in range(4)]
    taken, rest = fill_batch(groups, batch_size=4)
    assert [g.example_id for g in taken] == [0, 1] and [g.example_id for g in rest] == [2, 3]


def test_batches_have_global_loss_token_count() -> None:
    buf = Buffer({"e": 10}, BufferConfig())
    groups = [group(i, [1.0, 0.0]) for i in range(3)]
    for g in groups:
        judge_group(g, buf, Credit(AlgoConfig(), AdvantageConfig()), StepCounts())
    samples = to_samples(groups, 1, 8, 1.0, buf, StepCounts())
    batches, _ = build_batches(samples, step=1, world_size=2, seq_len=16, created_at=0.0)
    assert [b.rank for b in batches] == [0, 1]
    assert all(b.total_loss_tokens == 12 for b in batches)
    assert sum(b.num_loss_tokens for b in batches) == 12


def test_avg_and_pass_at_k() -> None:
    groups = [[rollout(0, 1.0), rollout(1, 0.2)], [rollout(0, 0.5), rollout(1, 0.0, error="x")]]
    avg, passed = avg_and_pass_at_k(groups)
    assert avg == pytest.approx((1.0 + 0.2 + 0.5 + 0.0) / 4) and passed == 0.5


# -- checkpoint state --------------------------------------------------------------------------
def draw(buf: Buffer, n: int) -> list[tuple[str, int, int]]:
    refs = buf.next_tasks(n)
    for r in refs:
        buf.complete(r)
    return [(r.env, r.index, r.epoch) for r in refs]


def test_state_round_trip_continues_the_same_task_stream(tmp_path: Path) -> None:
    sizes = {"a": 5, "b": 3}
    cfg = BufferConfig(env_ratios=(2.0, 1.0), seed=7)
    buf = Buffer(sizes, cfg)
    for _ in range(4):  # steps 1..4, crossing epochs
        draw(buf, 3)
    batch = TrainBatch(
        step=4,
        rank=0,
        world_size=1,
        input_ids=[1, 2, 3],
        position_ids=[0, 1, 2],
        seq_lens=[3],
        loss_mask=[False, True, True],
        advantages=[0.5] * 3,
        inference_logprobs=[0, -0.1, -0.2],
        policy_versions=[3],
        temperatures=[1.0],
        env_names=["a"],
        example_ids=[2],
        rewards=[1.0],
        total_loss_tokens=2,
        created_at=0.0,
    )
    blob = encode(batch)
    carry = group(9, [1.0, 0.0])
    carry.advantages = [0.5, -0.5]
    state = OrchestratorState(
        step=4,
        checkpoint_step=3,
        world_size=1,
        batch_size=6,
        rollouts_per_example=2,
        buffer=buf.state_dict(),
        ready=[carry],
        progress={"total_samples": 24},
        evaluated=[0],
        pending_steps=[4],
    )
    paths = RunPaths(tmp_path)
    save_part(paths, state, {4: [blob]})
    assert (paths.orchestrator_ckpt_dir(3) / "DONE").is_file()
    expected = [draw(buf, 3) for _ in range(3)]

    loaded, pending = load_part(paths, 3)
    assert msgspec.json.encode(loaded) == msgspec.json.encode(state)
    assert (
        pending == {4: [blob]} and encode(decode(pending[4][0], TrainBatch)) == blob
    )  # re-publish is bit-exact
    resumed = Buffer(sizes, cfg)
    resumed.load_state_dict(loaded.buffer)
    assert [draw(resumed, 3) for _ in range(3)] == expected
    assert np.array_equal(decode(pending[4][0], TrainBatch).example_ids, [2])


def test_branching_makes_one_sample_per_turn_even_when_they_stitch() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn(stitch_prompt([1, 2, 3], [10, 11], [4, 5]), [12], step=1)
    pieces = pieces_from_turns([t1, t2], branching=True)
    assert [p.input_ids for p in pieces] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 11, 4, 5, 12]]
    assert [p.loss_mask for p in pieces] == [[False] * 3 + [True] * 2, [False] * 7 + [True]]
