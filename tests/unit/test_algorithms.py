"""[orchestrator.algo] at run time: each algorithm's credit on a small group of finished rollouts,
rae's baselines across groups and a checkpoint, the reference logprobs of opd / opsd, and the loss
mode each type asks of the trainer. Numbers are worked out by hand in the comments."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec
import pytest
import torch

from hpcrl.config.schema import AdvantageConfig
from hpcrl.config.sections.algo import AlgoConfig, FrozenModelConfig, LengthPenaltyConfig
from hpcrl.envs.base import Task
from hpcrl.errors import UserError
from hpcrl.orchestrator.algo import Credit, ReferenceScorer, reference
from hpcrl.orchestrator.algo.credit import member
from hpcrl.orchestrator.batch import StepCounts, judge_group
from hpcrl.orchestrator.buffer import Buffer, BufferConfig
from hpcrl.orchestrator.state import GroupRecord, OrchestratorState, Piece, RolloutRecord
from hpcrl.trainer.loss import LossParams, compute_loss


def piece(prompt: int, sampled: int, trace: int = 0, turns: int = 1) -> Piece:
    """`prompt` unsampled tokens, then `sampled` sampled ones split over `turns` runs, each run after
    one more unsampled (env) token when turns > 1."""
    mask = [False] * prompt
    per = sampled // turns
    for t in range(turns):
        mask += ([False] if t else []) + [True] * per
    ids = list(range(len(mask)))
    return Piece(input_ids=ids, loss_mask=mask, logprobs=[-0.5 if m else 0.0 for m in mask], trace=trace)


def rollout(i: int, reward: float, pieces: list[Piece] | None = None, **kw) -> RolloutRecord:
    pieces = pieces if pieces is not None else [piece(4, 2)]
    return RolloutRecord(index=i, pieces=pieces, reward=reward, **kw)


def group(rollouts: list[RolloutRecord], env: str = "e") -> GroupRecord:
    return GroupRecord(env=env, example_id=0, task_index=0, task_epoch=0, rollouts=rollouts)


def credit(kind: str = "grpo", **knobs) -> Credit:
    lp = knobs.pop("length_penalty", None)
    decay = knobs.pop("decay", 0.95)
    algo = AlgoConfig(type=kind, length_penalty=lp, decay=decay)  # type: ignore[arg-type]
    return Credit(algo, AdvantageConfig(**knobs))


def judge(c: Credit, g: GroupRecord) -> bool:
    return judge_group(g, Buffer({"e": 4}, BufferConfig()), c, StepCounts())


# -- the reward-based types -------------------------------------------------------------------
def test_grpo_group_mean_and_errored_rollouts() -> None:
    # usable rewards [1, 0, 0.5]: mean 0.5 -> [0.5, -0.5, 0]; the errored rollout is outside the baseline
    g = group([rollout(0, 1.0), rollout(1, 0.0), rollout(2, 9.0, error="boom"), rollout(3, 0.5)])
    assert judge(credit(), g)
    assert g.advantages == [0.5, -0.5, 0.0, 0.0] and g.trace_advantages is None


def test_grpo_length_penalty_measures_the_pieces() -> None:
    # rollout 0: 4 prompt + 2 sampled tokens, 1 turn; rollout 1: 4 prompt, 8 sampled in 2 turns with
    # 1 env token between -> output [2, 8], input [4, 5], turns [1, 2]
    r0, r1 = rollout(0, 1.0), rollout(1, 1.0, [piece(4, 8, turns=2)])
    assert [(m.output, m.input, m.turns) for m in (member(r0, 0), member(r1, 0))] == [(2, 4, 1), (8, 5, 2)]
    # defaults 0.25 / 0.1 / 0.1, pass rate 1: fraction = 0.25 x [0.25, 1] + 0.1 x [0.8, 1] + 0.1 x [0.5, 1]
    # = [0.0625 + 0.08 + 0.05, 0.25 + 0.1 + 0.1] = [0.1925, 0.45]; A = -(fraction - mean) = [0.12875, -0.12875]
    g = group([r0, r1])
    assert judge(credit(length_penalty=LengthPenaltyConfig()), g)
    assert g.advantages == pytest.approx([0.12875, -0.12875])
    # without the penalty the two equal rewards carry nothing: dropped (zero_advantage = drop)
    assert not judge(credit(), group([rollout(0, 1.0), rollout(1, 1.0, [piece(4, 8, turns=2)])]))


def test_max_rl_on_a_group() -> None:
    # [1, 0, 0, 0]: mean 0.25 -> [3, -1, -1, -1]; an all-zero group has mean 0: no signal, dropped
    g = group([rollout(i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])])
    assert judge(credit("max_rl"), g) and g.advantages == [3.0, -1.0, -1.0, -1.0]
    zero = group([rollout(i, 0.0) for i in range(2)])
    assert not judge(credit("max_rl"), zero) and zero.advantages == [0.0, 0.0]
    assert judge(credit("max_rl", zero_advantage="keep"), zero)


def test_rae_single_agent_is_reinforce_with_an_ema_baseline() -> None:
    # decay 0.5, one agent "e/0", baseline 0: rewards 1, 0 in rollout order
    # A = 1 - 0 = 1 (b = 0.5), A = 0 - 0.5 = -0.5 (b = 0.25); next group: reward 1 -> A = 0.75 (b = 0.625)
    c = credit("rae", decay=0.5)
    g = group([rollout(0, 1.0), rollout(1, 0.0)])
    assert judge(c, g) and g.advantages == [1.0, -0.5]
    assert c.state_dict() == {"rae_baselines": {"e/0": 0.25}}
    g2 = group([rollout(0, 1.0)])  # group_size 1 is fine for rae
    assert judge(c, g2) and g2.advantages == [0.75]
    assert c.baselines == {"e/0": 0.625}


def test_rae_keeps_one_baseline_per_agent_of_a_multi_agent_episode() -> None:
    # a zero-sum game whose first mover always wins: per episode trace 0 gets 1, trace 1 gets -1.
    # grpo compares trace j across the group: [1, 1] and [-1, -1] -> all zero, nothing learned.
    def episode(i: int) -> RolloutRecord:
        pieces = [piece(3, 2, trace=0), piece(3, 2, trace=1)]
        return rollout(i, 0.0, pieces, trace_rewards=[1.0, -1.0])

    assert not judge(credit(), group([episode(0), episode(1)]))
    # rae, decay 0.5: agent e/0: A = 1 (b 0.5), A = 1 - 0.5 = 0.5 (b 0.75)
    #                 agent e/1: A = -1 (b -0.5), A = -1 + 0.5 = -0.5 (b -0.75)
    c = credit("rae", decay=0.5)
    g = group([episode(0), episode(1)])
    assert judge(c, g)
    assert g.trace_advantages == [[1.0, -1.0], [0.5, -0.5]]
    assert g.advantages == [0.0, 0.0]  # per rollout: the mean of its traces' (metrics only)
    assert c.baselines == {"e/0": 0.75, "e/1": -0.75}


def test_rae_baselines_survive_a_checkpoint_exactly() -> None:
    c = credit("rae", decay=0.5)
    judge(c, group([rollout(0, 1.0), rollout(1, 0.0)]))
    state = OrchestratorState(
        step=1,
        checkpoint_step=1,
        world_size=1,
        batch_size=2,
        rollouts_per_example=2,
        buffer={},
        ready=[],
        progress={},
        evaluated=[],
        pending_steps=[],
        algo=c.state_dict(),
    )
    back = msgspec.json.decode(msgspec.json.encode(state), type=OrchestratorState)
    resumed = credit("rae", decay=0.5)
    resumed.load_state_dict(back.algo)
    a, b = group([rollout(0, 1.0)]), group([rollout(0, 1.0)])
    judge(c, a)
    judge(resumed, b)
    assert a.advantages == b.advantages == [0.75] and resumed.baselines == c.baselines
    # a checkpoint written before this field existed still loads (no baselines: 0)
    old = msgspec.json.encode({k: v for k, v in msgspec.structs.asdict(state).items() if k != "algo"})
    assert msgspec.json.decode(old, type=OrchestratorState).algo == {}


# -- sft and the ref_kl types -----------------------------------------------------------------
def test_sft_trains_every_completion_and_ref_kl_types_assign_no_credit() -> None:
    g = group([rollout(0, 0.0), rollout(1, 0.0, error="x")])
    assert judge(credit("sft"), g) and g.advantages == [1.0, 0.0]
    for kind in ("opd", "opsd"):  # equal rewards: kept all the same (the signal is per token)
        g = group([rollout(0, 0.3), rollout(1, 0.3)])
        assert judge(credit(kind), g) and g.advantages == [0.0, 0.0]


def test_loss_mode_of_each_type() -> None:
    modes = {t: AlgoConfig(type=t).loss_mode for t in ("grpo", "max_rl", "rae", "echo", "opd", "opsd", "sft")}
    assert modes == {
        "grpo": "rl",
        "max_rl": "rl",
        "rae": "rl",
        "echo": "rl",
        "opd": "opd",
        "opsd": "opd",
        "sft": "sft",
    }
    ref = FrozenModelConfig(base_url="http://t/v1", name="t")
    assert AlgoConfig(type="opd", teacher=ref).frozen == ref
    assert AlgoConfig(type="grpo").frozen is None


class FakeScore:
    """teacher_logprobs stand-in: logprob of token k of the request = -(k + 1) / 10."""

    def __init__(self) -> None:
        self.requests: list[list[int]] = []

    async def __call__(self, pool, ids: list[int]) -> list[float]:
        self.requests.append(list(ids))
        return [-(k + 1) / 10 for k in range(len(ids))]


def test_opd_scores_each_sequence_as_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeScore()
    monkeypatch.setattr(reference, "teacher_logprobs", fake)
    g = group([rollout(0, 0.0, [piece(2, 2)]), rollout(1, 0.0, error="x")])
    asyncio.run(ReferenceScorer(pool=None).score([g]))  # type: ignore[arg-type]
    assert fake.requests == [[0, 1, 2, 3]]  # the errored rollout is never scored
    assert g.rollouts[0].pieces[0].teacher_logprobs == [-0.1, -0.2, -0.3, -0.4]


def test_opsd_prepends_the_demonstration_and_keeps_the_sequence_logprobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeScore()
    monkeypatch.setattr(reference, "teacher_logprobs", fake)
    hints: list[str] = []

    def hint(text: str) -> list[int]:  # the system message as 3 ids
        hints.append(text)
        return [900, 901, 902]

    task = Task(example_id=7, prompt=[], answer="olleh", info={})
    scorer = ReferenceScorer(
        pool=None,  # type: ignore[arg-type]
        hint=hint,
        template="demo: {demonstration}",
        demo_key="answer",
        task_of=lambda g: task,
    )
    g = group([rollout(0, 0.0, [piece(2, 2)])])
    asyncio.run(scorer.score([g]))
    assert hints == ["demo: olleh"]
    assert fake.requests == [[900, 901, 902, 0, 1, 2, 3]]  # hint + the sequence, verbatim
    # the 7 logprobs are -0.1 .. -0.7; the sequence's are the last 4
    assert g.rollouts[0].pieces[0].teacher_logprobs == [-0.4, -0.5, -0.6, -0.7]


def test_opsd_demonstration_lookup() -> None:
    task = Task(example_id=3, prompt=[], answer="a", info={"demonstration": "d"})
    assert reference.demonstration(task, "demonstration", "e") == "d"  # info first
    assert reference.demonstration(task, "answer", "e") == "a"  # then a task field
    with pytest.raises(UserError, match="'solution'.*example 3"):
        reference.demonstration(task, "solution", "e")


def test_opsd_hint_is_the_chat_template_system_message(tiny_model_dir: Path) -> None:
    from hpcrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    ids = reference.chat_template_hint(tok)("Here: abc")
    text = tok.decode(ids)
    assert text == tok.apply_chat_template(
        [{"role": "system", "content": "Here: abc"}], tokenize=False, add_generation_prompt=False
    )
    assert "Here: abc" in text and not text.rstrip().endswith("assistant")


@pytest.mark.parametrize("kind", ["grpo", "max_rl", "rae", "opd", "opsd", "sft"])
def test_each_type_reaches_its_loss(kind: str) -> None:
    # two loss tokens sampled with probability 0.5, trainer unchanged (ratio 1), 2 tokens in the step
    lp = torch.full((2,), math.log(0.5), dtype=torch.float64, requires_grad=True)
    out = compute_loss(
        LossParams(mode=AlgoConfig(type=kind).loss_mode),  # type: ignore[arg-type]
        trainer_logprobs=lp,
        loss_mask=torch.ones(2, dtype=torch.bool),
        num_loss_tokens=2,
        inference_logprobs=torch.full((2,), math.log(0.5), dtype=torch.float64),
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
        teacher_logprobs=torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64),
    )
    out.loss.backward()
    grad = lp.grad.tolist()
    if kind in ("grpo", "max_rl", "rae"):  # -A / 2 per token: the advantages from the batch
        assert grad == pytest.approx([-0.5, 0.5])
    elif kind in ("opd", "opsd"):  # A = ref - sampler = [ln 0.25 - ln 0.5, 0] = [-ln 2, 0]; -A / 2
        assert grad == pytest.approx([math.log(2) / 2, 0.0])
    else:  # sft: cross entropy -(ln 0.5 + ln 0.5) / 2 = ln 2; gradient -1/2 per token
        assert float(out.loss) == pytest.approx(math.log(2)) and grad == pytest.approx([-0.5, -0.5])
