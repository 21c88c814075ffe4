"""Tools, logprobs and structured output through the HTTP app over a REAL Engine (tiny random model).

Random weights never call a tool by themselves: a named ``tool_choice``
forces the call through the grammar, which is the point (constrained
decoding makes the call; mlx-lm's parser reads it back).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from tests.kernels.test_generation import lively_llama
from tests.tool_models import tool_tokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The app over an Engine on a tiny llama whose tokenizer has a tool template (prompt cache on)."""
    tok = tool_tokenizer()
    model = lively_llama(len(tok._tokenizer))
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=64 << 20,
                                  snapshot_min_new_tokens=8) as engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            yield c


def _sse(text: str) -> list[Any]:
    return [json.loads(b.removeprefix("data: ")) for b in text.split("\n\n")
            if b.strip() and b.strip() != "data: [DONE]"]


async def test_tool_round_trip_feeds_the_prompt_cache(client: httpx.AsyncClient) -> None:
    """Forced call → parsed tool_calls; the tool result turn reuses the cached conversation; then text."""
    first = await client.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "tool_choice": FORCE,
                                          "max_tokens": 120})
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert choice["message"]["content"] is None

    follow = [*ASK, choice["message"],
              {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]
    second = await client.post(CHAT, json={"messages": follow, "tools": [WEATHER], "max_tokens": 8,
                                           "temperature": 0})
    assert second.status_code == 200, second.text
    answer = second.json()
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    usage = answer["usage"]
    # NOTE: the first turn's prompt (tools, system, user) is a prefix of this one.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"] - 1


async def test_forced_tool_call_streamed(client: httpx.AsyncClient) -> None:
    """The same forced call, streamed: one tool_calls delta with index, id, type and the function."""
    r = await client.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "tool_choice": FORCE,
                                      "max_tokens": 120, "stream": True})
    chunks = _sse(r.text)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1
    assert calls[0]["index"] == 0
    assert calls[0]["type"] == "function"
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_greedy_logprobs_match_the_chosen_tokens(client: httpx.AsyncClient) -> None:
    """At temperature 0 each token's logprob is the largest of its top_logprobs, and it is listed first."""
    r = await client.post(CHAT, json={"messages": ASK[1:], "max_tokens": 10, "temperature": 0,
                                      "logprobs": True, "top_logprobs": 4})
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert entries
    assert "".join(bytes(e["bytes"]).decode() for e in entries) == choice["message"]["content"]
    for e in entries:
        assert len(e["top_logprobs"]) == 4
        assert e["logprob"] == max(t["logprob"] for t in e["top_logprobs"])
        assert e["top_logprobs"][0]["token"] == e["token"]


async def test_json_schema_answer_validates(client: httpx.AsyncClient) -> None:
    """response_format json_schema: a random model's answer parses and validates."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "celsius": {"type": "integer"}},
              "required": ["city", "celsius"], "additionalProperties": False}
    r = await client.post(CHAT, json={
        "messages": ASK[1:], "max_tokens": 200, "temperature": 0.8, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


async def test_batch_lane_serves_forced_tool_calls_and_logprobs() -> None:
    """With the batch lane on, a forced tool call (a grammar), top_logprobs and plain logprobs
    are all batch rows (nothing refused by the batch lane), and each answers in full."""
    tok = tool_tokenizer()
    model = lively_llama(len(tok._tokenizer))
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_batch=2) as engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            top = await c.post(CHAT, json={"messages": ASK, "max_tokens": 2, "logprobs": True,
                                           "top_logprobs": 2})
            forced = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER],
                                              "tool_choice": FORCE, "max_tokens": 120})
            plain = await c.post(CHAT, json={"messages": ASK, "max_tokens": 2, "logprobs": True})
        stats = await engine.stats()
    for served in (top, forced, plain):
        assert served.status_code == 200, served.text
    assert all(len(e["top_logprobs"]) == 2
               for e in top.json()["choices"][0]["logprobs"]["content"])
    [call] = forced.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert plain.json()["choices"][0]["logprobs"]["content"]
    assert stats["gateway"]["token"]["batch_refused"] == {}
    assert stats["batch"]["batch"]["joined"] == 3
