"""alphabet-sort whose feedback comes after every reply, a truncated one too: a randomly initialised
tiny model rarely ends its turn within a test's max_tokens, and the reference driver stops a rollout
at a truncated reply (no env response). Loaded by id "tests.integration.feedback_env" (echo's run)."""

from __future__ import annotations

from typing import Any

from hpcrl.envs.builtin.alphabet_sort import AlphabetSortEnv
from hpcrl.envs.builtin.alphabet_sort import load_environment as load_alphabet_sort


class _Untruncated:
    """A ChatClient that reports every turn as finished (stop), so the env answers it."""

    def __init__(self, client: Any):
        self.client = client

    async def chat(self, messages, tools, sampling):
        turn = await self.client.chat(messages, tools, sampling)
        if turn.completion_token_ids:
            turn.finish_reason = "stop"
        return turn


class FeedbackEnv(AlphabetSortEnv):
    async def rollout(self, task, client, sampling):
        return await super().rollout(task, _Untruncated(client), sampling)


def load_environment(**kwargs: Any) -> FeedbackEnv:
    env = load_alphabet_sort(**kwargs)
    env.__class__ = FeedbackEnv
    return env
