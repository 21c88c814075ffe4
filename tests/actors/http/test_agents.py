"""The OpenAI features agents use, at the HTTP edge over a scripted engine: tools, logprobs, JSON."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from actors.http import HttpSettings, HttpState, create_app

from .fake_engine import FAKE_EOS, FakeEngine, Script

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# NOTE: the call's markers arrive cut across tokens, as real tokenizers cut them.
CALL_TOKENS = ("<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
               "\n</tool_", "call>")


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    app = create_app(engine, HttpSettings(), state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _sse(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.strip():
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _error(r: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


# ----------------------------------------------------------------------- tools


async def test_tool_call_answer_non_streamed() -> None:
    """A generated call becomes message.tool_calls (content null, finish tool_calls); tools reach the template."""
    engine = FakeEngine(scripts=[Script(tokens=CALL_TOKENS, eos=True)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abc_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert engine.calls[0].tools == [WEATHER]


async def test_each_choice_calls_with_ids_of_its_own() -> None:
    """n=2 with tools: both choices carry their call, finish tool_calls, and no call id repeats across choices."""
    engine = FakeEngine(scripts=[Script(tokens=CALL_TOKENS, eos=True),
                                 Script(tokens=CALL_TOKENS, eos=True)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["finish_reason"] for ch in choices] == ["tool_calls", "tool_calls"]
    ids = [call["id"] for ch in choices for call in ch["message"]["tool_calls"]]
    assert ids == ["call_abc_0", "call_abc_1_0"]
    assert all(call.tools == [WEATHER] for call in engine.calls)


async def test_tool_call_streamed_in_openais_delta_shape() -> None:
    """A streamed call is one delta.tool_calls entry {index, id, type, function}; text before it streams as content."""
    engine = FakeEngine(scripts=[Script(tokens=("Let me check. ", *CALL_TOKENS), eos=True)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "stream": True})
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check. "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls == [{"index": 0, "id": "call_abc_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "tool_calls"
    assert all("tool_call>" not in (d.get("content") or "") for d in deltas)


async def test_streamed_and_whole_answers_agree() -> None:
    """Streamed content and calls join to exactly the non-streamed message."""
    tokens = ("Hi ", *CALL_TOKENS, "\n", *CALL_TOKENS)
    engine = FakeEngine(scripts=[Script(tokens=tokens, eos=True), Script(tokens=tokens, eos=True)])
    async with _client(engine) as c:
        whole = (await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER]})).json()
        streamed = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "stream": True})
    deltas = [e["choices"][0]["delta"] for e in _sse(streamed.text)[:-1] if e["choices"]]
    message = whole["choices"][0]["message"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == message["tool_calls"]
    assert [c["id"] for c in calls] == ["call_abc_0", "call_abc_1"]


async def test_tool_history_reaches_the_template() -> None:
    """Assistant tool_calls (arguments decoded) and tool results (tool_call_id) go to the chat template."""
    engine = FakeEngine()
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": history, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert engine.calls[0].payload == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{oops"}}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"role": "tool", "content": "x"}, "messages.1"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages.1"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages.1"),
])
async def test_malformed_tool_history_is_400(message: dict[str, Any], param: str) -> None:
    """Arguments that are not JSON, a tool message without its id, tool fields on other roles: 400."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": [*ASK, message], "tools": [WEATHER]})
    _error(r, param)
    assert engine.calls == []


async def test_tool_choice_none_leaves_call_text_as_content() -> None:
    """With tool_choice none the text is not parsed (but the tools still reach the template)."""
    engine = FakeEngine(scripts=[Script(tokens=CALL_TOKENS)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "".join(CALL_TOKENS)}
    assert choice["finish_reason"] == "stop"
    assert engine.calls[0].tools == [WEATHER]


async def test_a_call_cut_by_max_tokens_stays_text() -> None:
    """A call the length limit cut off does not parse: it is returned as content, markers included."""
    engine = FakeEngine(scripts=[Script(tokens=CALL_TOKENS[:3], finish_reason="length")])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "".join(CALL_TOKENS[:3])}
    assert choice["finish_reason"] == "length"


