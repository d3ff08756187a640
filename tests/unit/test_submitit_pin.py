"""HetJobExecutor (hpcrl/launch/hetjob.py) subclasses submitit's SlurmExecutor and relies on private
methods: it overrides `_make_submission_file_text` and `_num_tasks` and calls `_submit_command`,
which must still call both overrides. Private names change without notice, so pyproject.toml pins
submitit to the minor version checked here, and this test fails loudly (naming the method) when an
upgrade changes any of them."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
from submitit.slurm.slurm import SlurmExecutor

from hpcrl.launch.hetjob import HetJobExecutor

REPO = Path(__file__).resolve().parents[2]
PINNED_MINOR = "1.5"
# name -> parameters (self first) the override or call relies on
RELIED_ON = {
    "_make_submission_file_text": ["self", "command", "uid"],  # overridden: returns render_sbatch(spec)
    "_num_tasks": ["self"],  # overridden: tasks over every het component
    "_submit_command": ["self", "command"],  # called by submit_spec
    "_make_submission_command": ["self", "submission_file_path"],  # used by _submit_command
    "_get_job_id_from_submission_command": ["string"],  # used by _submit_command (a classmethod)
}


def test_pyproject_pins_the_checked_minor_version() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("submitit")]
    assert spec.replace(" ", "") == f"submitit>={PINNED_MINOR},<1.{int(PINNED_MINOR.split('.')[1]) + 1}", spec
    installed = version("submitit")
    assert re.match(rf"{re.escape(PINNED_MINOR)}(\.|$)", installed), (
        f"submitit {installed} is installed, HetJobExecutor was checked against {PINNED_MINOR}.x"
    )


@pytest.mark.parametrize("name", sorted(RELIED_ON))
def test_private_methods_hetjob_relies_on_are_unchanged(name: str) -> None:
    fn = getattr(SlurmExecutor, name, None)
    assert fn is not None, f"submitit.SlurmExecutor.{name} is gone: update HetJobExecutor and the pin"
    params = list(inspect.signature(fn).parameters)
    assert params == RELIED_ON[name], (
        f"submitit.SlurmExecutor.{name}{inspect.signature(fn)} changed: HetJobExecutor expects {RELIED_ON[name]}"
    )


def test_submit_command_still_goes_through_the_overrides() -> None:
    """If `_submit_command` stopped calling them, the het script and task count would silently be
    submitit's own (a plain job with a pickled callable)."""
    src = inspect.getsource(SlurmExecutor._submit_command)
    for called in (
        "self._make_submission_file_text(",
        "self._num_tasks(",
        "self._make_submission_command(",
        "self._get_job_id_from_submission_command(",
    ):
        assert called in src, f"submitit's _submit_command no longer calls {called}..)"


def test_overrides_match_the_base_signatures() -> None:
    for name in ("_make_submission_file_text", "_num_tasks"):
        ours, theirs = getattr(HetJobExecutor, name), getattr(SlurmExecutor, name)
        assert ours is not theirs, name
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    assert "max_num_timeout" in inspect.signature(SlurmExecutor.__init__).parameters
