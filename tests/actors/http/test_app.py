"""The HTTP app over a scripted engine: response shapes, SSE, and the error edge."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
import structlog

from actors.errors import ContextTooLong, InvalidRequest, QueueFull, ServerShuttingDown
from actors.http import Defaults, HttpSettings, HttpState, begin_shutdown, create_app, cut_streams
from actors.runtime import configure_logging

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}]}


def _client(engine: FakeEngine, settings: HttpSettings | None = None) -> httpx.AsyncClient:
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    app = create_app(engine, settings or HttpSettings(), state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _sse(text: str) -> list[Any]:
    """Parse an SSE body into JSON payloads ("[DONE]" kept as a string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return dict(err)


async def test_chat_non_streaming_shape_and_usage() -> None:
    """A non-streamed chat answer has OpenAI's fields, the joined text and cached_tokens."""
    engine = FakeEngine(scripts=[Script(tokens=("Hel", "lo"), prompt_tokens=9, cached_tokens=4)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "model": "fake-model", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "chatcmpl-abc"
    assert body["object"] == "chat.completion"
    assert body["created"] == 1_700_000_000
    assert body["model"] == "fake-model"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert r.headers["x-request-id"] == "chatcmpl-abc"
    call = engine.calls[0]
    assert call.params is not None
    assert call.params.max_tokens == 5
    assert call.payload == [{"role": "user", "content": "hi"}]
    assert call.closed


async def test_chat_params_and_defaults_reach_engine() -> None:
    """Sampling fields map onto GenerationParams; omitted ones take the server defaults."""
    settings = HttpSettings(defaults=Defaults(max_tokens=33, temperature=0.7, top_k=5))
    engine = FakeEngine()
    async with _client(engine, settings) as c:
        r1 = await c.post(CHAT, json={**HELLO, "stop": "x", "top_p": 0.5, "seed": 3})
        r2 = await c.post(CHAT, json={**HELLO, "max_completion_tokens": 7, "temperature": 0,
                                      "stop": ["a", "b"], "messages": [
                                          {"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "q"}]}]})
    assert r1.status_code == r2.status_code == 200
    p1, p2 = engine.calls[0].params, engine.calls[1].params
    assert p1 is not None
    assert p2 is not None
    assert (p1.max_tokens, p1.temperature, p1.top_k, p1.top_p, p1.stop, p1.seed) == (
        33, 0.7, 5, 0.5, ("x",), 3)
    assert (p2.max_tokens, p2.temperature, p2.stop) == (7, 0.0, ("a", "b"))
    assert engine.calls[1].payload == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "q"}]
    # NOTE: only a request that names no length may be shortened to fit the context.
    assert engine.fit_context == [True, False]


async def test_logit_bias_and_penalties_reach_engine() -> None:
    """OpenAI's logit_bias (string keys) and presence/frequency penalties map onto GenerationParams."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "logit_bias": {"5": -100, "17": 2.5},
                                     "presence_penalty": 0.5, "frequency_penalty": 0})
    assert r.status_code == 200
    params = engine.calls[0].params
    assert params is not None
    assert params.logit_bias == {5: -100.0, 17: 2.5}
    assert params.presence_penalty == 0.5
    assert params.frequency_penalty is None


async def test_chat_streaming_sse_with_usage() -> None:
    """A streamed chat sends the role opener, content deltas, the finish, the usage tail, [DONE]."""
    engine = FakeEngine(scripts=[Script(tokens=("A", "", "B"), finish_reason="length")])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(ch["object"] == "chat.completion.chunk" and ch["id"] == "chatcmpl-abc"
               for ch in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == "AB"
    assert all("role" not in ch["choices"][0]["delta"] for ch in chunks[1:] if ch["choices"])
    finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finish[-1] == "length"
    assert all(f is None for f in finish[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert all(ch["usage"] is None for ch in chunks[:-1])
    assert engine.calls[0].closed


async def test_streaming_without_usage_has_no_usage_chunk() -> None:
    """Without stream_options.include_usage no chunk carries usage."""
    async with _client(FakeEngine()) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": True})
    chunks = _sse(r.text)[:-1]
    assert chunks
    assert all(ch["choices"] and ch["usage"] is None for ch in chunks)


async def test_completions_streamed_and_not() -> None:
    """/v1/completions answers text_completion objects, streamed and not, for text and token-id prompts."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r1 = await c.post(COMPLETIONS, json={"prompt": "Once", "max_tokens": 3})
        r2 = await c.post(COMPLETIONS, json={"prompt": [1, 2, 3], "stream": True})
        r3 = await c.post(COMPLETIONS, json={"prompt": ["only one"]})
    assert r1.status_code == 200
    b1 = r1.json()
    assert b1["object"] == "text_completion"
    assert b1["id"] == "cmpl-abc"
    assert b1["choices"][0]["text"] == "Hello!"
    assert b1["usage"]["total_tokens"] == 10
    events = _sse(r2.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello!"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert r3.status_code == 200
    assert [c.payload for c in engine.calls] == ["Once", [1, 2, 3], "only one"]


async def test_models_health_stats() -> None:
    """/v1/models lists the served model, /health says ok, /stats has engine and http sections."""
    async with _client(FakeEngine()) as c:
        models = (await c.get("/v1/models")).json()
        one = await c.get("/v1/models/fake-model")
        other = await c.get("/v1/models/gpt-4")
        health = await c.get("/health")
        await c.post(CHAT, json=HELLO)
        stats = (await c.get("/stats")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert one.json()["id"] == "fake-model"
    _assert_openai_error(other, 404, "model_not_found")
    assert health.json()["status"] == "ok"
    assert stats["engine"]["gateway"]["active"] == 0
    assert stats["http"]["responses_by_status"]["200"] >= 4
    assert stats["http"]["in_flight"] == 0


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b"[1, 2]", None),
        (b'{"messages": "hi"}', "invalid_value"),
        (b'{"messages": []}', "invalid_value"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "bogus": 1}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": -2.5}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000000}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"word": 1}}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_k": 1e30}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_k": 1000000000000000000000000000000}',
         "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "seed": -1}', "invalid_value"),
    ],
)
async def test_bad_chat_input_is_400(content: bytes, code: str | None) -> None:
    """Malformed JSON, wrong types, bad bounds and unsupported features answer 400 with an OpenAI body."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, content=content, headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, code)
    assert engine.calls == []


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded", "text/plain", "text/plain;charset=UTF-8", None,
    "application/json; charset=latin-1", "application/jsonp"])
async def test_post_body_that_is_not_declared_json_is_415(content_type: str | None) -> None:
    """A POST whose Content-Type is not application/json (form, text/plain, none) gets 415 and reaches no engine."""
    engine = FakeEngine()
    headers = {"content-type": content_type} if content_type is not None else {}
    async with _client(engine) as c:
        r = await c.post(CHAT, content=json.dumps(HELLO).encode(), headers=headers)
    _assert_openai_error(r, 415, "unsupported_media_type")
    assert engine.calls == []


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON;charset=\"UTF-8\""])
async def test_json_content_type_with_utf8_charset_is_accepted(content_type: str) -> None:
    """application/json, with or without a UTF-8 charset (any case), is served."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, content=json.dumps(HELLO).encode(),
                         headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert engine.calls[0].payload == [{"role": "user", "content": "hi"}]


async def test_validation_error_names_the_param() -> None:
    """A wrong-typed field is reported in ``param`` without FastAPI's "body" prefix."""
    async with _client(FakeEngine()) as c:
        r = await c.post(CHAT, json={**HELLO, "max_tokens": "ten"})
    assert _assert_openai_error(r, 400)["param"] == "max_tokens"


async def test_huge_max_tokens_names_limit() -> None:
    """max_tokens above the server's limit is a 400 that names the limit."""
    settings = HttpSettings(defaults=Defaults(max_tokens=8, max_tokens_limit=64))
    async with _client(FakeEngine(), settings) as c:
        r = await c.post(CHAT, json={**HELLO, "max_tokens": 65})
        ok = await c.post(CHAT, json={**HELLO, "max_tokens": 64})
    err = _assert_openai_error(r, 400)
    assert err["param"] == "max_tokens"
    assert "64" in err["message"]
    assert ok.status_code == 200


async def test_unknown_model_is_404_and_aliases_work() -> None:
    """An unknown model is 404 model_not_found; the served id and aliases are accepted."""
    engine = FakeEngine()
    async with _client(engine, HttpSettings(model_aliases=("/models/smol",))) as c:
        r = await c.post(CHAT, json={**HELLO, "model": "gpt-4o"})
        ok1 = await c.post(CHAT, json={**HELLO, "model": "/models/smol"})
        ok2 = await c.post(COMPLETIONS, json={"prompt": "x", "model": "fake-model"})
    assert _assert_openai_error(r, 404, "model_not_found")["param"] == "model"
    assert ok1.status_code == ok2.status_code == 200
    assert ok1.json()["model"] == "fake-model"


async def test_unknown_route_and_method() -> None:
    """Unknown routes answer 404 and wrong methods 405, both with OpenAI bodies."""
    async with _client(FakeEngine()) as c:
        _assert_openai_error(await c.get("/v1/nope"), 404, "not_found")
        _assert_openai_error(await c.get(CHAT), 405, "method_not_allowed")


async def test_body_over_limit_by_content_length_is_413() -> None:
    """A declared Content-Length over the cap is refused with 413 before reading the body."""
    engine = FakeEngine()
    big = json.dumps({**HELLO, "user": "x" * 2000}).encode()
    async with _client(engine, HttpSettings(max_body_bytes=1000)) as c:
        r = await c.post(CHAT, content=big, headers={"content-type": "application/json"})
        ok = await c.post(CHAT, json=HELLO)
    _assert_openai_error(r, 413, "request_too_large")
    assert ok.status_code == 200
    assert len(engine.calls) == 1


async def test_chunked_body_over_limit_is_413_while_reading() -> None:
    """A chunked body without Content-Length is cut off with 413 once it passes the cap."""
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(50):
            sent += 1
            yield b"x" * 100
        yield b'"}]}'

    engine = FakeEngine()
    async with _client(engine, HttpSettings(max_body_bytes=1000)) as c:
        r = await c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    _assert_openai_error(r, 413, "request_too_large")
    assert engine.calls == []


async def test_api_key() -> None:
    """With an API key every route but /health needs the Bearer key; failures are 401 OpenAI bodies."""
    settings = HttpSettings(api_key="s3cret")
    async with _client(FakeEngine(), settings) as c:
        missing = await c.post(CHAT, json=HELLO)
        wrong = await c.post(CHAT, json=HELLO, headers={"Authorization": "Bearer nope"})
        models = await c.get("/v1/models")
        stats = await c.get("/stats")
        health = await c.get("/health")
        ok = await c.post(CHAT, json=HELLO, headers={"Authorization": "Bearer s3cret"})
    _assert_openai_error(missing, 401, "invalid_api_key")
    _assert_openai_error(wrong, 401, "invalid_api_key")
    _assert_openai_error(models, 401, "invalid_api_key")
    _assert_openai_error(stats, 401, "invalid_api_key")
    assert health.status_code == 200
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (QueueFull(4, 4), 429, "queue_full"),
        (ServerShuttingDown(), 503, "shutting_down"),
        (InvalidRequest("empty prompt"), 400, "invalid_request"),
        (ContextTooLong(5000, 2048, max_tokens=16, limit_name="the model's context"), 400,
         "context_length_exceeded"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_admission_errors_map_to_status(error: Exception, status: int, code: str,
                                              stream: bool) -> None:
    """Typed admission errors become 429/503/400 before any stream byte, streamed or not."""
    engine = FakeEngine(scripts=[Script(admission_error=error)])  # type: ignore[arg-type]
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": stream})
    _assert_openai_error(r, status, code)
    if status == 429:
        assert r.headers["retry-after"] == "1"
    assert engine.calls[0].closed


async def test_generation_failure_mid_stream_is_an_error_event() -> None:
    """An engine failure after the first token ends the SSE stream with an OpenAI error event."""
    engine = FakeEngine(scripts=[Script(fail_after=1), Script(fail_after=1)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": True})
        r2 = await c.post(CHAT, json=HELLO)
    events = _sse(r.text)
    assert events[-1]["error"]["code"] == "generation_failed"
    assert "[DONE]" not in events
    _assert_openai_error(r2, 500, "generation_failed")
    assert all(call.closed for call in engine.calls)


async def test_shutdown_refuses_new_requests_and_health_drains() -> None:
    """After begin_shutdown, /health is 503 draining and generation routes answer 503."""
    engine = FakeEngine()
    state = HttpState()
    app = create_app(engine, HttpSettings(), state=state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        begin_shutdown(app)
        health = await c.get("/health")
        r = await c.post(CHAT, json=HELLO)
        models = await c.get("/v1/models")
    assert engine.shutting_down
    assert health.status_code == 503
    assert health.json()["status"] == "draining"
    _assert_openai_error(r, 503, "shutting_down")
    assert models.status_code == 200


async def test_in_flight_counts_a_held_stream() -> None:
    """A stream held mid-generation counts as in flight until it ends, then the state is idle."""
    gate, admitted = anyio.Event(), anyio.Event()
    engine = FakeEngine(scripts=[Script(gate=gate, admitted=admitted)])
    state = HttpState()
    app = create_app(engine, HttpSettings(), state=state)
    result: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:

        async def request() -> None:
            result["r"] = await c.post(CHAT, json={**HELLO, "stream": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            with anyio.fail_after(5):
                await admitted.wait()
            assert state.in_flight == 1
            assert not state.idle.is_set()
            gate.set()
            with anyio.fail_after(5):
                await state.wait_idle()
    assert result["r"].status_code == 200
    assert state.in_flight == 0
    assert engine.calls[0].closed


@pytest.mark.usefixtures("restore_structlog")
async def test_request_log_lines_carry_the_request_id_as_correlation_id() -> None:
    """Each request's access-log line carries its X-Request-Id as correlation_id; nothing leaks past it."""
    out = io.StringIO()
    configure_logging(format="json", level="info", stream=out)
    ids = iter(["one", "two", "three"])
    state = HttpState(new_id=lambda: next(ids))
    app = create_app(FakeEngine(), HttpSettings(), state=state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        streamed = await c.post(CHAT, json={**HELLO, "stream": True})
        plain = await c.post(COMPLETIONS, json={"prompt": "x"})
        health = await c.get("/health")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    access = [e for e in lines if e["event"] == "http.request"]
    assert [(e["path"], e["correlation_id"], e["request_id"]) for e in access] == [
        (CHAT, streamed.headers["x-request-id"], streamed.headers["x-request-id"]),
        (COMPLETIONS, plain.headers["x-request-id"], plain.headers["x-request-id"]),
        ("/health", health.headers["x-request-id"], health.headers["x-request-id"]),
    ]
    assert [e["correlation_id"] for e in access] == ["chatcmpl-one", "cmpl-two", "req-three"]
    assert health.status_code == 200
    assert "correlation_id" not in structlog.contextvars.get_contextvars()


@pytest.mark.usefixtures("restore_structlog")
async def test_error_responses_carry_their_own_request_id() -> None:
    """Every response, errors included, has X-Request-Id; a refused request's id never leaks into the next."""
    out = io.StringIO()
    configure_logging(format="json", level="info", stream=out)
    ids = iter(["a1", "b2", "c3", "d4", "e5"])
    state = HttpState(new_id=lambda: next(ids))
    engine = FakeEngine(scripts=[Script(admission_error=ContextTooLong(9000, 8192))])
    app = create_app(engine, HttpSettings(api_key="k", max_body_bytes=100), state=state)
    auth = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        refused = await c.post(CHAT, json=HELLO, headers=auth)
        models = await c.get("/v1/models", headers=auth)
        unauthorized = await c.get("/v1/models")
        too_big = await c.post(CHAT, content=b"x" * 200,
                               headers={**auth, "content-type": "application/json"})
        missing = await c.get("/nope", headers=auth)
    _assert_openai_error(refused, 400, "context_length_exceeded")
    _assert_openai_error(unauthorized, 401, "invalid_api_key")
    _assert_openai_error(too_big, 413, "request_too_large")
    _assert_openai_error(missing, 404, "not_found")
    responses = [refused, models, unauthorized, too_big, missing]
    assert [r.headers["x-request-id"] for r in responses] == [
        "chatcmpl-a1", "req-b2", "req-c3", "req-d4", "req-e5"]
    access = [json.loads(line) for line in out.getvalue().splitlines()]
    access = [e for e in access if e["event"] == "http.request"]
    assert [e["correlation_id"] for e in access] == [r.headers["x-request-id"] for r in responses]
    assert "correlation_id" not in structlog.contextvars.get_contextvars()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_k": 1001}, "top_k"),
        ({"top_k": 10**6, "temperature": 0.8}, "top_k"),
        ({"logit_bias": {"1000": 5}}, "logit_bias"),
    ],
)
async def test_sampling_fields_are_checked_against_the_vocabulary(extra: dict[str, Any],
                                                                  param: str) -> None:
    """top_k above the vocabulary or a logit_bias id outside it is a 400 naming the field, before the engine."""
    engine = FakeEngine(vocab_size=1000)
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, **extra})
        at_vocab = await c.post(CHAT, json={**HELLO, "top_k": 1000, "temperature": 0.8})
    assert _assert_openai_error(r, 400, "invalid_value")["param"] == param
    assert at_vocab.status_code == 200
    assert len(engine.calls) == 1


async def test_token_prompt_outside_the_vocabulary_names_prompt() -> None:
    """A token-id prompt with an id outside the vocabulary is a 400 naming ``prompt``."""
    engine = FakeEngine(vocab_size=1000)
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": [1, 1000]})
    assert _assert_openai_error(r, 400, "invalid_value")["param"] == "prompt"
    assert engine.calls == []


async def test_image_part_is_400_naming_the_part_type() -> None:
    """An image content part answers 400 that names the part type and says the model is text-only."""
    engine = FakeEngine()
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]})
    body = _assert_openai_error(r, 400, "invalid_value")
    assert body["param"] == "messages.0.content"
    assert "'image_url'" in body["message"]
    assert "text-only" in body["message"]
    assert "more error" not in body["message"]
    assert engine.calls == []


async def test_too_many_messages_is_400_before_the_engine() -> None:
    """A chat with more messages than the bound is a 400 naming ``messages``; the engine never sees it."""
    from actors.http._schemas import MAX_MESSAGES

    engine = FakeEngine()
    many = [{"role": "user", "content": "w"}] * (MAX_MESSAGES + 1)
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": many})
        ok = await c.post(CHAT, json={"messages": many[:MAX_MESSAGES]})
    assert _assert_openai_error(r, 400, "invalid_value")["param"] == "messages"
    assert ok.status_code == 200
    assert len(engine.calls) == 1


async def test_head_health_and_trailing_slashes() -> None:
    """HEAD /health answers 200; a POST with a trailing slash is served, not redirected."""
    engine = FakeEngine()
    async with _client(engine) as c:
        head = await c.head("/health")
        chat = await c.post(CHAT + "/", json=HELLO)
        models = await c.get("/v1/models/")
    assert head.status_code == 200
    assert chat.status_code == 200
    assert chat.json()["object"] == "chat.completion"
    assert models.status_code == 200
    assert len(engine.calls) == 1


async def test_body_that_never_completes_times_out_with_408() -> None:
    """A body that stops arriving (Content-Length larger than what is sent) is answered 408, not held."""
    from actors.http._middleware import BodyTimeoutMiddleware

    engine = FakeEngine()
    app = BodyTimeoutMiddleware(create_app(engine, HttpSettings()), timeout_s=0.2)
    stalled = anyio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", '
        await stalled.wait()  # NOTE: never set: the client sends nothing more.
        yield b"}"

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        with anyio.fail_after(5):
            r = await c.post(CHAT, content=body(), headers={"content-type": "application/json"})
    _assert_openai_error(r, 408, "request_timeout")
    assert r.headers["connection"] == "close"
    assert engine.calls == []


async def test_cut_streams_end_with_an_error_event_and_done() -> None:
    """After cut_streams, a running stream ends with a shutting_down error event then [DONE]; non-streamed is 503."""
    gate, admitted_a, admitted_b = anyio.Event(), anyio.Event(), anyio.Event()
    engine = FakeEngine(scripts=[Script(tokens=("a", "b", "c"), gate=gate, admitted=admitted_a),
                                 Script(gate=gate, admitted=admitted_b)])
    state = HttpState()
    app = create_app(engine, HttpSettings(), state=state)
    got: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:

        async def streamed() -> None:
            got["stream"] = await c.post(CHAT, json={**HELLO, "stream": True})

        async def plain() -> None:
            got["plain"] = await c.post(CHAT, json=HELLO)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(streamed)
                await admitted_a.wait()
                tg.start_soon(plain)
                await admitted_b.wait()
                begin_shutdown(app)
                cut_streams(app)
    events = _sse(got["stream"].text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"
    assert all("error" not in e for e in events[:-2])
    _assert_openai_error(got["plain"], 503, "shutting_down")
    assert all(call.closed and not call.finished for call in engine.calls)
    assert state.in_flight == 0
    assert state.disconnects == 0
