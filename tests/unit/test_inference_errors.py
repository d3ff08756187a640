"""The engine refuses in its own terms; the API layer alone decides the HTTP answer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpcrl.inference.api import ENGINE_ERROR_HTTP, api_error
from hpcrl.inference.errors import EngineFailed, InvalidRequest, ShuttingDown, WeightSyncRefused

ENGINE = Path(__file__).resolve().parents[2] / "hpcrl" / "inference" / "engine.py"


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (InvalidRequest("the prompt is empty", param="prompt"), 400, "BadRequestError"),
        (WeightSyncRefused("a full update is needed"), 409, "WeightSyncError"),
        (ShuttingDown("the server is shutting down"), 503, "ServiceUnavailableError"),
        (EngineFailed("engine error: RuntimeError: x"), 500, "InternalServerError"),
    ],
)
def test_engine_errors_map_to_their_http_answer(exc, status, kind) -> None:
    err = api_error(exc)
    assert (err.status, err.type, err.message, err.param) == (status, kind, exc.message, exc.param)
    assert err.body()["error"]["code"] == status


def test_every_engine_error_kind_has_an_answer() -> None:
    from hpcrl.inference import errors

    kinds = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, errors.EngineError)}
    assert kinds - {errors.EngineError} == set(ENGINE_ERROR_HTTP)


def test_engine_imports_nothing_http() -> None:
    names = set()
    for node in ast.walk(ast.parse(ENGINE.read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not any("APIError" in n or n.startswith(("fastapi", "starlette")) for n in names), names
