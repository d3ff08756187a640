"""Environments: the protocol (base), built-ins, the registry and the verifiers adapter."""

from hpcrl.envs.base import (
    ChatClient,
    Environment,
    Message,
    Rubric,
    StitchedTokens,
    Task,
    Trajectory,
    Turn,
    stitch_turns,
)
from hpcrl.envs.registry import known_env_ids, load_environment, validate_env_spec

__all__ = [
    "ChatClient",
    "Environment",
    "Message",
    "Rubric",
    "StitchedTokens",
    "Task",
    "Trajectory",
    "Turn",
    "known_env_ids",
    "load_environment",
    "stitch_turns",
    "validate_env_spec",
]
