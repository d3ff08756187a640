"""An environment's errors land in logs/envs/<kind>/<env>.log (what `hpcrl logs -c env:NAME` shows)."""

from __future__ import annotations

import logging
from pathlib import Path

from hpcrl.monitor.logging import attach_env_logs, env_logger
from hpcrl.orchestrator.rollout import _errored
from hpcrl.paths import RunPaths


def test_errored_rollout_is_logged_to_its_env_file(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    train, ev = paths.env_log_file("train", "calc"), paths.env_log_file("eval", "calc")
    attach_env_logs({"calc": [train, ev], "other": [paths.env_log_file("train", "other")]})
    try:
        rec = _errored(3, ZeroDivisionError("division by zero in the tool"), "calc")
        assert rec.errored and "ZeroDivisionError" in (rec.error or "")
        for h in env_logger("calc").handlers:
            h.flush()
        assert "rollout 3 errored: ZeroDivisionError: division by zero in the tool" in train.read_text()
        assert "division by zero" in ev.read_text()
        assert paths.env_log_file("train", "other").read_text() == ""
    finally:
        for name in ("calc", "other"):
            for h in list(env_logger(name).handlers):
                env_logger(name).removeHandler(h)
                h.close()
        for h in list(logging.getLogger("verifiers").handlers):
            logging.getLogger("verifiers").removeHandler(h)
