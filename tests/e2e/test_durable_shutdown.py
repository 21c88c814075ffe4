"""End to end: shutdown flushes to a durable boundary, and a flush's ``durable: true`` survives SIGKILL.

- SIGTERM with 16 streams in flight: every stream finishes, the final flush
  is durable, the process exits 0 within the shutdown timeout, and the last
  log line says the state on disk is durable.
- A shutdown timeout too short for the flush (the streams in flight use it
  up): the last log line says the state on disk is NOT durable.
- The kill loop (slow): flush → 200 ``durable: true`` → SIGKILL at once →
  restart; every flushed prefix is served from disk with the same greedy
  answer, for 20 cycles (``tools/kill_loop.py`` runs 200).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

_REPO = Path(__file__).resolve().parents[2]


def _last_log(server: ServerProcess) -> dict[str, Any]:
    lines = [line for line in server.stderr_path.read_text().splitlines() if line.strip()]
    last: dict[str, Any] = json.loads(lines[-1])
    return last


def _stream(url: str, n: int, admitted: threading.Event, out: dict[int, list[str]]) -> None:
    body = {"prompt": f"Note {n}: the tide tables for the {n}th week say that the water",
            "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            events.append(f"status {r.status_code}")
            admitted.set()
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    finally:
        admitted.set()
        out[n] = events


def test_sigterm_with_16_streams_in_flight_finishes_them_and_flushes_durably(
    tmp_path: Path,
) -> None:
    """16 streams admitted (one generating, 15 queued), then SIGTERM: each stream runs to its
    usage chunk and [DONE], the process exits 0 within the 120 s budget, and the last log line
    (serve.stopped) says durable with the index's evidence."""
    server = ServerProcess(tmp_path, "--log-format", "json", "--ssd-writebehind", "off",
                           "--max-queue", "16", "--shutdown-timeout", "120")
    try:
        out: dict[int, list[str]] = {}
        threads = []
        for n in range(16):
            admitted = threading.Event()
            t = threading.Thread(target=_stream, args=(server.url, n, admitted, out))
            t.start()
            assert admitted.wait(timeout=120)
            threads.append(t)
        stats = httpx.get(f"{server.url}/stats", timeout=30).json()
        assert stats["http"]["in_flight"] == 16
        began = time.monotonic()
        server.signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=300)
        code = server.wait(timeout=150)
        took = time.monotonic() - began
    finally:
        server.stop(timeout=10)
    assert code == 0, server.logs()
    assert took < 120 + 5
    for n in range(16):
        events = out[n]
        assert events[0] == "status 200", events
        assert events[-1] == "[DONE]", events
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] >= 1
    last = _last_log(server)
    assert last["event"] == "serve.stopped", last
    assert last["durable"] is True, last
    assert last["entries"] >= 16


def test_a_shutdown_timeout_too_short_for_the_flush_ends_with_not_durable(tmp_path: Path) -> None:
    """A 2-second budget spent by a long stream (cut at the deadline) leaves the flush no time:
    the process still exits 0, and the last log line says the state on disk is not durable."""
    server = ServerProcess(tmp_path, "--log-format", "json", "--ssd-writebehind", "off",
                           "--shutdown-timeout", "2")
    try:
        done = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "prompt": "A first request puts an entry that only a flush would write.",
            "max_tokens": 4, "temperature": 0})
        assert done.status_code == 200
        out: dict[int, list[str]] = {}
        admitted = threading.Event()
        body_thread = threading.Thread(target=_long_stream, args=(server.url, admitted, out))
        body_thread.start()
        assert admitted.wait(timeout=120)
        server.signal(signal.SIGTERM)
        body_thread.join(timeout=120)
        code = server.wait(timeout=60)
    finally:
        server.stop(timeout=10)
    assert code == 0, server.logs()
    # NOTE: the stream was cut at the deadline (an error event), so the budget was spent.
    assert any('"shutting_down"' in event for event in out[0]), out[0][-3:]
    last = _last_log(server)
    assert last["event"] == "serve.stopped", last
    assert last["durable"] is False, last
    assert "not durable" in last["disk"]


def _long_stream(url: str, admitted: threading.Event, out: dict[int, list[str]]) -> None:
    body = {"prompt": "Write the whole log of the lighthouse, day by day:", "max_tokens": 2000,
            "temperature": 0, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    admitted.set()
    finally:
        admitted.set()
        out[0] = events


def _kill_loop() -> Any:
    spec = importlib.util.spec_from_file_location("kill_loop", _REPO / "tools" / "kill_loop.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # NOTE: dataclasses look their module up in sys.modules while the class is built.
    sys.modules.setdefault("kill_loop", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(1800)  # NOTE: 20 server restarts; ~80 s per 5 cycles on a loaded 2-core box.
def test_every_flushed_prefix_survives_sigkill_for_20_cycles(tmp_path: Path) -> None:
    """20 cycles of: prompts, flush (200, durable true), SIGKILL at once, restart; after each
    restart every prompt flushed before the kill is served from the SSD tier (cached_tokens >=
    prompt - 1, RAM hits 0) with the same greedy answer."""
    summary = _kill_loop().run(20, tmp_path, prompts=2, max_tokens=8)
    assert summary.failures == []
    assert summary.cycles == 20
    assert summary.flushes_durable == 20
    assert summary.prefixes_verified == 40
