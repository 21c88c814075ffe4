"""vLLM's extension fields that load generators (guidellm) send: ``ignore_eos`` and ``continuous_usage_stats``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import httpx2
import openai
import pytest

from actors.http import HttpSettings, HttpState, create_app

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}]}
# NOTE: what guidellm's OpenAI backend sends with every streamed request.
GUIDELLM = {"stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    app = create_app(engine, HttpSettings(), state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _chunks(text: str) -> list[Any]:
    blocks = [b.removeprefix("data: ") for b in text.split("\n\n") if b.strip()]
    assert blocks[-1] == "[DONE]"
    return [json.loads(b) for b in blocks[:-1]]


@pytest.mark.parametrize(("path", "body"), [(CHAT, HELLO), (COMPLETIONS, {"prompt": "hi"})])
async def test_ignore_eos_reaches_the_engine(path: str, body: dict[str, Any]) -> None:
    """ignore_eos: true is served (not a 400) and sets GenerationParams.ignore_eos; absent it is off."""
    engine = FakeEngine(scripts=[Script(), Script()])
    async with _client(engine) as c:
        on = await c.post(path, json={**body, "ignore_eos": True, "max_tokens": 5})
        off = await c.post(path, json=body)
    assert on.status_code == off.status_code == 200, (on.text, off.text)
    assert [call.params.ignore_eos for call in engine.calls if call.params] == [True, False]


async def test_ignore_eos_with_a_constrained_answer_is_a_400() -> None:
    """ignore_eos with response_format json is a 400 naming ignore_eos (a grammar ends with EOS)."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "ignore_eos": True,
                                     "response_format": {"type": "json_object"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "ignore_eos"
    assert engine.calls == []


@pytest.mark.parametrize(("path", "body"), [(CHAT, HELLO), (COMPLETIONS, {"prompt": "hi"})])
async def test_continuous_usage_stats_puts_usage_on_every_chunk(path: str, body: dict[str, Any]) -> None:
    """Every chunk carries the usage so far (completion tokens counting up); the finish chunk the final usage."""
    engine = FakeEngine(scripts=[Script(tokens=("A", "", "B"), prompt_tokens=7, cached_tokens=3)])
    async with _client(engine) as c:
        r = await c.post(path, json={**body, **GUIDELLM})
    assert r.status_code == 200, r.text
    chunks = _chunks(r.text)
    assert chunks[-1]["choices"] == []  # the include_usage tail stays
    with_choice = chunks[:-1]
    assert all(ch["usage"] is not None for ch in with_choice)
    counts = [ch["usage"]["completion_tokens"] for ch in with_choice]
    assert counts == sorted(counts)
    assert all(ch["usage"]["prompt_tokens"] == 7 for ch in with_choice)
    assert all(ch["usage"]["total_tokens"] == 7 + ch["usage"]["completion_tokens"]
               for ch in with_choice)
    # "A" after 1 token, "B" after 3 (the empty token releases no chunk).
    texts = [(ch["choices"][0].get("delta", {}).get("content") or ch["choices"][0].get("text"),
              ch["usage"]["completion_tokens"]) for ch in with_choice]
    assert ("A", 1) in texts
    assert ("B", 3) in texts
    assert with_choice[-1]["choices"][0]["finish_reason"] == "stop"
    assert with_choice[-1]["usage"] == chunks[-1]["usage"]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_continuous_usage_stats_needs_include_usage() -> None:
    """As vLLM: continuous_usage_stats without include_usage adds no usage anywhere."""
    async with _client(FakeEngine()) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": True,
                                     "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    assert all(ch["usage"] is None for ch in _chunks(r.text))


async def test_scored_prompt_counts_no_completion_tokens_on_running_usage() -> None:
    """echo with max_tokens 0 (scoring only): the running usage counts no completion token."""
    async with _client(FakeEngine(scripts=[Script(tokens=("x",))])) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "hi", "echo": True, "max_tokens": 0,
                                            **GUIDELLM})
    assert r.status_code == 200, r.text
    assert all(ch["usage"]["completion_tokens"] == 0 for ch in _chunks(r.text))


async def test_openai_client_reads_running_usage() -> None:
    """The real openai client parses every chunk's usage (prompt_tokens_details absent until the end)."""
    engine = FakeEngine(scripts=[Script(tokens=("A", "B"))])
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(engine, state=state)),
                              base_url="http://t")
    async with openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http,
                                  max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        usages = [c.usage async for c in stream]
    assert all(u is not None for u in usages)
    assert [u.completion_tokens for u in usages if u is not None] == [0, 1, 2, 2, 2]


async def test_an_eos_the_answer_ran_past_keeps_its_logprob() -> None:
    """A final EOS token with finish 'length' (ignore_eos) is part of the answer; with 'stop' it is not."""
    engine = FakeEngine(scripts=[
        Script(tokens=("A",), eos=True, finish_reason="length", logprobs=[-0.5, -1.5]),
        Script(tokens=("A",), eos=True, finish_reason="stop", logprobs=[-0.5, -1.5])])
    async with _client(engine) as c:
        ran = await c.post(CHAT, json={**HELLO, "logprobs": True, "ignore_eos": True})
        stopped = await c.post(CHAT, json={**HELLO, "logprobs": True})
    lp = [[e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]]
          for r in (ran, stopped)]
    assert lp == [[-0.5, -1.5], [-0.5]]
