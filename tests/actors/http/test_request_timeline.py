"""The per-request timeline: marks from arrival to the first byte, its log line and ``/stats``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import pytest
from structlog.testing import capture_logs

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from actors.http._timeline import (
    ADMISSION_PARTS,
    MARKS,
    PHASES,
    TimedStream,
    Timeline,
    TimelineWindow,
    admission_parts,
    timeline_marks,
)
from messages.gateway import DoneEvent, GenerationEvent, Timings, TokenEvent, Usage
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = [5 + i % 80 for i in range(48)]


def test_marks_place_the_engine_offsets_after_the_admission() -> None:
    """Scripted engine offsets become ms after arrival, in order, ending at the first byte."""
    timings = Timings(admitted_at=10.010, lookup_start_s=0.001, lookup_done_s=0.004,
                      queued_s=0.020, ttft_s=0.050)
    marks = timeline_marks(10.0, 10.011, timings, 10.070)
    assert marks == pytest.approx({"admitted": 10.0, "lookup_start": 11.0, "lookup_done": 14.0,
                                   "joined": 30.0, "first_token": 60.0, "first_byte": 70.0})


def test_marks_stay_ordered_when_the_engine_clock_is_not_the_edges() -> None:
    """An engine clock far from the edge's: admission clamped into [arrival, admission seen],
    every mark into [previous, first byte], so the phases still sum to the first byte."""
    timings = Timings(admitted_at=5000.0, lookup_start_s=None, lookup_done_s=None,
                      queued_s=0.5, ttft_s=9.0)
    marks = timeline_marks(1.0, 1.002, timings, 1.100)
    values = [marks[m] for m in MARKS]
    assert values == sorted(values)
    assert marks["admitted"] == pytest.approx(2.0)
    assert marks["first_byte"] == pytest.approx(100.0)
    assert marks["first_token"] == pytest.approx(100.0)


class _TakenBack:
    """A stream the engine took back to admission once: admitted again at 4.999 s (its engine
    marks count from there), a token 50 ms later, then its end."""

    def __init__(self, readmitted_at: float | None,
                 render_span: tuple[float, float, float] | None = None) -> None:
        self._readmitted_at = readmitted_at
        self._render_span = render_span
        self._events: list[GenerationEvent] = [
            TokenEvent(request_id="r", index=0, token_id=101, text="Hi"),
            DoneEvent(request_id="r", finish_reason="stop",
                      usage=Usage(prompt_tokens=7, completion_tokens=1, cached_tokens=0),
                      timings=Timings(admitted_at=4.999, queued_s=0.01, ttft_s=0.05)),
        ]

    async def start(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    async def aclose(self) -> None:
        return None

    @property
    def prompt_tokens(self) -> int:
        return 7

    @property
    def readmitted_at(self) -> float | None:
        return self._readmitted_at

    @property
    def render_span(self) -> tuple[float, float, float] | None:
        return self._render_span


async def test_a_take_back_to_admission_is_admission_time_not_write_time() -> None:
    """A request first admitted at 1 ms, taken back and admitted again at 5 s: its wait is the
    ``admission`` phase and ``write`` is only the 11 ms from its first token to its first byte
    (kept at the first admission, the engine's marks were clamped there and ~5 s fell into
    ``write``); the log line says it was taken back."""
    now = [0.001]
    timeline = Timeline("r", arrived=0.0, clock=lambda: now[0])
    timeline.admitted()
    async for event in TimedStream(_TakenBack(readmitted_at=4.9995), timeline):
        if isinstance(event, TokenEvent):
            now[0] = 5.060
            timeline.wrote()
    with capture_logs() as logs:
        marks = TimelineWindow().record(timeline)
    assert marks is not None
    (line,) = [entry for entry in logs if entry["event"] == "request.timeline"]
    assert line["taken_back"] is True
    phases = line["phases_ms"]
    assert phases["admission"] == pytest.approx(4999.0)
    assert phases["write"] == pytest.approx(11.0)
    assert sum(phases.values()) == pytest.approx(5060.0)


def test_admission_parts_split_at_the_render_and_sum_to_the_admission() -> None:
    """Arrival at 10 s, render asked at +2 ms, taken by a thread at +10, done at +15, admitted
    at +20: parse 2, render_wait 8, render 5, admit 5; points outside arrival..admission are
    clamped, so no part is negative and the parts still sum to the admission."""
    parts = admission_parts(10.0, (10.002, 10.010, 10.015), 20.0)
    assert list(parts) == list(ADMISSION_PARTS)
    assert [round(v, 6) for v in parts.values()] == [2.0, 8.0, 5.0, 5.0]
    skewed = admission_parts(10.0, (9.0, 10.004, 10.050), 20.0)
    assert [round(v, 6) for v in skewed.values()] == [0.0, 4.0, 16.0, 0.0]
    assert sum(skewed.values()) == pytest.approx(20.0)


async def test_a_rendered_request_logs_its_admission_parts_unless_taken_back() -> None:
    """A stream that reports its render: the log line splits ``admission`` into parts summing to
    it and /stats gives their distribution; the same request taken back to admission logs none
    (its admission holds the wait for memory, which the parts do not name)."""
    window = TimelineWindow()
    now = [0.0]
    for again in (None, 4.9995):
        now[0] = 0.001
        timeline = Timeline("r", arrived=0.0, clock=lambda: now[0])
        timeline.admitted()
        stream = _TakenBack(readmitted_at=again, render_span=(0.0002, 0.0003, 0.0007))
        async for event in TimedStream(stream, timeline):
            if isinstance(event, TokenEvent):
                now[0] = 5.060
                timeline.wrote()
        with capture_logs() as logs:
            window.record(timeline)
        (line,) = [entry for entry in logs if entry["event"] == "request.timeline"]
        if again is None:
            parts = line["admission_parts_ms"]
            assert parts == pytest.approx({"parse": 0.2, "render_wait": 0.1, "render": 0.4,
                                           "admit": 0.3})
            assert sum(parts.values()) == pytest.approx(line["phases_ms"]["admission"])
        else:
            assert "admission_parts_ms" not in line
    snap = window.snapshot()
    assert snap["rendered"] == 1
    assert snap["admission_parts_ms"]["render"]["p50"] == pytest.approx(0.4)


def test_window_keeps_the_last_requests_and_reports_nearest_rank_percentiles() -> None:
    """Five requests into a window of four: the oldest leaves; p50/p99 by nearest rank."""
    window = TimelineWindow(size=4)
    for i in range(5):
        line = Timeline(f"r{i}", arrived=0.0, clock=lambda: 0.0, admit_seen=0.001,
                        token_seen=True, first_byte=0.1 * (i + 1),
                        timings=Timings(admitted_at=0.001, queued_s=0.0, ttft_s=0.01))
        window.record(line)
    snap = window.snapshot()
    assert (snap["requests"], snap["recorded"], snap["window"]) == (4, 5, 4)
    # first bytes of the four kept: 200, 300, 400, 500 ms
    assert snap["phases_ms"]["first_byte"] == {"p50": 300.0, "p90": 500.0, "p99": 500.0}
    assert snap["phases_ms"]["write"]["p50"] == pytest.approx(300.0 - 11.0)


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


@pytest.fixture(params=[1, 4], ids=["serial", "batch"])
async def client(request: pytest.FixtureRequest, tmp_path: Path,
                 model: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app over a real Engine with the RAM prompt cache, on the serial or the batch lane."""
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=1 << 26, ssd_cache="off",
                                max_batch=request.param)
    async with engine:
        app = create_app(engine, HttpSettings())
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as c:
            yield c