async def test_tools_on_a_model_without_tool_calls_are_400() -> None:
    """A model whose template has no tool-call format refuses tools (unless tool_choice is none)."""
    engine = FakeEngine(tool_format=None)
    async with _client(engine) as c:
        refused = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER]})
        allowed = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    assert _error(refused, "tools")["code"] == "unsupported"
    assert allowed.status_code == 200


async def test_forced_tool_choice_constrains_decoding() -> None:
    """tool_choice required or a named function sends a grammar naming the function(s); auto sends none."""
    engine = FakeEngine()
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    body = {"messages": ASK, "tools": [WEATHER, other]}
    async with _client(engine) as c:
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
            r = await c.post(CHAT, json={**body, "tool_choice": choice})
            assert r.status_code == 200, r.text
    auto, required, named = (call.params for call in engine.calls)
    assert auto is not None
    assert auto.grammar is None
    assert required is not None
    assert required.grammar is not None
    assert "get_weather" in required.grammar
    assert "get_time" in required.grammar
    assert named is not None
    assert named.grammar is not None
    assert "get_time" in named.grammar
    assert "get_weather" not in named.grammar


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "uniqueItems": True}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
async def test_bad_tool_requests_are_400(body: dict[str, Any], param: str | None) -> None:
    """tool_choice without tools or naming an unknown tool, bad names, unforceable parameters: 400."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, **body})
    _error(r, param)
    assert engine.calls == []


async def test_forcing_calls_needs_the_json_in_tags_format() -> None:
    """A model writing calls another way cannot be forced: 400 naming tool_choice."""
    from dataclasses import replace

    engine = FakeEngine()
    assert engine.tool_format is not None
    engine.tool_format = replace(engine.tool_format, json_in_tags=False)
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert _error(r, "tool_choice")["code"] == "unsupported"


# ----------------------------------------------------------- structured output


async def test_response_format_json_sends_a_grammar() -> None:
    """json_object and json_schema become a grammar; text (the default) none."""
    engine = FakeEngine()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    formats: list[dict[str, Any]] = [
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "count", "schema": schema, "strict": True}}]
    async with _client(engine) as c:
        for fmt in formats:
            r = await c.post(CHAT, json={"messages": ASK, "response_format": fmt})
            assert r.status_code == 200, r.text
    text, obj, with_schema = (call.params for call in engine.calls)
    assert text is not None
    assert text.grammar is None
    assert obj is not None
    assert obj.grammar is not None
    assert with_schema is not None
    assert with_schema.grammar is not None
    assert '"n"' in with_schema.grammar


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.json_schema.name"),
    ({"type": "yaml"}, "response_format"),
])
async def test_bad_response_format_is_400(fmt: dict[str, Any], param: str) -> None:
    """A schema the grammar cannot enforce, a missing name, an unknown type: 400 naming the field."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "response_format": fmt})
    _error(r, param)
    assert engine.calls == []


async def test_n_of_zero_is_refused_clearly() -> None:
    """n=0 is a 400 naming n (several choices: test_choices.py)."""
    async with _client(FakeEngine()) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 0})
    _error(r, "n")


# -------------------------------------------------------------------- logprobs

LP_TOKENS = ("Hel", "lo", "", "!")
LP = (-0.1, -0.2, -0.3, -0.4, -0.05)
TOP = ((101, -0.1), (7, -2.5), (8, -3.0))


def _lp_script() -> Script:
    # NOTE: token 103 releases no text (part of a character): its entry rides with the next chunk.
    return Script(tokens=LP_TOKENS, logprobs=LP, eos=True,
                  top=[TOP, ((102, -0.2), (9, float("-inf")), (8, -4.0)), TOP, TOP, TOP])


