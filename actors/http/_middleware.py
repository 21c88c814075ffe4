"""Pure-ASGI middleware: Host allowlist, API key, admin guard, JSON content type,
body size cap, body read deadline, trailing slashes.

They run before FastAPI reads anything: a foreign ``Host``, a wrong key or a
POST that is not ``application/json`` is refused without reading the body; an oversized body is refused by its declared
``Content-Length`` or, for chunked uploads, the moment the bytes received
pass the cap (the rest is never buffered); a body that does not arrive in
time (a ``Content-Length`` larger than what is sent, a client dripping
bytes) is answered with 408 instead of holding the request forever.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Sequence

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._access import Network, client_address, host_allowed, is_loopback
from ._errors import ApiError, error_body

__all__ = [
    "ADMIN_PREFIX",
    "AdminGuardMiddleware",
    "ApiKeyMiddleware",
    "BodyLimitMiddleware",
    "BodyTimeout",
    "BodyTimeoutMiddleware",
    "BodyTooLarge",
    "HostAllowlistMiddleware",
    "JsonContentTypeMiddleware",
    "TrailingSlashMiddleware",
    "send_api_error",
]

UNAUTHENTICATED_PATHS = frozenset({"/health", "/"})
"""``/`` is the status page: static HTML that asks for the key before it reads ``/stats``."""

ADMIN_PREFIX = "/admin"
"""Routes under it are guarded by :class:`AdminGuardMiddleware`, not by the API key alone."""


def _is_admin(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def _bearer_matches(scope: Scope, key: bytes) -> tuple[bool, bool]:
    """(the request sent ``Bearer <key>``, it sent an ``Authorization`` header at all)."""
    auth = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    # NOTE: compare_digest keeps the comparison time independent of the key's prefix.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key), bool(auth)


def _unauthorized(sent: bool) -> ApiError:
    message = ("Incorrect API key provided." if sent
               else "You didn't provide an API key. Send 'Authorization: Bearer <key>'.")
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def send_api_error(send: Send, err: ApiError) -> None:
    """Answer an ``ApiError`` straight from ASGI (for middleware that runs outside FastAPI)."""
    payload = json.dumps(error_body(err.message, err.type, err.code, err.param)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every route but ``/health`` and ``/`` (the status page).

    Admin routes are left to :class:`AdminGuardMiddleware` (which takes the
    same key unless an admin key is set).
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in UNAUTHENTICATED_PATHS or _is_admin(path):
            await self.app(scope, receive, send)
            return
        matches, sent = _bearer_matches(scope, self._key)
        if matches:
            await self.app(scope, receive, send)
            return
        await send_api_error(send, _unauthorized(sent))


class AdminGuardMiddleware:
    """Guards ``/admin/...``: the admin key (else the API key), or a loopback client when opted in.

    - ``loopback``: a client whose address (:func:`client_address`, which
      believes ``X-Forwarded-For`` only from ``trusted_proxies``) is a
      loopback address passes without a key.
    - otherwise ``Bearer <key>`` is needed: 401 when it is missing or wrong.
    - no key at all and no loopback pass: 403 ``admin_forbidden``.

    NOTE: a reverse proxy on this host makes every remote request arrive
    from loopback; with ``loopback`` on, name it in ``trusted_proxies`` so the
    address it forwards decides (a proxy that forwards none gets no pass).
    """

    def __init__(self, app: ASGIApp, *, key: str | None, loopback: bool,
                 trusted_proxies: Sequence[Network] = ()) -> None:
        self.app = app
        self._key = key.encode() if key else None
        self._loopback = loopback
        self._trusted = tuple(trusted_proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_admin(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if self._loopback:
            peer = scope.get("client")
            forwarded = [v for k, v in scope["headers"] if k == b"x-forwarded-for"]
            client = client_address(peer[0] if peer else None, forwarded, self._trusted)
            if is_loopback(client):
                await self.app(scope, receive, send)
                return
        if self._key is None:
            message = ("Admin routes answer only loopback clients on this server "
                       "(--admin-loopback on, no key); set --admin-key to use them remotely."
                       if self._loopback else
                       "Admin routes are off: no key is configured. Set --admin-key (or "
                       "--api-key) and send 'Authorization: Bearer <key>', or pass "
                       "--admin-loopback on to let loopback clients in.")
            await send_api_error(send, ApiError(403, message, code="admin_forbidden"))
            return
        matches, sent = _bearer_matches(scope, self._key)
        if matches:
            await self.app(scope, receive, send)
            return
        await send_api_error(send, _unauthorized(sent))


class HostAllowlistMiddleware:
    """Answers 400 ``invalid_host`` when the ``Host`` header is not one of ``allowed``.

    NOTE: the defence against DNS rebinding: a page whose name was made to
    resolve to 127.0.0.1 sends its own name as ``Host``; a browser cannot
    forge the header, so a loopback server that only answers its own names
    reads nothing for that page.
    """

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self._allowed = tuple(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if len(hosts) == 1 and host_allowed(hosts[0], self._allowed):
            await self.app(scope, receive, send)
            return
        await send_api_error(send, ApiError(
            400, "This server does not answer for the host named in the request's Host header "
                 "(allowed: " + ", ".join(self._allowed) + "; see --allowed-hosts).",
            code="invalid_host"))


_JSON = b"application/json"


def _is_json(content_type: bytes) -> bool:
    """``application/json``, with no parameter but an optional UTF-8 charset."""
    media, *params = content_type.split(b";")
    if media.strip().lower() != _JSON:
        return False
    for param in params:
        name, _, value = param.partition(b"=")
        name = name.strip().lower()
        if not name:
            continue
        if name != b"charset" or value.strip().strip(b'"').lower() not in (b"utf-8", b"utf8"):
            return False
    return True


class JsonContentTypeMiddleware:
    """Answers 415 ``unsupported_media_type`` to a POST whose ``Content-Type`` is not JSON.

    NOTE: the CSRF defence: a web page can POST ``text/plain`` (or form, or
    no body) to any address without a CORS preflight, but ``application/json``
    needs one, which this server never grants. So every POST, a bodiless
    admin one included, must say ``Content-Type: application/json``.
    ``posts``: the paths whose routes take a POST (``None``: every path); a
    POST elsewhere goes on to the router, which answers 405 (or 404) and
    runs nothing.
    """

    def __init__(self, app: ASGIApp, posts: frozenset[str] | None = None) -> None:
        self.app = app
        self._posts = posts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or (
                self._posts is not None and scope.get("path") not in self._posts):
            await self.app(scope, receive, send)
            return
        types = [v for k, v in scope["headers"] if k == b"content-type"]
        if len(types) == 1 and _is_json(types[0]):
            await self.app(scope, receive, send)
            return
        shown = types[0].decode("latin-1")[:100] if types else "none"
        await send_api_error(send, ApiError(
            415, f"Request bodies must be JSON: send 'Content-Type: application/json' "
                 f"(got {shown!r}).", code="unsupported_media_type"))


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
