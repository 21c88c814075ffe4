"""Per-message structlog events, the cheap filter, and correlation ids in user log lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from actors.runtime import (
    Actor,
    ActorSystem,
    Context,
    configure_logging,
    get_logger,
    set_tracing,
    use_correlation,
)
from messages import Envelope

from ._actors import Echo, Forward
from .demo_messages import Add, Ping, Pong

pytestmark = pytest.mark.anyio


@pytest.fixture
def tracing() -> Iterator[None]:
    """Per-message events on for one test."""
    previous = set_tracing(True)
    try:
        yield
    finally:
        set_tracing(previous)


@pytest.mark.usefixtures("tracing")
async def test_every_send_and_receive_emits_events_with_ids() -> None:
    """Each send and receive emits ``mailbox.sent``/``received``/``handled`` carrying the three ids."""
    with capture_logs() as logs:
        async with ActorSystem() as system:
            echo = system.spawn("echo", Echo)
            await echo.ask(Ping(n=1), timeout=5.0, expect=Pong)
    ping = [e for e in logs if e.get("kind") == "demo.ping"]
    pong = [e for e in logs if e.get("kind") == "demo.pong"]
    assert [e["event"] for e in ping] == ["mailbox.sent", "mailbox.received", "mailbox.handled"]
    assert [e["event"] for e in pong] == ["mailbox.sent"]  # the asker's slot is not an actor
    assert {e["msg_id"] for e in ping} == {ping[0]["msg_id"]}
    assert pong[0]["causation_id"] == ping[0]["msg_id"]
    assert pong[0]["correlation_id"] == ping[0]["correlation_id"]
    for event in ping:
        assert event["actor"] == "echo"
        assert event["log_level"] == "debug"
        assert "depth" in event
    assert ping[1]["time_in_mailbox"] >= 0


async def test_filtered_tracing_emits_nothing_per_message() -> None:
    """With tracing off no per-message event is built or emitted."""
    set_tracing(False)
    with capture_logs() as logs:
        async with ActorSystem() as system:
            echo = system.spawn("echo", Echo)
            await echo.ask(Ping(n=1), timeout=5.0)
    assert [e for e in logs if str(e["event"]).startswith("mailbox.")] == []


class _Chatty(Actor):
    """Logs a line of its own while handling a message."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        get_logger("user").info("user.line", note="inside handler")


@pytest.mark.usefixtures("restore_structlog")
async def test_user_log_lines_inside_handlers_carry_the_correlation_id() -> None:
    """JSON logs: a handler's own log line carries the correlation id and actor of its message."""
    out = io.StringIO()
    configure_logging(format="json", level="debug", stream=out)
    async with ActorSystem() as system:
        chatty = system.spawn("chatty", _Chatty)
        forward = system.spawn("forward", lambda: Forward("chatty"))
        with use_correlation("req-7"):
            await forward.tell(Add(amount=1))
            get_logger("http").info("http.request")
        del chatty
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    user = [e for e in events if e["event"] == "user.line"]
    assert user == [
        {
            "event": "user.line",
            "note": "inside handler",
            "actor": "chatty",
            "correlation_id": "req-7",
            "level": "info",
            "timestamp": user[0]["timestamp"],
        }
    ]
    followed = [e["event"] for e in events if e.get("correlation_id") == "req-7"]
    assert followed.count("mailbox.handled") == 2
    assert "http.request" in followed


@pytest.mark.usefixtures("restore_structlog")
def test_stdlib_logging_records_join_the_json_stream() -> None:
    """With JSON logs a stdlib ``logging`` record (uvicorn's) is one JSON line too; stdlib debug stays filtered."""
    out = io.StringIO()
    configure_logging(format="json", level="debug", stream=out)
    configure_logging(format="json", level="debug", stream=out)
    with use_correlation("req-9"):
        logging.getLogger("uvicorn.error").warning("Invalid HTTP request %s", "received.")
    logging.getLogger("noisy.lib").debug("not shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "Invalid HTTP request received."
    assert (event["level"], event["logger"], event["correlation_id"]) == ("warning", "uvicorn.error", "req-9")


@pytest.mark.usefixtures("restore_structlog")
def test_console_is_the_default_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a format output is readable console text (``KVTIER_LOG_FORMAT`` is
    ``EngineConfig``'s to read, not the runtime's), with ``json`` JSON."""
    monkeypatch.setenv("KVTIER_LOG_FORMAT", "json")
    out = io.StringIO()
    configure_logging(level="info", stream=out)
    get_logger().info("hello", who="world")
    assert "hello" in out.getvalue()
    assert not out.getvalue().lstrip().startswith("{")
    out = io.StringIO()
    configure_logging(format="json", level="info", stream=out)
    get_logger().info("hello", who="world")
    assert json.loads(out.getvalue())["who"] == "world"
    with pytest.raises(ValueError):
        configure_logging(format="xml")  # type: ignore[arg-type]
