"""End to end: a client that never reads its streamed serial-lane answer does not stall
the server (``--stream-write-timeout 2``).

The stalled client is a raw socket with a small receive buffer and a small segment size
(so the server's socket buffers stay small and fill within seconds) that sends a streamed
text completion with ``echo`` and ``logprobs`` 5 (the prompt is scored: served on the
serial lane; each token carries its alternatives) and then reads nothing. Meanwhile another
client's serial-lane request (queued behind it on the lane until it parks) and a batch-lane
request must finish within a margin of the moment the server gives up on the stalled stream (its
``stream_write_timeout`` warning); the stalled response ends unfinished (no ``[DONE]``) and
its connection closes once the client reads it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_process import ServerProcess

# NOTE: slow: a server start and a stall of a few seconds (35-50 s on 2 busy cores).
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

TIMEOUT = 2.0
"""``--stream-write-timeout`` of the server (seconds)."""
MARGIN = 15.0
"""What a short request may take beyond the timeout on a loaded 2-core machine."""
STALL_WAIT = 60.0
"""How long the stalled client may take to fill the server's buffers."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server with a 2 s stream-write deadline, the batch lane on (serve's default)."""
    srv = ServerProcess(tmp_path, "--stream-write-timeout", str(TIMEOUT), "--prompt-cache", "0")
    yield srv
    srv.stop(timeout=10)


def _stalled_client(url: str) -> socket.socket:
    """Send a streamed, scored completion on a socket with a small receive buffer; read nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # NOTE: set before connecting, so the window the server sees stays small.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # NOTE: loopback's 64 KiB segments let the server's send buffer grow to megabytes
    # (minutes of tokens); small segments keep it at tens of KiB.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    body = json.dumps({
        "prompt": "Write a very long story about a dragon.", "max_tokens": 4000,
        "temperature": 0, "stream": True, "echo": True, "logprobs": 5, "ignore_eos": True,
    }).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def _stall_times(server: ServerProcess) -> list[float]:
    """Wall-clock times of the server's stream-write-timeout warnings."""
    out = []
    for line in server.stderr_path.read_text(errors="replace").splitlines():
        if "stream_write_timeout" in line and "warning" in line:
            stamp = line.split()[0].removesuffix("Z")
            out.append(datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp())
    return out


def _timed_post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, float]:
    """POST a request: its status and the wall-clock time it was answered."""
    resp = httpx.post(f"{url}{path}", json=body, timeout=STALL_WAIT + MARGIN)
    return resp.status_code, time.time()


def _read_to_eof(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sent, and whether the connection closed within ``limit_s``."""
    sock.settimeout(1.0)
    data = bytearray()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            return bytes(data), True
        data.extend(chunk)
    return bytes(data), False


def test_a_client_that_never_reads_does_not_delay_the_others_past_the_timeout(
    server: ServerProcess,
) -> None:
    """While a raw-socket client reads none of its streamed scored completion, a serial-lane
    (another scored completion, queued behind it) and a batch-lane request from other clients answer 200
    within a margin of the server giving up on the stalled stream; the stalled response was
    cut (no [DONE]) and its connection closes."""
    stalled = _stalled_client(server.url)
    try:
        question = [{"role": "user", "content": "Say hello."}]
        # NOTE: a completion scoring its prompt: the serial lane (grammar requests are batch rows).
        serial = {"prompt": "Say hello.", "max_tokens": 8, "temperature": 0, "echo": True,
                  "logprobs": 1}
        batch = {"messages": question, "max_tokens": 8, "temperature": 0}
        time.sleep(1.0)  # NOTE: the stalled request is admitted first and holds the lane.
        with ThreadPoolExecutor(2) as pool:
            serial_answer = pool.submit(_timed_post, server.url, serial, "/v1/completions")
            batch_answer = pool.submit(_timed_post, server.url, batch)
            (serial_status, serial_at), (batch_status, batch_at) = (
                serial_answer.result(), batch_answer.result())
        received, closed = _read_to_eof(stalled, limit_s=30.0)
    finally:
        stalled.close()
    assert (serial_status, batch_status) == (200, 200)
    stalls = _stall_times(server)
    assert stalls, server.logs()
    # NOTE: neither waits for the server to give up on the stalled stream (the stalled
    # request parks off the serial lane); on a loaded machine either may still end after it.
    assert serial_at - stalls[0] < MARGIN, (serial_at, stalls)
    assert batch_at - stalls[0] < MARGIN, (batch_at, stalls)
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received
    assert closed
