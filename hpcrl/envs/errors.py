"""Errors of the env servers that end a run (an env's own errors only error its rollouts)."""

from __future__ import annotations


class EnvServerFailed(RuntimeError):
    """An env server died more often than `orchestrator.env_server_max_restarts` allows, or could not
    start: the run ends naming the env."""
