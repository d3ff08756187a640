"""Tests of verifiers' classic (0.3) API: they skip where this venv has 0.4 (the default extra) and
run in scripts/verifiers03_check.sh's venv."""

from __future__ import annotations

from typing import Any

import pytest

from hpcrl.envs.verifiers.versions import installed, major_minor

REASON = "needs verifiers 0.3 (classic API): bash scripts/verifiers03_check.sh"


def classic_verifiers() -> Any:
    """The verifiers module when it is 0.3; otherwise the calling test (or module) is skipped."""
    vf = pytest.importorskip("verifiers")
    mm = major_minor(installed())
    if mm is None or mm >= (0, 4):
        pytest.skip(REASON, allow_module_level=True)
    return vf
