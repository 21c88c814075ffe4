"""The hardened uvicorn server (``actors.http.serve``) over a scripted engine, on a real socket.

Each test runs ``serve`` in-process on 127.0.0.1:0 with short limits and
talks to it with raw sockets (to send what well-behaved clients never
send) or httpx. Signals are real: the test process sends itself SIGTERM.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import pytest

from actors.cli.serve import _bind
from actors.errors import ContextTooLong
from actors.http import HttpSettings, HttpState, ServerLimits, create_app, exposure_warning, serve
from actors.http._server import _RateLimit, connection_cap
from actors.runtime import configure_logging

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}]}
FAST = ServerLimits(header_timeout_s=0.4, body_timeout_s=0.4, keep_alive_s=5, linger_s=2,
                    cut_grace_s=0.5)


@pytest.fixture(autouse=True)
def restore_signals() -> Iterator[None]:
    """serve() leaves SIGINT/SIGTERM ignored (the process is stopping); give the test runner its handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@dataclass
class Running:
    """A server under test."""

    port: int
    engine: FakeEngine
    state: HttpState
    result: list[bool]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def running(engine: FakeEngine | None = None, *, limits: ServerLimits = FAST,
                  settings: HttpSettings | None = None,
                  shutdown_timeout: float = 5.0) -> AsyncIterator[Running]:
    """Serve in a task; on exit, stop it with SIGTERM (if a test did not) and wait for ``serve`` to return."""
    engine = engine or FakeEngine()
    state = HttpState()
    app = create_app(engine, settings or HttpSettings(), state=state)
    sock = _bind("127.0.0.1", 0)
    ready = anyio.Event()
    result: list[bool] = []

    async def drain() -> None:
        await anyio.lowlevel.checkpoint()

    stopped = anyio.Event()

    async def run() -> None:
        result.append(await serve(app, sock, drain=drain, shutdown_timeout=shutdown_timeout,
                                  limits=limits, on_ready=lambda _port: ready.set()))
        stopped.set()

    with sock:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                await ready.wait()
            yield Running(sock.getsockname()[1], engine, state, result)
            if not state.shutting_down:
                os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(15):
                await stopped.wait()


