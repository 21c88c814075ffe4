"""End to end: a real ``kvtier serve`` on the default model, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

KEY = "e2e-secret"
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a long story about a dragon."}]
REF_TOKENS = 12
MAX_PROMPT = 300
CONTEXT = 8192  # NOTE: SmolLM2-135M's max_position_embeddings


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the whole module (model load is the expensive part)."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("serve"),
        "--api-key", KEY, "--max-tokens", "16", "--max-tokens-limit", "10000",
        "--max-body-bytes", "65536", "--max-queue", "4", "--prompt-cache", "0.2",
        "--max-prompt-tokens", str(MAX_PROMPT),
    )
    yield srv
    assert srv.stop() == 0, srv.logs()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official client; retries off so every status is observed as sent."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> str:
    """Greedy non-streamed text of the story prompt (the model does not stop within REF_TOKENS)."""
    r = client.chat.completions.create(model="default", messages=STORY,
                                       max_tokens=REF_TOKENS, temperature=0)
    assert r.choices[0].finish_reason == "length"
    content = r.choices[0].message.content
    assert content
    return content


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_chat_non_streaming(client: openai.OpenAI, reference: str) -> None:
    """A non-streamed chat answer carries OpenAI's fields, exact usage, and a prompt-cache hit."""
    served = client.models.list().data[0].id
    r = client.chat.completions.create(model=served, messages=STORY,
                                       max_tokens=REF_TOKENS, temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == served
    assert r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == REF_TOKENS
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + REF_TOKENS
    assert r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens
    # NOTE: `reference` sent this very prompt before, so the RAM tier serves all but its last token.
    assert cached is not None
    assert 0 < cached < r.usage.prompt_tokens


def test_stats_report_the_prompt_cache(server: ServerProcess, reference: str) -> None:
    """/stats shows the RAM tier's hits, entries and bytes, with bytes inside the cap."""
    httpx.post(f"{server.url}/v1/chat/completions", headers=_auth(), timeout=120,
               json={"model": "default", "messages": STORY, "max_tokens": 2, "temperature": 0})
    pc = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=10).json()["engine"]["prompt_cache"]
    assert pc["hits"] >= 1
    assert pc["entries"] >= 1
    assert 0 < pc["bytes"] <= pc["cap_bytes"]


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, reference: str) -> None:
    """Streamed deltas join to the greedy non-streamed text; the usage chunk comes last."""
    stream = client.chat.completions.create(
        model="default", messages=STORY, max_tokens=REF_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == REF_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    """/v1/completions: streamed text equals non-streamed text; max_tokens bounds the length."""
    r = client.completions.create(model="default", prompt="The capital of France is",
                                  max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.usage is not None
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(model="default", prompt="The capital of France is",
                                         max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_several_choices_through_the_openai_client(client: openai.OpenAI) -> None:
    """A batch of prompts with n=2, streamed and not: greedy choices equal one-choice answers, numbered prompt-major, each prompt counted once."""
    prompts = ["The capital of France is", "Once upon a time"]
    singles = [client.completions.create(model="default", prompt=p, max_tokens=6, temperature=0)
               for p in prompts]
    r = client.completions.create(model="default", prompt=prompts, n=2, max_tokens=6,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [s.choices[0].text for s in singles]
    assert [c.text for c in r.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles
                                                if s.usage)
    streamed = client.completions.create(model="default", prompt=prompts, n=2, max_tokens=6,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    parts: dict[int, str] = {}
    usage = None
    for chunk in streamed:
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert parts == {i: c.text for i, c in enumerate(r.choices)}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens,
                                                              r.usage.completion_tokens)


def test_choices_of_one_prompt_prefill_it_once(server: ServerProcess,
                                               client: openai.OpenAI) -> None:
    """n=3 over a new 200-token prompt: the second and third choices reuse the first's prefill (cache-served tokens)."""

    def served() -> int:
        stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=30).json()
        return int(stats["engine"]["prompt_cache"]["cached_tokens_served"])

    prompt = "Choices " + " ".join(f"w{i}" for i in range(100))
    before = served()
    r = client.completions.create(model="default", prompt=prompt, n=3, max_tokens=2,
                                  temperature=0)
    assert r.usage is not None
    assert r.usage.prompt_tokens > 150
    # NOTE: each sibling takes the prompt up to its stable boundary (one token short).
    assert served() - before >= 2 * (r.usage.prompt_tokens - 1)


def test_seeded_choices_differ_and_repeat(client: openai.OpenAI) -> None:
    """n=3 sampled with a seed: the three answers differ, the request repeats exactly, and choice 0 is the n=1 answer."""

    def ask(n: int) -> list[str | None]:
        r = client.chat.completions.create(model="default", messages=STORY, n=n, max_tokens=8,
                                           temperature=1.0, seed=7)
        return [c.message.content for c in r.choices]

    first = ask(3)
    assert len(first) == 3
    assert len(set(first)) > 1
    assert ask(3) == first
    assert ask(1) == first[:1]
    streamed = client.chat.completions.create(model="default", messages=STORY, n=3, max_tokens=8,
                                              temperature=1.0, seed=7, stream=True)
    parts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
    assert [parts[i] for i in range(3)] == first


def test_stop_string_cuts_output(client: openai.OpenAI, reference: str) -> None:
    """A stop string taken from the greedy output ends the answer just before it, finish 'stop'."""
    words = reference.split()
    assert len(words) >= 4
    stop = words[3]
    expected = reference[: reference.index(stop)]
    r = client.chat.completions.create(model="default", messages=STORY,
                                       max_tokens=REF_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_bounds_the_answer(client: openai.OpenAI, reference: str) -> None:
    """max_tokens=3 yields exactly 3 completion tokens with finish 'length' (a prefix of the reference)."""
    r = client.chat.completions.create(model="default", messages=STORY,
                                       max_tokens=3, temperature=0)
    assert r.usage is not None
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"
    content = r.choices[0].message.content
    assert content
    assert reference.startswith(content)


def test_two_concurrent_clients(server: ServerProcess, reference: str) -> None:
    """Two clients streaming at once both get the complete greedy answer."""

    async def one(aclient: openai.AsyncOpenAI) -> str:
        stream = await aclient.chat.completions.create(
            model="default", messages=STORY, max_tokens=REF_TOKENS,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def both() -> list[str]:
        clients = [openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) for _ in range(2)]
        try:
            return list(await asyncio.gather(*(one(c) for c in clients)))
        finally:
            for c in clients:
                await c.close()

    assert asyncio.run(both()) == [reference, reference]


def _wait_released(server: ServerProcess, disconnects_before: int) -> dict[str, Any]:
    """/stats once no response is in flight and the disconnect was counted (10 s at most)."""
    stats: dict[str, Any] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=10).json()
        http = stats["http"]
        if http["in_flight"] == 0 and http["client_disconnects"] > disconnects_before:
            break
        time.sleep(0.1)
    return stats


def _disconnects(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=10).json()
    return int(stats["http"]["client_disconnects"])


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_lane(server: ServerProcess, client: openai.OpenAI,
                                          stream: bool) -> None:
    """A client leaving mid-generation (streamed or not) releases its request at once; the next is served."""
    before = _disconnects(server)
    body = {"messages": STORY, "max_tokens": 2000, "temperature": 0, "stream": stream}
    if stream:
        with httpx.Client(base_url=server.url, headers=_auth(), timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=_auth(),
                       timeout=httpx.Timeout(10, read=1.5))
    # NOTE: 2000 tokens take minutes here; the request must be gone within seconds.
    stats = _wait_released(server, before)
    assert stats["http"]["in_flight"] == 0, stats
    assert stats["http"]["client_disconnects"] == before + 1
    r = client.chat.completions.create(model="default", messages=STORY,
                                       max_tokens=2, temperature=0, timeout=30)
    assert r.usage is not None
    assert r.usage.completion_tokens == 2


def test_models_stats_health(server: ServerProcess, client: openai.OpenAI) -> None:
    """/v1/models lists the served model; /stats has engine and http sections; /health needs no key."""
    ids = [m.id for m in client.models.list().data]
    assert len(ids) == 1
    stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=10).json()
    assert isinstance(stats["engine"], dict)
    assert stats["engine"]
    assert stats["http"]["responses_by_status"]["200"] >= 1
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b"{not json", None, 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": 5}]}', None, 400, "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', None, 400,
         "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', None, 400,
         "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 10000000}', None, 400,
         "invalid_value"),
        (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}', None, 404,
         "model_not_found"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode(), None, 413,
         "request_too_large"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', {"Authorization": ""}, 401,
         "invalid_api_key"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', {"Authorization": "Bearer bad"}, 401,
         "invalid_api_key"),
    ],
)
def test_bad_input_is_4xx_with_openai_body(server: ServerProcess, content: bytes,
                                           headers: dict[str, str] | None, status: int,
                                           code: str) -> None:
    """Bad input gets its 4xx and an OpenAI error body, never a 500."""
    h = {**_auth(), "Content-Type": "application/json", **(headers or {})}
    if h.get("Authorization") == "":
        del h["Authorization"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code


def test_openai_client_sees_typed_errors(server: ServerProcess, client: openai.OpenAI) -> None:
    """The openai client raises its typed errors for 400, 404 and 401 answers."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=STORY,
                                       max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model",
                                       messages=STORY)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _admitted(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=10).json()
    return int(stats["engine"]["gateway"]["token"]["requests"]["admitted"])


@pytest.mark.parametrize("case", ["max_prompt_tokens", "context"])
def test_prompt_over_a_limit_is_400_before_admission(server: ServerProcess, client: openai.OpenAI,
                                                     case: str) -> None:
    """A prompt over --max-prompt-tokens, or prompt + max_tokens over the model's context, is a 400 and is never admitted."""
    if case == "max_prompt_tokens":
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "hello " * (MAX_PROMPT + 50)}]
        max_tokens = 4
    else:
        messages = STORY
        max_tokens = CONTEXT - 10
    before = _admitted(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens)
    assert info.value.code == "context_length_exceeded"
    assert ("max_prompt_tokens" if case == "max_prompt_tokens" else "context") in info.value.message
    assert _admitted(server) == before
    r = client.chat.completions.create(model="default", messages=STORY, max_tokens=2)
    assert r.usage is not None
    assert r.usage.completion_tokens == 2


