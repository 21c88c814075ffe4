"""The OpenAPI document describes what the edge answers: error statuses, media types, methods."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from actors.http import HttpSettings, create_app

from .fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

KEY = "doc-key"


def _client() -> httpx.AsyncClient:
    app = create_app(FakeEngine(), HttpSettings(api_key=KEY))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             headers={"Authorization": f"Bearer {KEY}"})


async def _doc(c: httpx.AsyncClient) -> dict[str, Any]:
    r = await c.get("/openapi.json")
    assert r.status_code == 200
    doc: dict[str, Any] = r.json()
    return doc


async def test_undeclared_method_is_405_naming_every_declared_one() -> None:
    """OPTIONS /health answers 405 with Allow: GET, HEAD; a POST to a GET route is 405, not 415."""
    async with _client() as c:
        options = await c.options("/health")
        post = await c.post("/stats")  # NOTE: no Content-Type: the 415 check must not run here.
        head = await c.head("/health")
    assert options.status_code == 405
    assert {m.strip() for m in options.headers["allow"].split(",")} == {"GET", "HEAD"}
    assert post.status_code == 405
    assert head.status_code == 200


async def test_every_status_the_edge_answers_is_documented() -> None:
    """Each status the middleware and handlers give appears on its operations with the error body."""
    async with _client() as c:
        doc = await _doc(c)
        bodiless = await c.post("/v1/chat/completions", content=b"{}")
        keyless = await c.get("/v1/models", headers={"Authorization": ""})
    assert (bodiless.status_code, keyless.status_code) == (415, 401)
    paths = doc["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "408", "413", "415", "429", "500", "503"} <= set(chat)
    assert chat["415"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/event-stream" in chat["200"]["content"]
    assert {"401", "403", "415"} <= set(paths["/admin/cache/flush"]["post"]["responses"])
    assert "401" not in paths["/health"]["get"]["responses"]
    assert "503" in paths["/health"]["get"]["responses"]
    assert set(paths["/health"]) == {"get", "head"}
    assert "content" not in paths["/health"]["head"]["responses"]["200"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert all("422" not in op["responses"] for ops in paths.values() for op in ops.values())
    assert "ErrorResponse" in doc["components"]["schemas"]