async def _read_all(stream: anyio.abc.SocketStream, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes (a reset counts as the end)."""
    data = b""
    with anyio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                return data
            data += chunk


async def _keep_sending(conn: anyio.abc.SocketStream) -> None:
    """Send until the peer's reset surfaces (a closed peer answers data with RST)."""
    for _ in range(50):
        await conn.send(b"x" * 1000)
        await anyio.sleep(0.02)


async def _until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (state set by a signal handler has no event to wait on)."""
    while not condition():  # noqa: ASYNC110 - nothing to wait on but the flag
        await anyio.sleep(0.01)


def _body(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of one raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, json.loads(body) if body else None


def _openai_error(raw: bytes, status: int, code: str) -> None:
    got, headers, body = _body(raw)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code


async def test_partial_request_head_gets_408_and_a_silent_connection_is_closed() -> None:
    """A head that never completes is answered 408 after the header timeout; a silent connection is just closed."""
    async with running() as srv:
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as slow, \
                await anyio.connect_tcp("127.0.0.1", srv.port) as silent:
            await slow.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            started = time.monotonic()
            raw = await _read_all(slow)
            assert await _read_all(silent) == b""
            assert time.monotonic() - started < 3
        _openai_error(raw, 408, "request_timeout")


async def test_body_shorter_than_content_length_times_out_with_a_response() -> None:
    """A Content-Length larger than the body sent gets a 408 answer (connection closed), never a hang."""
    async with running() as srv:
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as stream:
            await stream.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
                              b"{\"mess")
            raw = await _read_all(stream)
        _openai_error(raw, 408, "request_timeout")
        assert srv.engine.calls == []


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
         b"Content-Length: 6\r\n\r\nhello!"),
        # The start of a TLS ClientHello, as a browser sends to https://.
        bytes.fromhex("16030100c4010000c00303") + os.urandom(32),
    ],
    ids=["bad-content-length", "two-content-lengths", "tls-bytes"],
)
async def test_malformed_http_gets_an_openai_400(request_bytes: bytes) -> None:
    """What h11 refuses (bad Content-Length, TLS on the plain port) is a 400 with an OpenAI error body."""
    async with running() as srv:
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as stream:
            await stream.send(request_bytes)
            raw = await _read_all(stream)
        _openai_error(raw, 400, "invalid_http_request")


def _post_whole_body_then_read(port: int, body_size: int) -> bytes:
    """What urllib/requests do: write the whole (oversized) body, only then read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {body_size}\r\n\r\n".encode())
        conn.sendall(b"x" * body_size)
        time.sleep(0.2)  # NOTE: the answer is already waiting; a reset would destroy it.
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data


async def test_oversized_body_sent_before_reading_gets_the_413() -> None:
    """A client that writes a whole oversized body before reading receives the 413 (lingering close), not a reset."""
    async with running(settings=HttpSettings(max_body_bytes=1000)) as srv:
        raw = await anyio.to_thread.run_sync(_post_whole_body_then_read, srv.port, 8 * 1024 * 1024)
        _openai_error(raw, 413, "request_too_large")


async def test_lingering_close_ends_when_the_client_goes_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """After an early 413 the server drops the unread body, then closes after the linger time; no loop errors."""
    limits = ServerLimits(header_timeout_s=30, body_timeout_s=30, keep_alive_s=1, linger_s=1.5)
    async with running(settings=HttpSettings(max_body_bytes=1000), limits=limits) as srv, \
            await anyio.connect_tcp("127.0.0.1", srv.port) as conn:
        await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: 5000000\r\n\r\n" + b"x" * 100_000)
        raw = await _read_all(conn)
        await conn.send(b"x" * 1000)  # NOTE: still lingering: read and dropped.
        await anyio.sleep(2.0)  # NOTE: past the linger and keep-alive timers.
        with pytest.raises((anyio.BrokenResourceError, ConnectionResetError, BrokenPipeError)):
            await _keep_sending(conn)
    _openai_error(raw, 413, "request_too_large")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_connection_cap_displaces_idle_connections_first() -> None:
    """At the cap, a new client is served by displacing the oldest idle connection."""
    async with running(limits=ServerLimits(max_connections=4, header_timeout_s=30)) as srv:
        idle = [await anyio.connect_tcp("127.0.0.1", srv.port) for _ in range(4)]
        try:
            await anyio.sleep(0.1)
            async with httpx.AsyncClient(base_url=srv.url, timeout=5) as c:
                r = await c.post(CHAT, json=HELLO)
            assert r.status_code == 200
            assert await _read_all(idle[0]) == b""
        finally:
            for stream in idle:
                await stream.aclose()


async def test_connection_cap_refuses_at_once_when_every_connection_is_busy() -> None:
    """With every connection busy with a request, one more connection is closed at once."""
    gate = anyio.Event()
    admitted = [anyio.Event() for _ in range(2)]
    engine = FakeEngine(scripts=[Script(gate=gate, admitted=a) for a in admitted])
    limits = ServerLimits(max_connections=2, header_timeout_s=30)
    async with running(engine, limits=limits) as srv, anyio.create_task_group() as tg:
        clients = [httpx.AsyncClient(base_url=srv.url, timeout=10) for _ in range(2)]
        for c in clients:
            tg.start_soon(functools.partial(c.post, CHAT, json=HELLO))
        with anyio.fail_after(5):
            for a in admitted:
                await a.wait()
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as extra:
            started = time.monotonic()
            assert await _read_all(extra) == b""
            assert time.monotonic() - started < 1
        gate.set()
        await anyio.sleep(0.2)
        for c in clients:
            await c.aclose()


@pytest.mark.usefixtures("restore_structlog")
async def test_keep_alive_requests_after_a_400_log_their_own_id() -> None:
    """Requests pipelined on one connection behind a refused one log their own id, not the refused one's."""
    out = io.StringIO()
    configure_logging(format="json", level="info", stream=out)
    engine = FakeEngine(scripts=[Script(admission_error=ContextTooLong(9000, 8192))])
    body = json.dumps(HELLO).encode()
    refused = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    async with running(engine) as srv, await anyio.connect_tcp("127.0.0.1", srv.port) as conn:
        # NOTE: sent in one write: uvicorn starts the next request from inside
        # the refused one's task, which is where its log context leaked.
        await conn.send(refused + models + last)
        raw = await _read_all(conn)
    sent_ids = [line.split(":", 1)[1].strip() for line in raw.decode().split("\r\n")
                if line.lower().startswith("x-request-id:")]
    access = [json.loads(line) for line in out.getvalue().splitlines()]
    logged = [e["correlation_id"] for e in access if e["event"] == "http.request"]
    assert raw.startswith(b"HTTP/1.1 400")
    assert len(logged) == 3
    assert logged[0] not in logged[1:]
    assert logged == sent_ids


async def test_shutdown_timeout_cuts_streams_with_an_error_event_and_done() -> None:
    """At --shutdown-timeout a running stream ends with a shutting_down error event and [DONE]; serve reports the cut."""
    gate, admitted = anyio.Event(), anyio.Event()
    engine = FakeEngine(scripts=[Script(tokens=("a",) * 5, gate=gate, admitted=admitted)])
    async with running(engine, shutdown_timeout=0.6) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=10) as c, \
            c.stream("POST", CHAT, json={**HELLO, "stream": True}) as resp:
        with anyio.fail_after(5):
            await admitted.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        took = time.monotonic() - started
    assert srv.result == [False]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert 0.5 < took < 1.5
    assert engine.calls[0].closed


