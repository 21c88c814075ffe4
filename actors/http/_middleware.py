"""Pure-ASGI middleware: API-key check and the request-body size cap.

Both run before FastAPI reads anything: a wrong key is refused without
reading the body, and an oversized body is refused by its declared
``Content-Length`` or, for chunked uploads, the moment the bytes received
pass the cap (the rest is never buffered).
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import ApiError, error_body

__all__ = ["ApiKeyMiddleware", "BodyLimitMiddleware", "BodyTooLarge", "send_api_error"]

UNAUTHENTICATED_PATHS = frozenset({"/health"})


async def send_api_error(send: Send, err: ApiError) -> None:
    """Answer an ``ApiError`` straight from ASGI (for middleware that runs outside FastAPI)."""
    payload = json.dumps(error_body(err.message, err.type, err.code, err.param)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every route but ``/health``."""

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
