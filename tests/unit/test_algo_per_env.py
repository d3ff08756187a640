"""Per-env algorithms (prime-rl's per-source `algo`, configs/debug/algo/mixed_grpo_opd.toml): the config
checks, each env's credit, the reference scorer routing and the rl / ref_kl mix (hand-checked)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from hpcrl.bus import TrainBatch
from hpcrl.config import schema
from hpcrl.config.loader import load
from hpcrl.config.sections.algo import AlgoConfig, FrozenModelConfig
from hpcrl.errors import ConfigError
from hpcrl.orchestrator.advantages import AdvantageConfig
from hpcrl.orchestrator.algo import Credit, References, reference
from hpcrl.orchestrator.algo.mixed import component_scales, reference_advantages
from hpcrl.orchestrator.packing import Sample
from hpcrl.orchestrator.state import Piece
from tests.conftest import rl_toml
from tests.unit.test_algorithms import FakeScore, group, piece, rollout

TEACHER = '{ name = "t", base_url = "http://localhost:8001/v1" }'
ENVS = (
    '[[orchestrator.train.env]]\nid = "reverse-text"\nname = "rt-grpo"\n'
    '[[orchestrator.train.env]]\nid = "reverse-text"\nname = "rt-opd"\n'
)


def config(tmp_path: Path, text: str, *flags: str):
    f = tmp_path / "cfg.toml"
    f.write_text(text)
    return load([str(f), "--output-dir", str(tmp_path / "out"), *flags]).config


def two_envs(algo: str) -> str:
    base = rl_toml()
    return (
        base[: base.index("[[orchestrator.train.env]]")] + ENVS + f"[orchestrator.train.env.algo]\n{algo}\n"
    )


def test_prime_rl_mixed_grpo_opd_sources_parse(tmp_path: Path) -> None:
    cfg = config(tmp_path, two_envs(f'type = "opd"\nteacher = {TEACHER}'))
    a, b = cfg.orchestrator.train.env
    assert a.algo is None and b.algo.type == "opd" and b.algo.teacher.base_url == "http://localhost:8001/v1"
    assert cfg.orchestrator.algo.type == "grpo"  # the trainer's loss: rl


@pytest.mark.parametrize(
    "algo,flags,path,why",
    [
        ('type = "opd"', (), "orchestrator.train.env[1].algo.teacher", "needs a teacher"),
        ('type = "sft"', (), "orchestrator.train.env[1].algo.type", "per env is not supported"),
        (
            'type = "echo"\nfilter = { import_path = "no_such_module_q.f" }',
            (),
            "orchestrator.train.env[1].algo.filter.import_path",
            "cannot be imported",
        ),
        ('type = "grpo"\ndecay = 0.5', (), "orchestrator.train.env[1].algo.decay", "type rae"),
        (  # the run an opd run, an env grpo: the trainer would run the opd loss on grpo tokens
            'type = "grpo"',
            ("--orchestrator.algo.type", "opd", "--orchestrator.algo.teacher.base-url", "http://x/v1"),
            "orchestrator.train.env[1].algo",
            "set orchestrator.algo to an rl type",
        ),
    ],
)
def test_refused_per_env_algos(tmp_path: Path, algo: str, flags: tuple, path: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, two_envs(algo), *flags)
    assert e.value.path == path and why in e.value.message, str(e.value)


def test_each_env_gets_its_own_credit() -> None:
    run = AlgoConfig(type="grpo")
    c = Credit(run, AdvantageConfig(), {"m": AlgoConfig(type="max_rl"), "o": AlgoConfig(type="opd")})
    rewards = [1.0, 0.0, 0.5, 0.5]  # mean 0.5
    g = group([rollout(i, r) for i, r in enumerate(rewards)], env="g")
    assert c.assign(g, g.rollouts) and g.advantages == [0.5, -0.5, 0.0, 0.0]  # grpo: r - mean
    m = group([rollout(i, r) for i, r in enumerate(rewards)], env="m")
    assert c.assign(m, m.rollouts) and m.advantages == [1.0, -1.0, 0.0, 0.0]  # max_rl: (r - mean) / mean
    o = group([rollout(i, r) for i, r in enumerate(rewards)], env="o")
    assert c.assign(o, o.rollouts) and o.advantages == [0.0] * 4  # opd: the signal is per token


def test_echo_as_one_envs_algo(tmp_path: Path) -> None:
    """echo on one env, grpo on the other: the same advantages (echo's rl part is grpo's), and only
    the echo env's pieces get cross-entropy weights (its tool tokens after the first response)."""
    cfg = config(tmp_path, two_envs('type = "echo"\nroles = { tool = { alpha = 0.3 } }'))
    assert cfg.orchestrator.train.env[1].algo.roles.tool.alpha == 0.3
    c = Credit(AlgoConfig(type="grpo"), AdvantageConfig(), {"x": cfg.orchestrator.train.env[1].algo})
    tool = 4  # hpcrl.orchestrator.env_roles.ROLES["tool"]

    def with_roles() -> Piece:
        p = piece(2, 4, turns=2)  # mask: F F T T F T T
        p.env_roles = bytes([tool, 0, 0, 0, tool, 0, 0])
        return p

    for env, weights in (("g", None), ("x", [0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0])):
        g = group([rollout(i, r, [with_roles()]) for i, r in enumerate([1.0, 0.0])], env=env)
        assert c.assign(g, g.rollouts) and g.advantages == [0.5, -0.5]
        assert [r.pieces[0].ce_weights for r in g.rollouts] == [weights, weights]