async def test_second_signal_stops_now_and_a_third_is_ignored() -> None:
    """A second signal cuts the stream at once (error + [DONE]); a third raises no KeyboardInterrupt."""
    gate, admitted = anyio.Event(), anyio.Event()
    engine = FakeEngine(scripts=[Script(tokens=("a",) * 5, gate=gate, admitted=admitted)])
    async with running(engine, shutdown_timeout=60) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c, \
                c.stream("POST", CHAT, json={**HELLO, "stream": True}) as resp:
            with anyio.fail_after(5):
                await admitted.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(5):
                await _until(lambda: srv.state.shutting_down)
            started = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
            took = time.monotonic() - started
        os.kill(os.getpid(), signal.SIGINT)
        await anyio.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)  # NOTE: after serve returned: ignored, no KeyboardInterrupt.
    assert srv.result == [False]
    assert lines[-2:] == [lines[-2], "data: [DONE]"]
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert took < 1.0


async def test_graceful_drain_lets_the_stream_finish() -> None:
    """Within the budget a running stream finishes normally; serve reports a full drain."""
    gate, admitted = anyio.Event(), anyio.Event()
    engine = FakeEngine(scripts=[Script(tokens=("a", "b"), gate=gate, admitted=admitted)])
    async with running(engine, shutdown_timeout=10) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=10) as c, \
            c.stream("POST", CHAT, json={**HELLO, "stream": True}) as resp:
        with anyio.fail_after(5):
            await admitted.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await anyio.sleep(0.2)
        gate.set()
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert srv.result == [True]
    assert lines[-1] == "data: [DONE]"
    assert all("error" not in line for line in lines)
    assert engine.calls[0].finished


def test_rate_limit_lets_a_burst_through_then_counts() -> None:
    """Repeated records pass ``burst`` times per window; the next window's first one reports the dropped count."""
    now = [0.0]
    limiter = _RateLimit(window=10, burst=2, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    passed = [limiter.filter(record("socket.accept() out of system resource")) for _ in range(50)]
    other = limiter.filter(record("something else"))
    now[0] = 11.0
    late = record("socket.accept() out of system resource")
    assert passed == [True, True] + [False] * 48
    assert other
    assert limiter.filter(late)
    assert "48 similar messages suppressed" in str(late.msg)


def test_out_of_descriptors_is_one_line_without_a_traceback() -> None:
    """An accept error for lack of descriptors is logged as one line (its errno), with no traceback."""
    import errno

    limiter = _RateLimit(window=10, burst=3)
    exc = OSError(errno.EMFILE, "Too many open files")
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1,
                               "socket.accept() out of system resource\nsocket: <fd=7>", None,
                               (OSError, exc, None))
    assert limiter.filter(record)
    assert record.exc_info is None
    assert record.getMessage() == ("socket.accept() out of system resource: "
                                   "[Errno 24] Too many open files")


def test_connection_cap_stays_below_the_descriptor_limit() -> None:
    """The cap leaves a reserve of descriptors free and never exceeds the requested value."""
    assert connection_cap(soft_limit=1024) == 1024 - 128
    assert connection_cap(soft_limit=256) == 256 - 64
    assert connection_cap(10_000, soft_limit=1024) == 896
    assert connection_cap(100, soft_limit=1024) == 100


@pytest.mark.parametrize(
    ("host", "key", "warns"),
    [("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
     ("0.0.0.0", None, True), ("192.168.1.5", None, True), ("myhost", None, True),
     ("0.0.0.0", "k", False)],
)
def test_exposure_warning(host: str, key: str | None, warns: bool) -> None:
    """Binding beyond loopback without an API key is warned about; loopback or a key is not."""
    assert (exposure_warning(host, key) is not None) == warns


def test_serve_warns_on_an_exposed_bind_and_names_a_missing_model_dir(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtier serve on 0.0.0.0 without a key warns loudly; a missing --model path is 'model directory not found'."""
    import actors.runtime
    from actors.cli import main

    # NOTE: keep the process-wide structlog setup untouched for the rest of the suite.
    monkeypatch.setattr(actors.runtime, "configure_logging", lambda *a, **k: None)
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    rc = main(["serve", "--model", "/nonexistent/kvtier-model", "--host", "0.0.0.0",
               "--port", "0", "--prompt-cache", "0"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "WARNING: listening on 0.0.0.0 without an API key" in err
    assert "model directory not found: /nonexistent/kvtier-model" in err
