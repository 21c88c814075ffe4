"""End to end: SIGTERM or SIGINT during a stream drains it, refuses new work with 503, and exits 0.

The server logs JSON at debug level, so the same run also proves that one
request can be followed through the logs by its correlation id (the
``X-Request-Id`` the client got), from the HTTP edge through the actors.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A server of its own (the test shuts it down), logging JSON at debug level, on the lane the test names."""
    spec = getattr(request.node, "callspec", None)
    lane = ["--max-batch", "1"] if spec is not None and spec.params.get("lane") == "serial" else []
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "60", "--log-format", "json",
                        "--log-level", "debug", "--prompt-cache", "0", *lane)
    yield srv
    srv.stop(timeout=10)


# NOTE: ``kvtier serve`` runs the batch lane by default; one signal per lane.
@pytest.mark.parametrize(("signum", "lane"), [(signal.SIGTERM, "batch"), (signal.SIGINT, "serial")],
                         ids=["SIGTERM-batch", "SIGINT-serial"])
def test_signal_drains_stream_refuses_new_and_exits_zero(server: ServerProcess,
                                                         signum: signal.Signals, lane: str) -> None:
    """A signal mid-stream: /health and new requests get 503, the stream finishes, exit code 0; the logs follow the request."""
    body = {"messages": STORY, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if '"content":"' in line and '"content":""' not in line:
                    break
        server.signal(signum)
        # NOTE: wait until the signal is handled; from then on admission is closed.
        deadline = time.monotonic() + 20
        health = httpx.get(f"{server.url}/health", timeout=10)
        while health.status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
            health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "draining"
        refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                             json={"messages": STORY, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        events.extend(line[6:] for line in lines if line.startswith("data: "))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert server.wait(timeout=60) == 0, server.logs()
    _check_logs(server, request_id, signum, lane)


def _check_logs(server: ServerProcess, request_id: str, signum: signal.Signals, lane: str) -> None:
    """Every stderr line is JSON; the request's correlation id ties its HTTP line to its actor messages."""
    logs = [json.loads(line) for line in server.stderr_path.read_text().splitlines() if line]
    events = {e["event"] for e in logs}
    assert "serve.shutdown_begun" in events
    begun = next(e for e in logs if e["event"] == "serve.shutdown_begun")
    assert begun["signal"] == signum.name
    mine = [e for e in logs if e.get("correlation_id") == request_id]
    seen = {(e["event"], e.get("actor"), e.get("kind")) for e in mine}
    # The HTTP edge, admission at the gateway, the turns (the runner's, or the
    # batch scheduler's steps), the tokens into the request's stream: all
    # under the one id.
    assert ("http.request", None, None) in seen
    assert ("mailbox.handled", "gateway", "gateway.generate") in seen
    if lane == "serial":
        assert ("mailbox.handled", "gateway.runner", "gateway.run_turn") in seen
        assert ("mailbox.handled", "gateway", "gateway.request_turn_report") in seen
        turn_kind = "gateway.run_turn"
    else:
        assert ("mailbox.handled", "batch", "batch.run_step") in seen
        turn_kind = "batch.run_step"
    tokens = [e for e in mine if e["event"] == "mailbox.sent" and e["kind"] == "gateway.token"]
    assert len(tokens) == 24
    assert all(e["actor"].startswith("stream-") for e in tokens)
    # Nothing of another request's turns wears this id (it is the only request).
    turns = [e for e in logs if e["event"] == "mailbox.handled" and e.get("kind") == turn_kind]
    assert turns
    assert all(e["correlation_id"] == request_id for e in turns)


# NOTE: SmolLM2's EOS ids (<|endoftext|>, <|im_end|>) banned, so the stream
# runs until it is cut.
ENDLESS = {"messages": STORY, "max_tokens": 6000, "temperature": 0, "stream": True,
           "logit_bias": {"0": -100, "2": -100}}


def _stream_until_cut(server: ServerProcess, after_first_token: Callable[[], None]) -> tuple[list[str], float]:
    """Open an endless stream, call ``after_first_token``, read to the end; (data payloads, seconds after the call)."""
    events: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=ENDLESS) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break
        after_first_token()
        started = time.monotonic()
        events.extend(line[6:] for line in lines if line.startswith("data: "))
        return events, time.monotonic() - started


def _assert_cut(events: list[str]) -> None:
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert all("error" not in json.loads(e) for e in events[:-2])


def _assert_clean_log(server: ServerProcess) -> None:
    err = server.stderr_path.read_text()
    for bad in ("Traceback", "CancelledError", "KeyboardInterrupt", "Exception in ASGI"):
        assert bad not in err, server.logs()


@pytest.fixture
def short_budget(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose shutdown budget is 3 s."""
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "3", "--prompt-cache", "0")
    yield srv
    srv.stop(timeout=10)


def test_shutdown_timeout_is_the_whole_budget(short_budget: ServerProcess) -> None:
    """With --shutdown-timeout 3 a stream still running is cut at 3 s with an error event and [DONE]; exit 0, no traces."""
    events, took = _stream_until_cut(short_budget, lambda: short_budget.signal(signal.SIGTERM))
    _assert_cut(events)
    assert 2.5 < took < 4.5
    assert short_budget.wait(timeout=30) == 0, short_budget.logs()
    _assert_clean_log(short_budget)


def test_second_signal_stops_now_and_third_is_quiet(server: ServerProcess) -> None:
    """A second SIGTERM cuts the stream at once and the server exits 0; a third signal leaves no trace."""

    def two_signals() -> None:
        server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.signal(signal.SIGTERM)

    events, took = _stream_until_cut(server, two_signals)
    _assert_cut(events)
    assert took < 3
    server.signal(signal.SIGINT)
    assert server.wait(timeout=30) == 0, server.logs()
    _assert_clean_log(server)
