"""Server-sent events: framing and a response that always releases its stream.

Invariant: whatever ends the response (the last event, a client that
disconnects, a cancelled task, a failed ``send``), ``on_close`` runs exactly
once, shielded from cancellation, so the engine request behind the stream
is cancelled and its lane freed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["DONE", "EventStreamResponse", "sse_data", "sse_json"]

DONE = b"data: [DONE]\n\n"
"""The OpenAI end-of-stream sentinel."""


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


_SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # NOTE: stops reverse proxies (nginx) from buffering the whole stream.
    "X-Accel-Buffering": "no",
}


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close`` however it ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**_SSE_HEADERS, **(headers or {})})
        self._on_close = on_close
        self._closed = False

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
            await super().__call__(scope, receive, send)
        finally:
            await self.close()
