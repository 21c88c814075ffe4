"""The HTTP server of ``kvtier serve``: uvicorn, hardened, with kvtier's shutdown.

``serve(app, sock, ...)`` runs the app on an already bound socket until a
signal stops it. What it adds to a plain uvicorn:

Connections (one bad client cannot take the server down):

- at most ``max_connections`` open connections, below the process's
  descriptor limit. At the cap, a new connection displaces the connection
  that has waited longest without sending a complete request head; when
  every connection is busy with a request, the new one is closed at once.
- a request head (request line and headers) must arrive within
  ``header_timeout_s`` of the connection opening or of the previous
  response; partial heads get a 408, silent connections are closed.
- a request body must arrive within ``body_timeout_s`` of its head (408,
  also when ``Content-Length`` promises more than is sent).
- idle keep-alive connections close after ``keep_alive_s``.
- a streamed response ended at its write deadline (the client read nothing
  for ``--stream-write-timeout``; ``_sse``) aborts its connection: a
  graceful close would keep the socket, and its place under the cap, until
  the client reads the queued bytes or leaves.
- a response sent before its request's body was read (413, 408) closes the
  connection the way nginx's lingering close does: our side is shut for
  writing and what the client still sends is read and dropped for at most
  ``linger_s``, so a client that writes the whole body before reading
  (``urllib``, ``requests``) gets the answer, not a connection reset.
- uvicorn's own 400 (malformed request line, bad ``Content-Length``, TLS
  bytes on the plain port) has an OpenAI error body.
- repeated warnings from uvicorn and asyncio (invalid requests, accept
  errors such as "Too many open files") are logged at most a few times per
  window, then counted.

Shutdown (the contract in docs/operations.md):

- first SIGTERM/SIGINT: admission stops (503), the listener stays open; the
  responses in flight may finish within ``shutdown_timeout`` seconds.
- at that deadline, or at a second signal: the responses still running are
  cut (a stream ends with an error event and ``[DONE]``); after at most
  ``cut_grace_s`` the connections still open are closed, and ``serve``
  returns. The timeout is the whole budget: nothing waits on top of it but
  that short grace.
- later signals are ignored (the process is already stopping, within
  bounded time), so no ``KeyboardInterrupt`` trace can appear.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import json
import logging
import resource
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import anyio
import anyio.abc
import h11
import structlog
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from ._app import begin_shutdown, cut_streams
from ._errors import error_body
from ._middleware import BodyTimeoutMiddleware
from ._sse import write_stalled
from ._state import HttpState

__all__ = ["ServerLimits", "connection_cap", "exposure_warning", "serve"]

_log = structlog.get_logger("kvtier.serve")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Connection limits and timeouts of the HTTP server (seconds; see the module docstring).

    ``max_connections``: ``None`` derives the cap from the descriptor limit
    (:func:`connection_cap`); a given value is still held below it.
    """

    max_connections: int | None = None
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    linger_s: float = 5.0
    cut_grace_s: float = 1.0
    log_window_s: float = 10.0
    log_burst: int = 3

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "linger_s",
                     "cut_grace_s", "log_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.log_burst < 1:
            raise ValueError("log_burst must be >= 1")


_FD_RESERVE_MIN = 64
"""Descriptors kept free for everything but client connections (model files, SSD tier, logs)."""


def connection_cap(requested: int | None = None, *, soft_limit: int | None = None) -> int:
    """The most client connections to hold open: below the descriptor limit, never above ``requested``.

    NOTE: a reserve (an eighth of the limit, at least 64) stays free, so the
    accept loop, the model and the cache tiers never run out of descriptors
    because of clients.
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit <= 0:
        soft_limit = 1 << 20
    cap = max(1, soft_limit - max(_FD_RESERVE_MIN, soft_limit // 8))
    return cap if requested is None else max(1, min(requested, cap))


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn about when ``host`` reaches beyond this machine without an API key (else None)."""
    if api_key:
        return None
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass  # NOTE: a host name: it may resolve to any interface.
    return (f"listening on {host} without an API key: anyone who can reach this address can "
            "use the model. Set --api-key (or KVTIER_API_KEY), or bind 127.0.0.1.")


# ------------------------------------------------------------------ logging


