"""Schemathesis against the app's own OpenAPI document: no 5xx, and every error OpenAI-shaped.

Every operation of ``/openapi.json`` is fed schemathesis' generated requests,
valid ones (positive) and ones that break the schema (negative), through the
ASGI app over the scripted engine. Bounded: a few dozen examples per
operation and mode, no example database.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from actors.http import HttpSettings, create_app

from .fake_engine import FakeEngine

_APP = create_app(FakeEngine(), HttpSettings())
_SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", _APP)
_OPERATIONS = {f"{result.ok().method.upper()} {result.ok().path}": result.ok()
               for result in _SCHEMA.get_all_operations() if isinstance(result, Ok)}
_BODY_EXAMPLES = 40
"""Examples per mode for operations with a request body (the generation routes)."""
_OTHER_EXAMPLES = 10


def _assert_openai_error(status: int, body: bytes) -> None:
    data: Any = json.loads(body)
    assert isinstance(data, dict), data
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str)
    assert err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def test_every_route_is_in_the_schema() -> None:
    """The document lists the generation routes with their bodies (so the fuzzing reaches them)."""
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /health",
            "HEAD /health", "GET /v1/models"} <= set(_OPERATIONS)
    doc = _APP.openapi()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"]
    assert "$defs" not in json.dumps(doc)


# NOTE: negative cases need something to break: only operations with a body
# have one, and the admin routes' body is any JSON (it is ignored).
_CASES = [(name, GenerationMode.POSITIVE) for name in sorted(_OPERATIONS)] + [
    (name, GenerationMode.NEGATIVE) for name, op in sorted(_OPERATIONS.items())
    if len(op.body) and not op.path.startswith("/admin/")]


@pytest.mark.parametrize(("name", "mode"), _CASES, ids=[f"{n}-{m.value}" for n, m in _CASES])
def test_no_server_errors_and_openai_shaped_errors(name: str, mode: GenerationMode) -> None:
    """Generated requests never get a 5xx, and each 4xx body is OpenAI's error envelope."""
    op = _OPERATIONS[name]
    examples = _BODY_EXAMPLES if len(op.body) else _OTHER_EXAMPLES

    @given(case=op.as_strategy(mode))
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        response = case.call()
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400 and case.method.upper() != "HEAD":
            _assert_openai_error(response.status_code, response.content)

    check()
