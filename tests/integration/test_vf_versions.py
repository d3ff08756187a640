"""verifiers 0.3 (classic) and 0.4 (v1) cannot share a venv: an env written for the other one is
refused in one line naming the env and the version it needs (issue 29). Runs in whichever venv
pytest runs in: the main venv (verifiers 0.4) and the 0.3 venv of scripts/verifiers03_check.sh."""

from __future__ import annotations

import pytest

from hpcrl.envs.registry import EnvSpecError, load_environment
from hpcrl.envs.verifiers import versions as vf_versions

HAVE = vf_versions.major_minor(vf_versions.installed())
V1 = "tests.integration.vf1_taskset_fixture"
CLASSIC = "tests.integration.vf_env_fixture:load_environment"


def test_the_line_names_env_version_and_fix() -> None:
    line = vf_versions.needs("my-env", "0.3", "0.4.0")
    assert line.startswith("environment 'my-env' is written for verifiers 0.3")
    assert "this venv has verifiers 0.4.0" in line and "'verifiers>=0.3.1,<0.4'" in line
    assert "'verifiers==0.4.0'" in vf_versions.needs(
        "e", "0.4", None
    ) and "no verifiers" in vf_versions.needs("e", "0.4", None)


def test_explain_recognises_the_other_api() -> None:
    missing_v1 = ModuleNotFoundError("No module named 'verifiers.v1'", name="verifiers.v1")
    assert "written for verifiers 0.4" in vf_versions.explain("e", missing_v1)
    gone = AttributeError("module 'verifiers' has no attribute 'SingleTurnEnv'")
    if HAVE is not None and HAVE >= (0, 4):
        assert "written for verifiers 0.3" in vf_versions.explain("e", gone)
    assert vf_versions.explain("e", AttributeError("'NoneType' object has no attribute 'x'")) is None


@pytest.mark.slow
@pytest.mark.skipif(HAVE is None, reason="verifiers not installed")
def test_a_v1_taskset_is_refused_in_one_line() -> None:
    with pytest.raises(EnvSpecError) as e:
        load_environment(V1)
    msg = str(e.value)
    assert "\n" not in msg and V1 in msg
    if HAVE < (0, 4):
        assert "written for verifiers 0.4" in msg and "'verifiers==0.4.0'" in msg
    else:  # under 0.4 a v1 taskset runs, but verifiers imports it by its top-level module name only
        assert "top-level module name" in msg and "id = 'vf1_taskset_fixture'" in msg


@pytest.mark.skipif(HAVE is None or HAVE < (0, 4), reason="needs verifiers 0.4")
def test_a_v1_taskset_loads_under_0_4(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from hpcrl.envs.verifiers.v1_env import V1Environment

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "vf1_envs"))
    env = load_environment("vf1_tool_env", num_tasks=5)
    assert isinstance(env, V1Environment) and env.proc is None  # its server starts in load_envs
    assert [t.example_id for t in env.tasks("train")] == [0, 1, 2, 3, 4]
    assert env.tasks("eval")[2].info["_vf_task_data"]["a"] == 2
    assert env.config.agent.runtime.type == "subprocess"  # the hosted default, run locally


@pytest.mark.skipif(
    HAVE is None or HAVE < (0, 4), reason="needs verifiers 0.4 (the main venv: scripts/setup.sh)"
)
def test_a_classic_env_under_0_4_is_refused_in_one_line() -> None:
    with pytest.raises(EnvSpecError) as e:
        load_environment(CLASSIC)
    msg = str(e.value)
    assert "\n" not in msg and "written for verifiers 0.3" in msg and "'verifiers>=0.3.1,<0.4'" in msg