class _RateLimit(logging.Filter):
    """Lets ``burst`` records of one message through per ``window`` seconds, then counts.

    The first record after a window with suppressed ones says how many were
    dropped. Keyed by logger and message template, so a flood of one kind
    (accept errors, invalid requests) cannot hide other warnings.
    """

    def __init__(self, window: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._window = window
        self._burst = burst
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # NOTE: the first line only: asyncio appends per-event details (the socket) below it.
        key = (record.name, str(record.msg).split("\n", 1)[0])
        now = self._clock()
        start, passed, dropped = self._seen.get(key, (now, 0, 0))
        if now - start >= self._window:
            if dropped:
                record.msg = f"{record.msg} ({dropped} similar messages suppressed)"
            start, passed, dropped = now, 0, 0
        if passed < self._burst:
            self._seen[key] = (start, passed + 1, dropped)
            _shorten_resource_errors(record)
            return True
        self._seen[key] = (start, passed, dropped + 1)
        return False


_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _shorten_resource_errors(record: logging.LogRecord) -> None:
    """Log "Too many open files" (and kin) as one line, without a traceback.

    NOTE: the traceback says nothing the errno does not, and rendering it
    needs descriptors (lazy imports) the process has just run out of.
    """
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES:
        record.msg = f"{str(record.msg).splitlines()[0]}: {exc}"
        record.args = None
        record.exc_info = None
        record.exc_text = None


_NOISY_LOGGERS = ("uvicorn.error", "asyncio")


@contextmanager
def _rate_limited_logs(limits: ServerLimits) -> Generator[None, None, None]:
    limiter = _RateLimit(limits.log_window_s, limits.log_burst)
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for lg in loggers:
        lg.addFilter(limiter)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(limiter)


# -------------------------------------------------------------- connections


def _error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI body (written raw, then the connection closes)."""
    body = json.dumps(error_body(message, "invalid_request_error", code, None)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class _Guard:
    """Server-wide connection bookkeeping shared by every protocol instance (event loop only).

    ``waiting`` holds the connections that have no request in progress
    (opened, or between two requests), oldest first: the ones a new
    connection may displace at the cap.
    """

    def __init__(self, cap: int, limits: ServerLimits) -> None:
        self.cap = cap
        self.limits = limits
        self.waiting: collections.OrderedDict[_HardenedH11, None] = collections.OrderedDict()
        self.displaced = 0
        self.refused = 0
        self.head_timeouts = 0
        self.stalled_aborts = 0
        self._reported_at = -float("inf")

    def snapshot(self, open_connections: int) -> dict[str, int]:
        """The connection figures for ``/stats`` (``http.connections``)."""
        return {"open": open_connections, "cap": self.cap, "displaced": self.displaced,
                "refused": self.refused, "head_timeouts": self.head_timeouts,
                "stalled_aborts": self.stalled_aborts}

    def report(self) -> None:
        """Log the shed connections, at most once per log window."""
        now = time.monotonic()
        if now - self._reported_at < self.limits.log_window_s:
            return
        self._reported_at = now
        _log.warning("http.connections_shed", cap=self.cap, displaced=self.displaced,
                     refused=self.refused, head_timeouts=self.head_timeouts,
                     stalled_aborts=self.stalled_aborts)


class _Transport:
    """The connection's transport, whose ``close`` lingers while the request body still arrives.

    NOTE: uvicorn closes the transport right after a response sent with
    ``Connection: close`` (and after an early 413/408 the request body is
    still on its way). Closing a socket with unread bytes makes the kernel
    answer with a reset, which destroys the response in the client's
    receive buffer before it reads it. Lingering: shut our side for
    writing (the client sees the whole response and EOF), drop what it still
    sends, close for real when it stops or after ``linger_s``.
    """

    def __init__(self, inner: asyncio.Transport, owner: _HardenedH11) -> None:
        self._inner = inner
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        owner = self._owner
        if owner.write_stalled():
            owner.abort_stalled()
            return
        if (owner.lingering or self._inner.is_closing()
                or owner.conn.their_state is not h11.SEND_BODY):
            if not owner.lingering:
                self._inner.close()
            return
        owner.start_lingering()

    def really_close(self) -> None:
        self._inner.close()


class _HardenedH11(H11Protocol):
    """uvicorn's h11 protocol with the connection limits of :class:`ServerLimits`."""

    guard: _Guard  # set on the per-server subclass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self.lingering = False
        self._lingered_bytes = 0
        self._raw: asyncio.Transport | None = None
        self.app = self._aborting_stalled(self.app)

    def _aborting_stalled(self, inner: Any) -> Any:
        """``inner`` (the ASGI app) with the connection of a stream ended at its write deadline
        aborted as the app returns.

        NOTE: uvicorn logs an error ("ASGI callable returned without completing
        response") for every response the app leaves unfinished unless the
        client is gone. At the write deadline the client is as good as gone (it
        reads nothing): the connection is aborted here, before uvicorn looks, and
        the cut is logged once as the warning ``http.stream_write_timeout``.
        """

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await inner(scope, receive, send)
            cycle = self.cycle
            if cycle is not None and cycle.scope is scope and write_stalled(scope) \
                    and not cycle.response_complete:
                cycle.disconnected = True
                self.abort_stalled()

        return app

    # -- lifecycle ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = cast("asyncio.Transport", transport)
        self._raw = raw
        super().connection_made(cast("asyncio.Transport", _Transport(raw, self)))
        guard = self.guard
        if len(self.connections) > guard.cap:
            victim = next(iter(guard.waiting), None)
            if victim is None:
                # NOTE: every open connection is busy with a request: refuse this one.
                guard.refused += 1
                guard.report()
                self._drop()
                return
            guard.displaced += 1
            guard.report()
            victim._drop()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave_waiting()
        self._cancel_timers()
        super().connection_lost(exc)

    def abort_if_busy(self) -> None:
        """Close now if a request is still in progress or lingering (shutdown's last step)."""
        busy = self.cycle is not None and not self.cycle.response_complete
        if (busy or self.lingering) and self._raw is not None and not self._raw.is_closing():
            self._raw.abort()

    def write_stalled(self) -> bool:
        """The request in progress ended because a write passed its deadline (``_sse``)."""
        return self.cycle is not None and write_stalled(self.cycle.scope)

    def abort_stalled(self) -> None:
        """Abort the connection of a response ended at its write deadline.

        NOTE: a graceful close keeps the socket open until the queued bytes
        are sent, which a client that reads nothing never lets happen; the
        connection would hold its place under the cap meanwhile.
        """
        assert self._raw is not None
        if self._raw.is_closing() and self not in self.connections:
            return
        self.guard.stalled_aborts += 1
        self._leave_waiting()
        self._cancel_timers()
        self.connections.discard(self)
        self._raw.abort()

    def _drop(self) -> None:
        """Close at once, with no response (the peer sent no complete request)."""
        self._leave_waiting()
        self._cancel_timers()
        # NOTE: counted out now; connection_lost comes a loop turn later.
        self.connections.discard(self)
        assert self._raw is not None
        self._raw.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger_timer = None

    def _leave_waiting(self) -> None:
        self.guard.waiting.pop(self, None)

    # -- request heads ------------------------------------------------------

    def _await_head(self) -> None:
        """Start the wait for the next request head (after connecting or a response)."""
        self.guard.waiting[self] = None
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.guard.limits.header_timeout_s,
                                                self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self not in self.guard.waiting:
            return
        self.guard.head_timeouts += 1
        self.guard.report()
        self._leave_waiting()
        assert self._raw is not None
        if self.conn.trailing_data[0]:
            limit = self.guard.limits.header_timeout_s
            self._raw.write(_error_bytes(408, "Request Timeout",
                                         f"The request head did not arrive within {limit:g} s.",
                                         "request_timeout"))
        self._raw.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:
            # NOTE: a complete head arrived: the body deadline takes over (ASGI layer).
            self._leave_waiting()
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.lingering:
            # NOTE: the linger timer closes this connection; uvicorn's
            # keep-alive timer would try to close it a second time.
            self._unset_keepalive_if_required()
            return
        if not self.transport.is_closing() and (
                self.cycle is None or self.cycle.response_complete):
            self._await_head()

    # -- early answers ------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._lingered_bytes += len(data)
            return
        super().data_received(data)

    def eof_received(self) -> None:
        if self.lingering:
            self._stop_lingering()

    def start_lingering(self) -> None:
        """Shut our side, keep reading and dropping the rest of the request body for a while."""
        assert self._raw is not None
        self.lingering = True
        self._leave_waiting()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._raw.can_write_eof():
            self._raw.write_eof()
        self._raw.resume_reading()
        self._linger_timer = self.loop.call_later(self.guard.limits.linger_s, self._stop_lingering)

    def _stop_lingering(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        assert self._raw is not None
        self._raw.close()

    def shutdown(self) -> None:
        if self.lingering:
            self._stop_lingering()
            return
        super().shutdown()

    # -- uvicorn's own errors -----------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request, with an OpenAI error body."""
        del msg  # NOTE: uvicorn's text is generic; ours names what to check.
        assert self._raw is not None
        self._leave_waiting()
        self._cancel_timers()
        self._raw.write(_error_bytes(
            400, "Bad Request",
            "Invalid HTTP request: malformed request line, header or Content-Length "
            "(or TLS sent to a plain-HTTP port).", "invalid_http_request"))
        self._raw.close()


def _protocol_class(guard: _Guard) -> type[_HardenedH11]:
    """A protocol class bound to one server's guard (uvicorn instantiates it per connection)."""
    return cast("type[_HardenedH11]", type("KvtierH11Protocol", (_HardenedH11,), {"guard": guard}))


# ------------------------------------------------------------------ server


class _Uvicorn(uvicorn.Server):
    """uvicorn's Server minus its signal handlers (``serve`` handles signals and drains first)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # NOTE: uvicorn would close the listener on the first signal; kvtier
        # keeps it open to answer 503 while responses finish.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()

    def open_connections(self) -> list[_HardenedH11]:
        """The protocol instances of the open connections."""
        return [c for c in self.server_state.connections if isinstance(c, _HardenedH11)]


def _ignore_late_signals() -> None:
    # NOTE: the process is already stopping, in bounded time; a signal now must
    # not raise KeyboardInterrupt in whatever runs (engine close, exit).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


async def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    drain: Callable[[], Awaitable[None]],
    shutdown_timeout: float,
    limits: ServerLimits | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> bool:
    """Serve ``app`` on the bound ``sock`` until a signal stops it; True when it drained fully.

    ``drain`` waits until the engine has no request left (``Engine.drain``);
    ``on_ready(port)`` runs once the server accepts connections. Returns
    False when responses were cut (the budget ran out or a second signal
    came). Call from the main thread (signals). On return, SIGINT and
    SIGTERM are ignored for the rest of the process's life.
    """
    limits = limits or ServerLimits()
    state: HttpState = app.state.http
    guard = _Guard(connection_cap(limits.max_connections), limits)
    asgi: ASGIApp = BodyTimeoutMiddleware(app, limits.body_timeout_s)
    config = uvicorn.Config(
        asgi, http=_protocol_class(guard), log_config=None, access_log=False,
        lifespan="off", server_header=False,
        # NOTE: uvicorn would believe X-Forwarded-For from 127.0.0.1 (and
        # $FORWARDED_ALLOW_IPS) and rewrite the client address; kvtier reads
        # the header itself, only from --trusted-proxies (AdminGuardMiddleware).
        proxy_headers=False,
        # NOTE: uvicorn's timeout is an int; ours wins because the head timer
        # starts with it and closes the same idle connections.
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
        # NOTE: a backstop only: serve() closes every connection before it
        # lets uvicorn stop, so uvicorn never has to cancel a request task.
        timeout_graceful_shutdown=max(1, round(limits.cut_grace_s)) + 1,
        # NOTE: each request task starts with an empty context: uvicorn may
        # create it from inside the previous request's task (keep-alive,
        # pipelining), which would copy that request's log bindings.
        reset_contextvars=True,
    )
    server = _Uvicorn(config)
    state.connection_stats = lambda: guard.snapshot(len(server.server_state.connections))
    stop_now = anyio.Event()
    drained = True

    async def stop_after_drain() -> None:
        nonlocal drained
        with anyio.move_on_after(shutdown_timeout):
            async with anyio.create_task_group() as race:

                async def forced() -> None:
                    await stop_now.wait()
                    race.cancel_scope.cancel()

                race.start_soon(forced)
                await state.wait_idle()
                await drain()
                race.cancel_scope.cancel()
        drained = state.in_flight == 0 and not stop_now.is_set()
        if drained:
            _log.info("serve.drained", timed_out=False)
        else:
            _log.warning("serve.drained", timed_out=not stop_now.is_set(), cut=state.in_flight)
            cut_streams(app)
        # NOTE: cut responses end at once; other requests still running (a
        # body upload, /stats) get a short grace. Then whatever still holds a
        # connection is closed: its task sees a disconnect and ends by
        # itself, so uvicorn never has to cancel one (no CancelledError traces).
        tasks = list(server.server_state.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=limits.cut_grace_s)
        for conn in server.open_connections():
            conn.abort_if_busy()
        server.should_exit = True

    async def on_signals(tg: anyio.abc.TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not state.shutting_down:
                    _log.info("serve.shutdown_begun", signal=name, in_flight=state.in_flight,
                              timeout_s=shutdown_timeout)
                    begin_shutdown(app)
                    tg.start_soon(stop_after_drain)
                elif not stop_now.is_set():
                    _log.warning("serve.forced_exit", signal=name, in_flight=state.in_flight)
                    stop_now.set()
                else:
                    _log.info("serve.signal_ignored", signal=name)

    async def announce() -> None:
        await server.ready.wait()
        if on_ready is not None:
            on_ready(sock.getsockname()[1])

    with _rate_limited_logs(limits):
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_signals, tg)
                tg.start_soon(announce)
                await server.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        finally:
            _ignore_late_signals()
    return drained
