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


def for_field(exc: EngineError, fields: dict[str, str]) -> EngineError:
    """`exc` naming the request's own field: the engine names what it checked in its terms (`prompt`,
    `max_tokens`), a route knows which field the client wrote (`messages`, `prompt_token_ids`,
    `token_ids`, `max_completion_tokens`, `sampling_params.max_tokens`)."""
    field = fields.get(exc.param or "")
    if field is None or field == exc.param:
        return exc
    message = exc.message if f"`{field}`" in exc.message else f"{exc.message} (`{field}`)"
    return type(exc)(message, param=field)