async def _ttft(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, float]:
    """Stream a completion; its request id and the client's time to the first token's chunk (ms)."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
    sent = time.monotonic()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    first = time.monotonic()
    assert first is not None
    return rid, (first - sent) * 1e3


async def test_phases_are_ordered_and_sum_to_the_clients_ttft(client: httpx.AsyncClient) -> None:
    """Over a real engine: the timeline line of each streamed request has ordered marks, a
    lookup, and phases that sum to its first byte, within 50 ms of the TTFT the client saw,
    and the engine's decode time and token count; /stats reports the distributions of both requests."""
    with capture_logs() as logs:
        seen = [await _ttft(client, PROMPT), await _ttft(client, [*PROMPT, 7, 8, 9])]
    lines = {e["request_id"]: e for e in logs if e["event"] == "request.timeline"}
    assert set(lines) == {rid for rid, _ in seen}
    for rid, ttft_ms in seen:
        line = lines[rid]
        marks = [line[f"{m}_ms"] for m in MARKS]
        assert marks == sorted(marks), line
        assert line["looked_up"] is True
        assert line["lookup_done_ms"] >= line["lookup_start_ms"] >= line["admitted_ms"]
        assert line["first_token_ms"] > line["joined_ms"], "the first step takes time"
        assert sum(line["phases_ms"].values()) == pytest.approx(line["first_byte_ms"], abs=0.01)
        assert line["first_byte_ms"] <= ttft_ms + 1.0
        assert ttft_ms - line["first_byte_ms"] < 50.0, (ttft_ms, line)
        # the engine-side decode figures: 4 tokens, 3 of them from decode steps
        assert line["tokens"] == 4, line
        assert line["decode_ms"] > 0.0, line
    stats = (await client.get("/stats")).json()["http"]["timeline"]
    assert stats["requests"] == stats["recorded"] == 2
    assert set(stats["phases_ms"]) == {*PHASES, "first_byte"}
    slowest = max(line["first_byte_ms"] for line in lines.values())
    assert stats["phases_ms"]["first_byte"]["p99"] == pytest.approx(slowest, abs=0.001)


