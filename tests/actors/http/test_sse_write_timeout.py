"""The SSE response's write deadline: a write the client never takes ends the response within
the deadline, releases the engine request once, and says so once in the log."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest
from starlette.types import Message
from structlog.testing import capture_logs

from actors.http._sse import EventStreamResponse

pytestmark = pytest.mark.anyio

TIMEOUT = 0.3


class StuckClient:
    """An ASGI ``send`` whose connection takes ``room`` body messages, then waits forever
    (the server's ``send`` blocks while the client reads nothing)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.sent: list[Message] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            if self.room == 0:
                await anyio.sleep_forever()
            self.room -= 1
        self.sent.append(message)

    @staticmethod
    async def receive() -> Message:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def _endless() -> AsyncIterator[bytes]:
    n = 0
    while True:
        yield f"data: {n}\n\n".encode()
        n += 1
        await anyio.lowlevel.checkpoint()


async def _never() -> None:
    await anyio.sleep_forever()


@pytest.mark.parametrize("with_cut", [False, True])
async def test_a_write_the_client_never_takes_ends_the_response_at_the_deadline(
    with_cut: bool,
) -> None:
    """An endless stream to a client that takes 3 events and then nothing: the response ends
    within the deadline (plus scheduling), on_close runs exactly once, the response says it
    stalled, and one warning names the request id."""
    client = StuckClient(room=3)
    closes: list[float] = []

    async def on_close() -> None:
        closes.append(time.monotonic())

    response = EventStreamResponse(
        _endless(), on_close=on_close, write_timeout=TIMEOUT, request_id="req-stuck",
        cut=_never if with_cut else None,
    )
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    started = time.monotonic()
    with capture_logs() as logs, anyio.fail_after(TIMEOUT + 5):
        await response(scope, client.receive, client.send)
    took = time.monotonic() - started
    assert took < TIMEOUT + 2
    assert response.stalled
    assert len(closes) == 1
    bodies = [m for m in client.sent if m["type"] == "http.response.body"]
    assert [m["body"] for m in bodies] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    stalls = [e for e in logs if e["event"] == "http.stream_write_timeout"]
    assert len(stalls) == 1
    assert stalls[0]["request_id"] == "req-stuck"
    assert stalls[0]["log_level"] == "warning"


async def test_a_client_that_reads_is_not_cut() -> None:
    """A client that takes every write gets the whole stream; nothing is logged as stalled."""

    async def three() -> AsyncIterator[bytes]:
        for n in range(3):
            await anyio.sleep(TIMEOUT / 3)
            yield f"data: {n}\n\n".encode()

    client = StuckClient(room=10)
    closes: list[int] = []

    async def on_close() -> None:
        closes.append(1)

    response = EventStreamResponse(three(), on_close=on_close, write_timeout=TIMEOUT)
    with capture_logs() as logs, anyio.fail_after(5):
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, client.receive,
                       client.send)
    assert not response.stalled
    assert closes == [1]
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert not [e for e in logs if e["event"] == "http.stream_write_timeout"]


async def test_a_write_that_waits_within_the_deadline_completes() -> None:
    """Writes that suspend (a client slow to read, each taking TIMEOUT / 4) each finish in order
    and the stream ends whole: the deadline only cuts a write still waiting at its end."""

    class SlowClient(StuckClient):
        async def send(self, message: Message) -> None:
            if message["type"] == "http.response.body":
                await anyio.sleep(TIMEOUT / 4)
            self.sent.append(message)

    async def three() -> AsyncIterator[bytes]:
        for n in range(3):
            yield f"data: {n}\n\n".encode()

    client = SlowClient(room=0)
    closes: list[int] = []

    async def on_close() -> None:
        closes.append(1)

    response = EventStreamResponse(three(), on_close=on_close, write_timeout=TIMEOUT)
    with capture_logs() as logs, anyio.fail_after(5):
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, client.receive,
                       client.send)
    assert not response.stalled
    assert closes == [1]
    bodies = [m["body"] for m in client.sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert not [e for e in logs if e["event"] == "http.stream_write_timeout"]


async def test_a_stalled_response_cancels_its_producer_before_on_close() -> None:
    """A producer feeding the stream (several choices) is cancelled when a stalled write ends the
    response, and has ended by the time on_close runs."""
    send, receive = anyio.create_memory_object_stream[bytes](4)
    order: list[str] = []

    async def produce() -> None:
        try:
            async with send:
                n = 0
                while True:
                    await send.send(f"data: {n}\n\n".encode())
                    n += 1
        finally:
            order.append("producer ended")

    async def drain() -> AsyncIterator[bytes]:
        async with receive:
            async for item in receive:
                yield item

    async def on_close() -> None:
        order.append("on_close")

    response = EventStreamResponse(drain(), on_close=on_close, write_timeout=TIMEOUT,
                                   producer=produce)
    client = StuckClient(room=2)
    with anyio.fail_after(TIMEOUT + 5):
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, client.receive,
                       client.send)
    assert response.stalled
    assert order == ["producer ended", "on_close"]
