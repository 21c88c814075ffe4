"""End to end: SIGTERM during a stream drains it, refuses new work with 503, and exits 0."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of its own: this module shuts it down."""
    srv = ServerProcess(tmp_path_factory.mktemp("serve-shutdown"), "--shutdown-timeout", "60")
    yield srv
    srv.stop(timeout=10)


def test_sigterm_drains_stream_refuses_new_and_exits_zero(server: ServerProcess) -> None:
    """SIGTERM mid-stream: /health and new requests get 503, the stream finishes, exit code 0."""
    body = {"messages": STORY, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if '"content":"' in line and '"content":""' not in line:
                    break
        server.signal(signal.SIGTERM)
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