async def test_each_choice_of_a_streamed_multi_choice_request_has_its_timeline(
    client: httpx.AsyncClient,
) -> None:
    """A streamed request with n=3: one timeline line per choice, named by its choice id, ordered
    marks summing to a first byte no later than the client saw that choice's first text chunk;
    /stats counts three requests."""
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0, "n": 3}
    sent = time.monotonic()
    first: dict[int, float] = {}
    with capture_logs() as logs:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            async for text in r.aiter_lines():
                if text.startswith("data: {"):
                    chunk = json.loads(text.removeprefix("data: "))
                    for choice in chunk["choices"]:
                        if choice.get("text") and choice["index"] not in first:
                            first[choice["index"]] = (time.monotonic() - sent) * 1e3
    assert sorted(first) == [0, 1, 2]
    lines = {e["request_id"]: e for e in logs if e["event"] == "request.timeline"}
    assert set(lines) == {rid, f"{rid}-1", f"{rid}-2"}
    for c, choice_rid in enumerate((rid, f"{rid}-1", f"{rid}-2")):
        line = lines[choice_rid]
        marks = [line[f"{m}_ms"] for m in MARKS]
        assert marks == sorted(marks), line
        assert sum(line["phases_ms"].values()) == pytest.approx(line["first_byte_ms"], abs=0.01)
        assert line["first_byte_ms"] <= first[c] + 1.0, (c, line, first)
        assert line["tokens"] == 4, line
    stats = (await client.get("/stats")).json()["http"]["timeline"]
    assert stats["requests"] == stats["recorded"] == 3


async def test_a_chat_requests_admission_parts_come_from_its_render(
    client: httpx.AsyncClient,
) -> None:
    """Over a real engine: a streamed chat (rendered with the template on a worker thread) logs
    admission parts that sum to its admission phase, with a render that took time; /stats counts
    it as rendered; a completion given as token ids renders nothing and logs no parts."""
    body = {"messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 2,
            "stream": True, "temperature": 0}
    with capture_logs() as logs:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chat_rid = r.headers["x-request-id"]
            async for _ in r.aiter_lines():
                pass
        ids_rid, _ = await _ttft(client, PROMPT)
    lines = {e["request_id"]: e for e in logs if e["event"] == "request.timeline"}
    parts = lines[chat_rid]["admission_parts_ms"]
    assert list(parts) == list(ADMISSION_PARTS)
    assert min(parts.values()) >= 0.0
    assert parts["render"] > 0.0
    assert sum(parts.values()) == pytest.approx(lines[chat_rid]["phases_ms"]["admission"], abs=0.01)
    assert "admission_parts_ms" not in lines[ids_rid]
    stats = (await client.get("/stats")).json()["http"]["timeline"]
    assert (stats["requests"], stats["rendered"]) == (2, 1)
    assert set(stats["admission_parts_ms"]) == set(ADMISSION_PARTS)