def test_rae_baselines_of_an_env_algo_are_checkpointed() -> None:
    c = Credit(AlgoConfig(type="grpo"), AdvantageConfig(), {"r": AlgoConfig(type="rae", decay=0.5)})
    g = group([rollout(0, 1.0)], env="r")
    c.assign(g, g.rollouts)  # b <- 0.5 * 0 + 0.5 * 1
    assert c.state_dict() == {"rae_baselines": {"r/0": 0.5}}
    fresh = Credit(AlgoConfig(type="grpo"), AdvantageConfig(), {"r": AlgoConfig(type="rae", decay=0.5)})
    fresh.load_state_dict(c.state_dict())
    assert fresh.for_env("r").baselines == {"r/0": 0.5}


def test_references_route_groups_to_their_envs_scorer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeScore()
    monkeypatch.setattr(reference, "teacher_logprobs", fake)
    scorer = reference.ReferenceScorer(pool=None)  # type: ignore[arg-type]
    refs = References(None, {"o": scorer, "g2": None})
    o, g, g2 = (group([rollout(0, 0.0, [piece(2, 2)])], env=e) for e in ("o", "g", "g2"))
    asyncio.run(refs.score([o, g, g2]))
    assert o.rollouts[0].pieces[0].teacher_logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert (
        g.rollouts[0].pieces[0].teacher_logprobs is None and g2.rollouts[0].pieces[0].teacher_logprobs is None
    )
    assert fake.requests == [[0, 1, 2, 3]]


def sample(env: str, adv: float, teacher: list[float] | None = None) -> Sample:
    return Sample(
        input_ids=np.arange(4),
        loss_mask=np.array([False, True, True, False]),
        inference_logprobs=np.array([0.0, -1.0, -2.0, 0.0], np.float32),
        advantage=adv,
        policy_version=0,
        example_id=0,
        env_name=env,
        temperature=1.0,
        reward=0.0,
        teacher_logprobs=None if teacher is None else np.array(teacher, np.float32),
    )


def test_reference_advantages_are_the_opd_losss_own() -> None:
    # opd's per-token advantage (hpcrl.trainer.loss, mode opd): teacher - inference on loss tokens
    g, o = reference_advantages([sample("g", 0.5), sample("o", 0.0, [0.0, -0.5, -3.0, -9.0])], {"o"})
    assert g.advantage == 0.5 and g.teacher_logprobs is None
    assert o.advantage.tolist() == [0.0, 0.5, -1.0, 0.0] and o.teacher_logprobs is None


