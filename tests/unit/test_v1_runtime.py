"""verifiers 0.4 runtimes per env (pure: no verifiers import) and WireEpisode branches -> samples."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hpcrl.envs.verifiers.v1_env import branch_turns
from hpcrl.envs.verifiers.v1_runtime import RUNTIMES, cannot_start, check_name, dry_run_check, effective
from hpcrl.errors import ConfigError
from hpcrl.orchestrator.stitching import pieces_from_turns


def test_names_are_verifiers_own() -> None:
    assert set(RUNTIMES) == {"subprocess", "docker", "podman", "apptainer", "prime", "modal", "e2b"}
    assert check_name("apptainer") is None
    assert check_name("singularity") == (
        "'singularity' is not a verifiers runtime; allowed: subprocess, docker, podman, apptainer, prime, modal, e2b"
    )


def test_container_runtime_needs_its_binary_and_hosted_its_key() -> None:
    none = lambda _: None  # noqa: E731 - nothing on PATH
    assert (
        cannot_start("apptainer", {}, none)
        == "runtime 'apptainer' needs `apptainer` on PATH and it is not there"
    )
    assert cannot_start("apptainer", {}, lambda b: f"/usr/bin/{b}") is None
    assert cannot_start("docker", {}, none) == "runtime 'docker' needs `docker` on PATH and it is not there"
    assert cannot_start("prime", {}, none) == "hosted runtime 'prime' needs PRIME_API_KEY in the environment"
    assert cannot_start("prime", {"PRIME_API_KEY": "k"}, none) is None
    assert cannot_start("modal", {"MODAL_TOKEN_ID": "i"}, none) == (
        "hosted runtime 'modal' needs MODAL_TOKEN_SECRET in the environment"
    )
    assert cannot_start("e2b", {"E2B_API_KEY": ""}, none) is not None  # empty is missing
    assert cannot_start("subprocess", {}, none) is None


def test_hosted_default_runs_locally_with_one_note_and_a_choice_wins() -> None:
    chosen, note = effective(None, "prime")
    assert chosen == "subprocess" and "hosted default runtime 'prime'" in (note or "")
    assert effective(None, "docker") == ("docker", None)
    assert effective("prime", "prime") == ("prime", None)
    assert effective("apptainer", "prime") == ("apptainer", None)


def _cfg(*runtimes: str | None, eval_runtimes: tuple[str | None, ...] = ()) -> NS:
    env = lambda i, r: NS(id=f"e{i}", name=None, runtime=r)  # noqa: E731
    return NS(
        orchestrator=NS(
            train=NS(env=[env(i, r) for i, r in enumerate(runtimes)]),
            eval=NS(env=[env(i, r) for i, r in enumerate(eval_runtimes)]) if eval_runtimes else None,
        )
    )


def test_dry_run_refuses_in_one_line_naming_env_and_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _: None)
    dry_run_check(_cfg(None, "subprocess"), {})  # nothing to start: passes
    with pytest.raises(ConfigError) as e:
        dry_run_check(_cfg("subprocess", "prime"), {})
    assert str(e.value) == (
        "orchestrator.train.env[1].runtime: env 'e1': hosted runtime 'prime' needs PRIME_API_KEY in the environment"
    )
    dry_run_check(_cfg("prime"), {"PRIME_API_KEY": "x"})
    with pytest.raises(
        ConfigError, match=r"^orchestrator\.eval\.env\[0\]\.runtime: env 'e0': runtime 'apptainer'"
    ):
        dry_run_check(_cfg(None, eval_runtimes=("apptainer",)), {})


def test_branch_turns_stitch_back_to_the_branch_exactly() -> None:
    ids = [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 6]  # prompt, sampled, tool reply, sampled, trailing scaffold
    mask = [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3 + [False]
    lps = [0.0] * 3 + [-0.1, -0.2] + [0.0] * 2 + [-0.3, -0.4, -0.5] + [0.0]
    turns = branch_turns(ids, mask, lps, policy=7)
    assert [t.completion_token_ids for t in turns] == [[10, 11], [12, 13, 14]]
    assert turns[1].prompt_token_ids == ids[:7] and turns[1].policy_steps == [7, 7, 7]
    (piece,) = pieces_from_turns(turns)
    assert piece.input_ids == ids[:10] and piece.loss_mask == mask[:10]
    assert piece.logprobs == pytest.approx(lps[:10])
    assert branch_turns([1, 2], [False, False], [0.0, 0.0], 0) == []


def test_sampling_passes_every_field_and_the_rollout_seed() -> None:
    pytest.importorskip("verifiers.v1")
    from hpcrl.envs.verifiers.v1_env import v1_sampling

    s = v1_sampling({"max_tokens": 16, "temperature": 0.7, "top_k": 5, "top_p": None}, seed=11)
    assert s.model_dump(exclude_none=True) == {"max_tokens": 16, "temperature": 0.7, "top_k": 5, "seed": 11}