async def test_chat_logprobs_shape_and_stop_token_left_out() -> None:
    """Each token has token/logprob/bytes/top_logprobs; the final EOS has no entry; -inf is -9999.0."""
    engine = FakeEngine(scripts=[_lp_script()])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "logprobs": True, "top_logprobs": 2})
    params = engine.calls[0].params
    assert params is not None
    assert params.logprobs
    assert params.top_logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["Hel", "lo", "", "!"]
    assert [e["logprob"] for e in content] == list(LP[:4])
    assert content[0]["bytes"] == list(b"Hel")
    assert content[0]["top_logprobs"] == [
        {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
        {"token": "<7>", "logprob": -2.5, "bytes": list(b"<7>")}]
    assert content[1]["top_logprobs"][1]["logprob"] == -9999.0
    assert r.json()["choices"][0]["logprobs"]["refusal"] is None


async def test_streamed_logprobs_join_to_the_whole_answers() -> None:
    """Streamed chunks' logprobs, concatenated, equal the non-streamed list (nothing lost, no EOS)."""
    engine = FakeEngine(scripts=[_lp_script(), _lp_script()])
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 3}
    async with _client(engine) as c:
        whole = (await c.post(CHAT, json=body)).json()["choices"][0]["logprobs"]["content"]
        streamed = await c.post(CHAT, json={**body, "stream": True})
    chunks = [e for e in _sse(streamed.text)[:-1] if e["choices"]]
    joined = [x for e in chunks if e["choices"][0]["logprobs"]
              for x in e["choices"][0]["logprobs"]["content"]]
    assert joined == whole
    with_text = [e for e in chunks if e["choices"][0]["delta"].get("content")]
    assert all(e["choices"][0]["logprobs"]["content"] for e in with_text)


async def test_logprobs_off_means_null() -> None:
    """Without logprobs the choice's logprobs is null and the engine is not asked for them."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK})
    assert r.json()["choices"][0]["logprobs"] is None
    params = engine.calls[0].params
    assert params is not None
    assert not params.logprobs
    assert params.top_logprobs == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"top_logprobs": 2}, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
])
async def test_bad_logprobs_requests_are_400(body: dict[str, Any], param: str | None) -> None:
    """top_logprobs without logprobs, more than 20 alternatives, a non-boolean logprobs: 400."""
    async with _client(FakeEngine()) as c:
        r = await c.post(CHAT, json={"messages": ASK, **body})
    _error(r, param)


async def test_completion_logprobs_legacy_shape() -> None:
    """Completions report tokens, token_logprobs, top_logprobs (a dict per token), text_offset."""
    engine = FakeEngine(scripts=[_lp_script(), _lp_script()])
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "x", "logprobs": 2})
        streamed = await c.post(COMPLETIONS, json={"prompt": "x", "logprobs": 2, "stream": True})
    params = engine.calls[0].params
    assert params is not None
    assert params.logprobs
    assert params.top_logprobs == 2
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo", "", "!"]
    assert lp["token_logprobs"] == list(LP[:4])
    assert lp["top_logprobs"][0] == {"Hel": -0.1, "<7>": -2.5}
    assert lp["text_offset"] == [0, 3, 5, 5]
    parts = [e["choices"][0]["logprobs"] for e in _sse(streamed.text)[:-1]
             if e["choices"] and e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]


async def test_completion_logprobs_over_five_is_400() -> None:
    """The legacy API allows at most 5 alternatives."""
    async with _client(FakeEngine()) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "x", "logprobs": 6})
    _error(r, "logprobs")


async def test_eos_mid_answer_keeps_its_entry() -> None:
    """Only a FINAL stop token is left out: an EOS id followed by more tokens keeps its entry."""
    engine = FakeEngine(scripts=[Script(tokens=("a",), logprobs=(-1.0, -2.0), eos=True)])
    engine.token_bytes.eos_token_ids = frozenset({FAKE_EOS, 101})
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["a"]