def batch(envs: list[str], lens: list[int], mask: list[bool], adv: list[float]) -> TrainBatch:
    n = len(envs)
    return TrainBatch(
        step=1,
        rank=0,
        world_size=1,
        input_ids=np.zeros(sum(lens)),
        position_ids=np.zeros(sum(lens)),
        seq_lens=np.array(lens),
        loss_mask=np.array(mask),
        advantages=np.array(adv, np.float32),
        inference_logprobs=np.zeros(sum(lens)),
        policy_versions=np.zeros(n),
        temperatures=np.ones(n),
        env_names=envs,
        example_ids=np.arange(n),
        rewards=np.zeros(n),
        total_loss_tokens=int(sum(mask)),
    )


def test_component_scales_give_each_component_its_own_normalisation() -> None:
    # rank 0: a grpo sample (3 loss tokens) and an opd one (1); rank 1: an opd sample (2 loss tokens).
    # N = 6, N_rl = 3, N_kl = 3: rl x 2, kl x 2, so sum / N = sum_rl / 3 + sum_kl / 3 (prime-rl's).
    b0 = batch(["g", "o"], [4, 2], [False, True, True, True, False, True], [0, 1, 1, 1, 0, 0.5])
    b1 = batch(["o"], [3], [False, True, True], [0, -1, 2])
    assert component_scales([b0, b1], {"o"}) == (2.0, 2.0)
    assert b0.advantages.tolist() == [0, 2, 2, 2, 0, 1] and b1.advantages.tolist() == [0, -2, 4]
    # uneven: N = 4, N_rl = 3, N_kl = 1 -> rl x 4/3, kl x 4
    b = batch(["g", "o"], [4, 2], [False, True, True, True, False, True], [0, 3, 3, 3, 0, 0.5])
    assert component_scales([b], {"o"}) == pytest.approx((4 / 3, 4.0))
    assert b.advantages.tolist() == pytest.approx([0, 4, 4, 4, 0, 2])
    # the loss the trainer computes, sum(adv) / N, is prime-rl's sum over each component / its count
    assert float(b.advantages[b.loss_mask].sum()) / 4 == pytest.approx(9 / 3 + 0.5 / 1)


def test_frozen_model_of_an_env_algo_is_its_teacher() -> None:
    a = AlgoConfig(type="opd", teacher=FrozenModelConfig(base_url="http://t/v1"))
    assert a.frozen is a.teacher and a.action_loss == "ref_kl"


# prime-rl's configs/debug/algo/mixed_grpo_opd.toml, its sources and algo tables verbatim
MIXED = """
max_steps = 20
seq_len = 2048

[model]
name = "hpcrl/tiny-qwen3"

[orchestrator]
batch_size = 128
group_size = 16

[orchestrator.algo]
type = "grpo"

[orchestrator.train.sampling]
max_completion_tokens = 128

[[orchestrator.train.source]]
name = "reverse-text-grpo"

[orchestrator.train.source.env.taskset]
id = "reverse-text"

[orchestrator.train.source.env.agent.harness]
id = "null"

[[orchestrator.train.source]]
name = "reverse-text-opd"

[orchestrator.train.source.env.taskset]
id = "reverse-text"

[orchestrator.train.source.env.agent.harness]
id = "null"

[orchestrator.train.source.algo]
type = "opd"

[orchestrator.train.source.algo.teacher]
name = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"
base_url = "http://localhost:8001/v1"
"""


def test_prime_rl_mixed_config_sets_the_sources_algo(tmp_path: Path) -> None:
    from hpcrl.launch.checks import load as load_checked

    f = tmp_path / "mixed.toml"
    f.write_text(MIXED)
    cfg = load_checked(["@", str(f), "--output-dir", str(tmp_path / "out")], schema.Config).config
    grpo, opd = cfg.orchestrator.train.env
    assert (grpo.name, grpo.algo) == ("reverse-text-grpo", None)
    assert opd.name == "reverse-text-opd" and opd.algo.type == "opd"
    assert opd.algo.teacher.name == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"
    c = Credit(cfg.orchestrator.algo, cfg.orchestrator.advantage, {opd.name: opd.algo})
    assert c.for_env("reverse-text-opd").action_loss == "ref_kl" and c.for_env("reverse-text-grpo") is c
