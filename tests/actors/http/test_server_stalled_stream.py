"""A stream ended at its write deadline aborts its connection (the hardened server, a real socket)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from actors.cli.serve import _bind
from actors.http import HttpSettings, HttpState, ServerLimits, create_app, serve

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

WRITE_TIMEOUT = 0.5
LIMITS = ServerLimits(header_timeout_s=5, body_timeout_s=5, keep_alive_s=5, linger_s=2,
                      cut_grace_s=0.5)
# NOTE: 24 MB of events: more than the loopback socket buffers hold, so the
# server's writes wait for a client that reads nothing.
BIG = Script(tokens=["x" * 16_000] * 1500)


@pytest.fixture(autouse=True)
def restore_signals() -> Iterator[None]:
    """serve() leaves SIGINT/SIGTERM ignored; give the test runner its handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@asynccontextmanager
async def _serving(engine: FakeEngine) -> AsyncIterator[tuple[int, HttpState]]:
    state = HttpState()
    app = create_app(engine, HttpSettings(), state=state, stream_write_timeout_s=WRITE_TIMEOUT)
    sock = _bind("127.0.0.1", 0)
    ready, stopped = anyio.Event(), anyio.Event()

    async def drain() -> None:
        await anyio.lowlevel.checkpoint()

    async def run() -> None:
        await serve(app, sock, drain=drain, shutdown_timeout=2, limits=LIMITS,
                    on_ready=lambda _port: ready.set())
        stopped.set()

    with sock:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                await ready.wait()
            yield sock.getsockname()[1], state
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(15):
                await stopped.wait()


def _request(port: int) -> socket.socket:
    """A client with a tiny receive buffer that asks for a long stream and then reads nothing."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                   b"content-type: application/json\r\ncontent-length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
    return client


def _read_to_end(client: socket.socket, timeout: float) -> str:
    """Read until the server's side ends: ``"reset"`` or ``"eof"`` (``"open"`` at the timeout)."""
    client.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not client.recv(1 << 16):
                return "eof"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"
    return "open"


async def _connections(state: HttpState) -> dict[str, int]:
    assert state.connection_stats is not None
    return state.connection_stats()


async def _until(state: HttpState, done: Callable[[dict[str, int]], bool]) -> None:
    """Poll the connection statistics (every 20 ms, at most 10 s) until ``done`` holds."""
    for _ in range(500):
        if done(await _connections(state)):
            return
        await anyio.sleep(0.02)
    raise AssertionError("the connection statistics never reached the expected state")


class _Records(logging.Handler):
    """Keeps every record logged to the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def uvicorn_records() -> Iterator[_Records]:
    """What uvicorn logs (its ``uvicorn.error`` logger) during the test."""
    handler = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


async def test_a_stream_past_its_write_deadline_aborts_its_connection(
        uvicorn_records: _Records) -> None:
    """A client that never reads: after the write deadline the server aborts the socket (the
    client sees a reset or EOF at once, not after reading), the open-connection count drops
    to 0 and ``stalled_aborts`` counts it; /stats shows both; uvicorn logs no error for it."""
    engine = FakeEngine(scripts=[BIG])
    async with _serving(engine) as (port, state):
        client = await anyio.to_thread.run_sync(_request, port)
        with client:
            await _until(state, lambda c: c["open"] == 1)
            await _until(state, lambda c: c["stalled_aborts"] > 0)
            await anyio.sleep(0.1)  # NOTE: connection_lost comes a loop turn after the abort.
            conns = await _connections(state)
            assert conns["open"] == 0
            assert conns["stalled_aborts"] == 1
            assert state.snapshot()["connections"] == conns
            assert engine.calls[0].closed, "the engine request was released"
            # NOTE: the socket is gone on the server's side: reading what the
            # kernel still holds ends in a reset or EOF, never waits.
            end = await anyio.to_thread.run_sync(_read_to_end, client, 5.0)
            assert end in ("reset", "eof")
    errors = [r.getMessage() for r in uvicorn_records.records if r.levelno >= logging.ERROR]
    assert errors == [], "a write-deadline cut is the client's doing, not a server error"
