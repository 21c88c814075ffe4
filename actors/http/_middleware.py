"""Pure-ASGI middleware: API key, body size cap, body read deadline, trailing slashes.

They run before FastAPI reads anything: a wrong key is refused without
reading the body; an oversized body is refused by its declared
``Content-Length`` or, for chunked uploads, the moment the bytes received
pass the cap (the rest is never buffered); a body that does not arrive in
time (a ``Content-Length`` larger than what is sent, a client dripping
bytes) is answered with 408 instead of holding the request forever.
"""

from __future__ import annotations

import hmac
import json
import math

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import ApiError, error_body

__all__ = [
    "ApiKeyMiddleware",
    "BodyLimitMiddleware",
    "BodyTimeout",
    "BodyTimeoutMiddleware",
    "BodyTooLarge",
    "TrailingSlashMiddleware",
    "send_api_error",
]

UNAUTHENTICATED_PATHS = frozenset({"/health", "/"})
"""``/`` is the status page: static HTML that asks for the key before it reads ``/stats``."""


async def send_api_error(send: Send, err: ApiError) -> None:
    """Answer an ``ApiError`` straight from ASGI (for middleware that runs outside FastAPI)."""
    payload = json.dumps(error_body(err.message, err.type, err.code, err.param)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every route but ``/health`` and ``/`` (the status page)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNAUTHENTICATED_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # NOTE: compare_digest keeps the comparison time independent of the key's prefix.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if auth
                   else "You didn't provide an API key. Send 'Authorization: Bearer <key>'.")
        await send_api_error(send, ApiError(401, message, code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"}))


class BodyTooLarge(HTTPException):
    """The request body passed ``--max-body-bytes`` (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the {limit}-byte limit.")


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes`` with 413, while reading, never after."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False  # NOTE: the server rejects a malformed length itself.
            if too_big:
                exc = BodyTooLarge(self.max_bytes)
                await send_api_error(send, ApiError(413, str(exc.detail),
                                                    code="request_too_large"))
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # NOTE: raised inside FastAPI's body read; FastAPI re-raises
                    # HTTPException subclasses, and the error edge renders the 413.
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class BodyTimeout(HTTPException):
    """The request body did not arrive within the body deadline (HTTP 408; the connection closes)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"The request body did not arrive within {seconds:g} s.",
                         headers={"Connection": "close"})


class BodyTimeoutMiddleware:
    """Bounds the time from a request's head to the end of its body.

    NOTE: a total deadline, not a per-read one: a client that drips one byte
    at a time would pass any per-read timeout. Receives after the body ended
    (disconnect watchers) are not bounded.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not math.isfinite(self.timeout_s):
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message
            # NOTE: raised inside FastAPI's body read, rendered by the error edge.
            raise BodyTimeout(self.timeout_s)

        await self.app(scope, timed_receive, send)


class TrailingSlashMiddleware:
    """Routes ``/v1/chat/completions/`` like ``/v1/chat/completions`` (no 307 redirect).

    NOTE: a redirect makes most clients drop a POST body or re-send it; the
    slash carries no meaning here.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            stripped = path.rstrip("/") or "/"
            scope = {**scope, "path": stripped}
            raw = scope.get("raw_path")
            if isinstance(raw, bytes):
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
