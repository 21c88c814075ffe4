"""Several choices in one request: ``n`` on both endpoints and batches of prompts on ``/v1/completions``."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.errors import QueueFull
from actors.http import HttpSettings, HttpState, begin_shutdown, create_app, cut_streams
from actors.http._schemas import MAX_CHOICES

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ASK = [{"role": "user", "content": "hi"}]


def _client(engine: FakeEngine, settings: HttpSettings | None = None) -> httpx.AsyncClient:
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    app = create_app(engine, settings or HttpSettings(), state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param, err
    return err


async def test_chat_n_answers_n_choices_with_their_own_seeds_and_usage_once() -> None:
    """n=3: three choices indexed 0..2, each a generation of its own (seed, seed+1, seed+2); the prompt counted once."""
    engine = FakeEngine(scripts=[
        Script(tokens=("a",), prompt_tokens=9, cached_tokens=4),
        Script(tokens=("b", "c"), prompt_tokens=9, cached_tokens=9),
        Script(tokens=("d", "e", "f"), prompt_tokens=9, cached_tokens=9),
    ])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 3, "seed": 41, "temperature": 0.7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert [ch["message"]["content"] for ch in body["choices"]] == ["a", "bc", "def"]
    assert [call.params.seed for call in engine.calls if call.params] == [41, 42, 43]
    assert [call.request_id for call in engine.calls] == ["chatcmpl-abc", "chatcmpl-abc-1",
                                                          "chatcmpl-abc-2"]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0


async def test_completions_batch_numbers_choices_prompt_major() -> None:
    """Two prompts, n=2: choice i*n+j is prompt i's j-th; each prompt's tokens counted once."""
    engine = FakeEngine(scripts=[Script(tokens=(t,), prompt_tokens=p)
                                 for t, p in (("x", 5), ("y", 5), ("z", 8), ("w", 8))])
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["one", "two"], "n": 2, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "x"), (1, "y"), (2, "z"), (3, "w")]
    # NOTE: the scripts pop in creation order; the window (8) starts all four in choice order.
    assert [call.payload for call in engine.calls] == ["one", "one", "two", "two"]
    assert body["usage"]["prompt_tokens"] == 5 + 8
    assert body["usage"]["completion_tokens"] == 4


async def test_token_id_batches_and_a_single_token_prompt_are_told_apart() -> None:
    """[[1, 2], [3]] is two prompts of token ids, marked shared; [1, 2, 3] stays one prompt, unmarked."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": [[1, 2], [3]], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        r = await c.post(COMPLETIONS, json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
    assert [call.payload for call in engine.calls] == [[1, 2], [3], [1, 2, 3]]
    # NOTE: a batch's prompts are marked shared (each takes the prompt snapshot); one prompt is not.
    assert engine.shared_prompt == [True, True, False]


async def test_a_batch_token_outside_the_vocabulary_is_a_400_before_any_generation() -> None:
    """Every prompt of a batch is checked against the vocabulary, not only the first."""
    engine = FakeEngine(vocab_size=100)
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": [[1, 2], [3, 100]]})
    _error(r, 400, "prompt")
    assert engine.calls == []


async def test_an_empty_prompt_in_a_batch_is_a_400() -> None:
    """A batch with one empty string is refused whole."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["fine", ""]})
    assert r.status_code == 400, r.text
    assert engine.calls == []


def _sse(text: str) -> list[Any]:
    """An SSE body's JSON payloads ("[DONE]" kept as a string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_streamed_chat_choices_carry_their_index_and_end_once() -> None:
    """stream with n=2: each choice's opener, text and finish under its index; one usage tail (prompt once); one [DONE] last."""
    engine = FakeEngine(scripts=[Script(tokens=("a", "b"), prompt_tokens=9, cached_tokens=2),
                                 Script(tokens=("c",), prompt_tokens=9, cached_tokens=9)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 2, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    text = {i: "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks
                       if ch["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "ab", 1: "c"}
    for i in (0, 1):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert mine[-1]["finish_reason"] == "stop"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                                   "prompt_tokens_details": {"cached_tokens": 2}}
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0


async def test_streamed_completion_batch_numbers_choices_prompt_major() -> None:
    """A streamed batch of two prompts: each prompt's text under index i (its only choice)."""
    engine = FakeEngine(scripts=[Script(tokens=("x", "y")), Script(tokens=("z",))])
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["one", "two"], "stream": True})
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    text = {i: "".join(e["choices"][0]["text"] for e in events[:-1]
                       if e["choices"] and e["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "xy", 1: "z"}
    assert [call.payload for call in engine.calls] == ["one", "two"]


async def test_a_streamed_choice_failing_ends_the_stream_with_an_error_event() -> None:
    """One choice failing mid-answer: an error event last, no [DONE], every choice closed."""
    hold = anyio.Event()
    engine = FakeEngine(scripts=[Script(gate=hold), Script(fail_after=1), Script(gate=hold)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 3, "stream": True})
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert events[-1]["error"]["code"] == "generation_failed"
    assert "[DONE]" not in events
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0


async def test_a_streamed_request_refused_before_its_first_byte_gets_the_status() -> None:
    """A choice refused at admission before the stream starts: the request's status is the refusal (429), nothing left open."""
    engine = FakeEngine(scripts=[Script(), Script(admission_error=QueueFull(4, 4))])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 2, "stream": True})
    assert r.status_code == 429, r.text
    assert all(call.closed for call in engine.calls)
    assert not any(call.finished for call in engine.calls)
    assert engine.active == 0


async def test_streamed_choices_beyond_the_window_start_as_others_end() -> None:
    """Window 2, five streamed choices: all five answer in full, never more than two open at once."""
    engine = FakeEngine(scripts=[Script(tokens=(str(i), "!")) for i in range(5)])
    peak = 0
    real_next = engine._next

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal peak
        peak = max(peak, sum(not call.closed for call in engine.calls) + 1)
        return real_next(*args, **kwargs)

    engine._next = counting  # type: ignore[method-assign]
    async with _client(engine, HttpSettings(choice_window=2)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "p", "n": 5, "stream": True})
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    text = {i: "".join(e["choices"][0]["text"] for e in events[:-1]
                       if e["choices"] and e["choices"][0]["index"] == i) for i in range(5)}
    assert text == {i: f"{i}!" for i in range(5)}
    assert peak <= 2
    assert engine.active == 0


async def test_too_many_choices_are_refused() -> None:
    """n over the bound, or prompts x n over it, is a 400 naming n."""
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": MAX_CHOICES + 1})
        _error(r, 400, "n")
        r = await c.post(COMPLETIONS, json={"prompt": ["a"] * 3, "n": MAX_CHOICES // 2})
        err = _error(r, 400, "n")
        assert str(MAX_CHOICES) in err["message"]
    assert engine.calls == []


async def test_one_refused_choice_fails_the_request_and_releases_the_others() -> None:
    """A choice refused at admission (queue full) is the answer (429); every other choice is closed."""
    hold = anyio.Event()
    engine = FakeEngine(scripts=[Script(gate=hold), Script(admission_error=QueueFull(4, 4)),
                                 Script(gate=hold)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={"messages": ASK, "n": 3})
    assert r.status_code == 429, r.text
    assert len(engine.calls) == 3
    assert all(call.closed for call in engine.calls)
    assert not any(call.finished for call in engine.calls)
    assert engine.active == 0


async def test_the_choice_window_bounds_how_many_generate_at_once() -> None:
    """With a window of 2, a request of 5 choices never has more than 2 streams made or admitted."""
    gates = [anyio.Event() for _ in range(5)]
    engine = FakeEngine(scripts=[Script(tokens=(str(i),), gate=g) for i, g in enumerate(gates)])
    seen: list[tuple[int, int]] = []
    result: dict[str, httpx.Response] = {}
    async with _client(engine, HttpSettings(choice_window=2)) as c, \
            anyio.create_task_group() as tg:

        async def ask() -> None:
            result["r"] = await c.post(COMPLETIONS, json={"prompt": "p", "n": 5})

        tg.start_soon(ask)
        for gate in gates:
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            seen.append((len(engine.calls), engine.active))
            gate.set()
    assert result["r"].status_code == 200, result["r"].text
    assert [ch["text"] for ch in result["r"].json()["choices"]] == ["0", "1", "2", "3", "4"]
    assert seen[0] == (2, 2)
    assert all(active <= 2 for _, active in seen)
    assert engine.active == 0


async def test_a_choice_failing_mid_answer_fails_the_request() -> None:
    """A generation failure in one choice is the answer (500 generation_failed); the others are cancelled and closed."""
    hold = anyio.Event()
    engine = FakeEngine(scripts=[Script(gate=hold), Script(fail_after=1), Script(gate=hold)])
    async with _client(engine) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["a", "b", "c"]})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "generation_failed"
    assert all(call.closed for call in engine.calls)
    assert not any(call.finished for call in engine.calls)
    assert engine.active == 0


async def test_a_streamed_choice_failing_at_once_closes_the_choices_admitted_beside_it() -> None:
    """Streamed, four choices admitted before the response, the first failing at once: the last
    one's task is cancelled before it runs, and its stream is closed all the same."""
    engine = FakeEngine(scripts=[Script(tokens=("x",), fail_after=0), *[Script(tokens=("x",))] * 3])
    async with _client(engine, HttpSettings(choice_window=4)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["a", "b"], "n": 2, "stream": True})
    assert r.status_code == 200, r.text
    assert "error" in _sse(r.text)[-1]
    assert len(engine.calls) == 4
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0


async def test_shutdown_cut_ends_a_request_of_several_choices_with_503() -> None:
    """The shutdown cut ends the choices still generating; the request answers 503, never a partial body."""
    hold = anyio.Event()
    engine = FakeEngine(scripts=[Script(tokens=("x",)), Script(gate=hold)])
    state = HttpState()
    app = create_app(engine, HttpSettings(), state=state)
    result: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c, \
            anyio.create_task_group() as tg:

        async def ask() -> None:
            result["r"] = await c.post(CHAT, json={"messages": ASK, "n": 2})

        tg.start_soon(ask)
        for _ in range(50):
            await anyio.lowlevel.checkpoint()
        begin_shutdown(app)
        cut_streams(app)
    assert result["r"].status_code == 503, result["r"].text
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0


_FATES = st.sampled_from(["ok", "ok", "ok", "refused", "fails"])


@given(n=st.integers(1, 3), prompts=st.integers(1, 3), stream=st.booleans(),
       window=st.integers(1, 4), fates=st.lists(_FATES, min_size=9, max_size=9))
@settings(max_examples=60, deadline=None, database=None)
def test_any_mix_of_choices_and_failures_answers_once_and_leaves_nothing_open(
        n: int, prompts: int, stream: bool, window: int, fates: list[str]) -> None:
    """Whatever the choices' count, window, streaming and failures: one complete answer or one error, every stream closed."""
    count = n * prompts
    scripts = [Script(tokens=(f"t{c}",), admission_error=QueueFull(4, 4) if fate == "refused"
                      else None, fail_after=0 if fate == "fails" else None)
               for c, fate in enumerate(fates[:count])]
    engine = FakeEngine(scripts=scripts)

    async def run() -> httpx.Response:
        async with _client(engine, HttpSettings(choice_window=window)) as c:
            return await c.post(COMPLETIONS, json={
                "prompt": [f"p{i}" for i in range(prompts)], "n": n, "stream": stream})

    r = anyio.run(run)
    bad = [fate for fate in fates[:count] if fate != "ok"]
    assert all(call.closed for call in engine.calls)
    assert engine.active == 0
    if stream and r.status_code == 200:
        events = _sse(r.text)
        if bad:
            assert "error" in events[-1], events[-1]
            assert "[DONE]" not in events
        else:
            assert events[-1] == "[DONE]"
        return
    if bad:
        assert r.status_code in (429, 500), r.text
        return
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["text"] for ch in body["choices"]] == [f"t{c}" for c in range(count)]