def test_top_k_over_vocabulary_is_400_and_sampling_keeps_working(server: ServerProcess) -> None:
    """top_k past the vocabulary is a 400 naming top_k; unseeded sampled requests before and after it succeed."""

    def chat(**fields: Any) -> httpx.Response:
        body = {"messages": STORY, "max_tokens": 4, **fields}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=_auth(),
                          timeout=60)

    assert chat(temperature=0.7).status_code == 200
    for top_k in (1_000_000, 10**30):
        refused = chat(temperature=0.8, top_k=top_k)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "top_k"
    at_vocab = chat(temperature=0.8, top_k=49152)
    assert at_vocab.status_code == 200, at_vocab.text
    for _ in range(3):
        again = chat(temperature=0.7)
        assert again.status_code == 200, again.text


def test_small_http_contract_points(server: ServerProcess) -> None:
    """HEAD /health is 200, a trailing slash is served (no 307), strict types are 400, errors carry X-Request-Id."""
    head = httpx.head(f"{server.url}/health", timeout=10)
    assert head.status_code == 200
    slash = httpx.post(f"{server.url}/v1/chat/completions/", headers=_auth(), timeout=60,
                       json={"messages": STORY, "max_tokens": 2})
    assert slash.status_code == 200, slash.text
    assert slash.json()["object"] == "chat.completion"
    for field, value in (("max_tokens", "10"), ("max_tokens", True), ("stream", "yes")):
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=_auth(), timeout=30,
                       json={"messages": STORY, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field
        assert r.headers["x-request-id"].startswith("req-")


def test_oversized_body_written_before_reading_gets_413(server: ServerProcess) -> None:
    """urllib writes the whole oversized body before reading: it still receives the OpenAI 413."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.url}/v1/chat/completions", method="POST",
                                 data=b"x" * (4 * 1024 * 1024),
                                 headers={**_auth(), "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert json.loads(info.value.read())["error"]["code"] == "request_too_large"


def test_edge_refuses_browser_posts_rebinding_and_keyless_admin(server: ServerProcess) -> None:
    """On the real loopback server: a text/plain POST gets 415, Host: evil.example gets 400,
    an admin route without the key gets 401, and /health names no model path."""
    body = json.dumps({"messages": STORY, "max_tokens": 2}).encode()
    plain = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=30,
                       headers={**_auth(), "Content-Type": "text/plain"})
    assert plain.status_code == 415, plain.text
    assert plain.json()["error"]["code"] == "unsupported_media_type"
    evil = httpx.get(f"{server.url}/v1/models", headers={**_auth(), "Host": "evil.example"},
                     timeout=10)
    assert evil.status_code == 400, evil.text
    assert evil.json()["error"]["code"] == "invalid_host"
    admin = httpx.post(f"{server.url}/admin/cache/flush", timeout=10,
                       headers={"Content-Type": "application/json"})
    assert admin.status_code == 401, admin.text
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
