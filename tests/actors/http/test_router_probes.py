"""The endpoints a router probes before routing to a worker (sglang-router 0.3's probe order)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from actors.http import HttpSettings, HttpState, create_app

from .fake_engine import FakeEngine

pytestmark = pytest.mark.anyio


class _EventsEngine(FakeEngine):
    """A fake engine whose statistics include a KV-event publisher's section."""

    async def stats(self) -> dict[str, Any]:
        return {"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "block_size": 16,
                              "model_fingerprint": "fp", "kv_scheme": "bf16"}}


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    app = create_app(engine, HttpSettings(), state=HttpState(clock=lambda: 1.0, new_id=lambda: "a"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_health_model_info_and_server_info_answer_both_names() -> None:
    """/health, /model_info + /get_model_info and /server_info + /get_server_info answer 200."""
    async with _client(FakeEngine()) as client:
        assert (await client.get("/health")).status_code == 200
        for path in ("/model_info", "/get_model_info"):
            resp = await client.get(path)
            assert resp.status_code == 200
            assert resp.json()["model_path"] == "fake-model"
            assert resp.json()["is_generation"] is True
        for path in ("/server_info", "/get_server_info"):
            resp = await client.get(path)
            assert resp.status_code == 200
            assert resp.json()["served_model_name"] == "fake-model"
            assert "kv_events" not in resp.json()


async def test_server_info_names_the_kv_event_stream() -> None:
    """With KV events on, /get_server_info carries the publisher's endpoint and hashing facts."""
    async with _client(_EventsEngine()) as client:
        info = (await client.get("/get_server_info")).json()
    assert info["kv_events"]["endpoint"] == "tcp://127.0.0.1:5557"
    assert info["kv_events"]["block_size"] == 16
    assert info["kv_events"]["model_fingerprint"] == "fp"


ROUTER_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                 "skip_special_tokens": True, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "logprobs": False}


async def test_router_added_fields_at_defaults_are_accepted() -> None:
    """A body carrying sglang-router's added SGLang fields at their defaults is served as without them."""
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "hi"}], **ROUTER_FIELDS}
    async with _client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert len(engine.calls) == 1


async def test_router_field_with_other_value_is_refused() -> None:
    """no_stop_trim=true (not implemented) is still a 400 naming the field, and reaches no engine."""
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "hi"}], **ROUTER_FIELDS, "no_stop_trim": True}
    async with _client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "no_stop_trim"
    assert engine.calls == []


async def test_router_body_with_ignore_eos_true_is_served_with_it() -> None:
    """ignore_eos=true in a router's body is kvtier's own field: it reaches the engine's params."""
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "hi"}], **ROUTER_FIELDS, "ignore_eos": True}
    async with _client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    [call] = engine.calls
    assert call.params is not None
    assert call.params.ignore_eos


async def test_deeply_nested_router_body_is_a_400() -> None:
    """A body too deep for json.loads that carries the router's marker is a 400, not a 500."""
    deep = '{"no_stop_trim": false, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    async with _client(FakeEngine()) as client:
        resp = await client.post("/v1/chat/completions", content=deep,
                                 headers={"content-type": "application/json"})
    assert resp.status_code == 400
