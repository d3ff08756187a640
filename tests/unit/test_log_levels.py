"""Log levels as seed 001 describes them: $PRIME_LOG_LEVEL as well as $HPCRL_LOG_LEVEL, a role's
[x.log] over [log] field by field, and orchestrator.log.vf_level as the env processes' level."""

from __future__ import annotations

import logging

from hpcrl.config.loader import load
from hpcrl.monitor.logging import ENV_LEVEL_VAR, env_process_level, resolve_level
from tests.conftest import rl_toml


def test_level_falls_back_to_prime_log_level(monkeypatch):
    monkeypatch.delenv("HPCRL_LOG_LEVEL", raising=False)
    monkeypatch.setenv("PRIME_LOG_LEVEL", "debug")
    assert resolve_level(None) == logging.DEBUG
    monkeypatch.setenv("HPCRL_LOG_LEVEL", "error")  # hpcrl's own variable wins
    assert resolve_level(None) == logging.ERROR
    assert resolve_level("warning") == logging.WARNING  # and the config over both


def test_role_log_table_overrides_log_field_by_field(tmp_path):
    p = tmp_path / "rl.toml"
    p.write_text(
        rl_toml(2, plots=True)
        + '[log]\nlevel = "debug"\nvf_level = "error"\n[orchestrator.log]\nvf_level = "debug"\n'
    )
    c = load([str(p)]).config
    assert (c.orchestrator.log.level, c.orchestrator.log.vf_level) == ("debug", "debug")
    assert c.trainer.log is None and c.log.vf_level == "error"
    assert load([str(p), "--trainer.log.console-interval", "5"]).config.trainer.log.level == "debug"


def test_env_processes_log_at_vf_level(monkeypatch):
    """What an env server / worker process sets up (hpcrl.envs.runtime.server.main and friends)."""
    monkeypatch.setenv(ENV_LEVEL_VAR, "debug")
    assert env_process_level() == logging.DEBUG
    monkeypatch.setenv(ENV_LEVEL_VAR, "warning")
    assert env_process_level() == logging.WARNING
