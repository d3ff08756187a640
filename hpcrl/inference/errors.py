"""What the embedded engine refuses, in its own terms. The engine knows nothing of HTTP: the API
layer (api.py, `api_error`) maps each kind to its status code and OpenAI error type."""

from __future__ import annotations


class EngineError(Exception):
    """A request or weight update the engine refuses; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class InvalidRequest(EngineError):
    """The request cannot be served as asked (empty prompt, too long, unknown token ids, bad template)."""


class WeightSyncRefused(EngineError):
    """A weight update that does not fit what the engine holds; nothing unverified is served."""


class ShuttingDown(EngineError):
    """The engine stops (or stopped) before the request could finish."""


class EngineFailed(EngineError):
    """An engine iteration failed (a bug): the requests in it fail, the server keeps running."""
