"""Server-sent events: framing and a response that always releases its stream.

Invariant: whatever ends the response (the last event, a client that
disconnects, a cancelled task, a failed ``send``, a shutdown cut), ``on_close``
runs exactly once, shielded from cancellation, so the engine request behind
the stream is cancelled and its lane freed.

A stream cut by the server (``cut`` fires: the shutdown budget ran out, or a
second signal) ends with ``cut_event`` and ``data: [DONE]``, so a client
can tell a cut answer from a complete one and still sees a well-formed end.

Every write has a deadline (``write_timeout``, ``--stream-write-timeout``):
the server's ``send`` waits while the connection's buffers are full, that is
while the client reads nothing. A write still waiting at the deadline ends
the response there (logged once, ``http.stream_write_timeout``, with the
request id): ``on_close`` cancels the engine request, whose turn ends within
one step, and the server aborts the connection (``WRITE_STALLED`` in the
request's ASGI ``state`` tells it so: a graceful close would keep the socket
open, its unsent bytes queued, until the client reads or leaves).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import pydantic_core
import structlog
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

__all__ = ["DONE", "WRITE_STALLED", "EventStreamResponse", "TextEvents", "sse_data", "sse_json",
           "write_stalled"]

_log = structlog.get_logger("kvtier.http")

DONE = b"data: [DONE]\n\n"
"""The OpenAI end-of-stream sentinel."""

WRITE_STALLED = "kvtier.write_stalled"
"""Key set (True) in the request's ASGI ``scope["state"]`` when a write passed its deadline."""


def write_stalled(scope: Mapping[str, object]) -> bool:
    """Whether the response of ``scope`` ended because a write passed its deadline."""
    state = scope.get("state")
    return isinstance(state, dict) and state.get(WRITE_STALLED) is True


def sse_data(payload: str) -> bytes:
    """One ``data:`` event. JSON payloads never contain raw newlines, so one line suffices."""
    assert "\n" not in payload, "SSE data must be one line"
    assert "\r" not in payload, "SSE data must be one line"
    return f"data: {payload}\n\n".encode()


def sse_json(body: BaseModel | dict[str, Any]) -> bytes:
    """One event carrying a JSON body."""
    if isinstance(body, BaseModel):
        return sse_data(body.model_dump_json())
    import json

    return sse_data(json.dumps(body, ensure_ascii=False, separators=(",", ":")))


_MARK = "\x00kvtier-text\x00"
"""A text no tokenizer's output, request id or model name holds (NUL at both ends)."""


class TextEvents:
    """The SSE event of a text-only chunk, byte for byte the model's ``sse_json``, per token at string speed.

    Built from one chunk whose only text is a marker: its event is split
    around the marker's JSON, and each text is encoded by the same
    serializer (``pydantic_core.to_json``) between the two halves. NOTE: a
    token's chunk otherwise builds and dumps a pydantic model per token on
    the event loop, ~30-120 µs that the engine thread waits for when it
    needs the GIL back after its step. ``None`` from :meth:`of` when the
    template does not hold the marker exactly once (the caller then keeps
    the model path).
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self._head = head
        self._tail = tail

    @classmethod
    def of(cls, build: Callable[[str], BaseModel]) -> TextEvents | None:
        """The template of ``build(text)``'s events; ``None`` if the marker is not in it exactly once."""
        event = sse_json(build(_MARK))
        mark = pydantic_core.to_json(_MARK)
        if event.count(mark) != 1:
            return None
        head, tail = event.split(mark)
        return cls(head, tail)

    def event(self, text: str) -> bytes:
        """The event of the chunk carrying ``text``."""
        return self._head + pydantic_core.to_json(text) + self._tail


_SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # NOTE: stops reverse proxies (nginx) from buffering the whole stream.
    "X-Accel-Buffering": "no",
}


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close`` however it ends.

    ``write_timeout`` (seconds, ``None``: none): the deadline on each write;
    ``request_id`` names the response in the log line of a write past it.
    ``producer`` (optional) runs beside the writer for as long as the
    response does (it feeds ``content``, e.g. several generations into one
    channel) and is cancelled when the response ends, however it ends,
    before ``on_close``.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
        cut: Callable[[], Awaitable[None]] | None = None,
        cut_event: bytes = b"",
        write_timeout: float | None = None,
        request_id: str = "",
        on_write: Callable[[], None] | None = None,
        producer: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**_SSE_HEADERS, **(headers or {})})
        if write_timeout is not None and not write_timeout > 0:
            raise ValueError("write_timeout must be > 0")
        self._write_timeout = write_timeout
        self._request_id = request_id
        self.stalled = False
        """A write waited past ``write_timeout``: the response ended there."""
        self._on_write = on_write
        self._on_close = on_close
        self._closed = False
        self._cut = cut
        self._cut_event = cut_event
        self._producer = producer

    async def close(self) -> None:
        """Run ``on_close`` once, shielded (it must finish even inside a cancelled scope)."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                await self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as work:
                if self._producer is not None:
                    work.start_soon(self._producer)
                with anyio.CancelScope() as response:
                    if self._on_write is not None:
                        send = _noting(send, self._on_write)
                    if self._write_timeout is not None:
                        send = self._timed(send, self._write_timeout, response, scope)
                    if self._cut is None:
                        await super().__call__(scope, receive, send)
                    else:
                        await self._run_until_cut(self._cut, scope, receive, send)
                work.cancel_scope.cancel()
        finally:
            await self.close()

    def _timed(self, send: Send, timeout: float, response: anyio.CancelScope,
               scope: Scope) -> Send:
        """``send`` with a deadline; past it the whole response ends (``response`` is cancelled)."""

        async def timed_send(message: Message) -> None:
            # NOTE: most writes complete without suspending (the connection's
            # buffer has room); only a write that suspends pays for a cancel
            # scope (~10-35 µs per token on the event loop otherwise).
            pending: Awaitable[None] = send(message)
            if isinstance(pending, Coroutine):
                try:
                    first = pending.send(None)
                except StopIteration:
                    return
                pending = _Resumed(pending, first)
            with anyio.move_on_after(timeout) as deadline:
                await pending
            if not deadline.cancelled_caught:
                return
            # NOTE: the client took nothing for the whole deadline (the send
            # waits only while the connection's buffers are full): end the
            # response here; close() then releases the engine request.
            self.stalled = True
            # NOTE: the server reads this to abort the connection (a graceful
            # close would wait for the client to take the queued bytes).
            # scope["state"] is one dict shared by every copy of the scope.
            state = scope.get("state")
            if isinstance(state, dict):
                state[WRITE_STALLED] = True
            _log.warning("http.stream_write_timeout", request_id=self._request_id,
                         timeout_s=timeout)
            response.cancel()
            await anyio.lowlevel.checkpoint()

        return timed_send

    async def _run_until_cut(self, cut: Callable[[], Awaitable[None]], scope: Scope,
                             receive: Receive, send: Send) -> None:
        started = finished = was_cut = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif not message.get("more_body", False):
                finished = True
            await send(message)

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal was_cut
                await cut()
                was_cut = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await super().__call__(scope, receive, tracking_send)
            tg.cancel_scope.cancel()
        if not was_cut or finished:
            return
        # NOTE: the generator is abandoned between two events (sends are whole
        # events), so the stream stays well-formed: the error, then [DONE].
        if not started:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self._cut_event + DONE,
                    "more_body": False})


class _Resumed:
    """Awaits the rest of a coroutine already stepped once (it yielded ``first``).

    The plain delegation ``yield from`` does: each value the coroutine yields
    goes to the task running the caller, and whatever the task sends or
    throws back (a cancellation included) goes to the coroutine.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, None]:
        coro, value = self._coro, self._first
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # noqa: BLE001 - NOTE: handed to the coroutine, as yield from does
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return


def _noting(send: Send, on_write: Callable[[], None]) -> Send:
    """``send`` that calls ``on_write`` after each body message was taken by the server."""

    async def noting_send(message: Message) -> None:
        await send(message)
        if message["type"] == "http.response.body":
            on_write()

    return noting_send
