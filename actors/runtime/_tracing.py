"""structlog configuration and the per-message trace switch.

Per-message events (``mailbox.sent``/``received``/``handled``/``failed``) are
emitted at debug level. NOTE: the hot path checks ONE boolean
(``TRACE.on``) before building any event dict, so filtered tracing costs an
attribute load per message; ``configure_logging`` sets it from the level.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

import structlog

__all__ = ["KVTIER_HANDLER", "TRACE", "TraceSwitch", "configure_logging", "get_logger", "set_tracing"]

KVTIER_HANDLER = "kvtier_handler"
"""Attribute marking the stdlib ``logging`` handler that ``configure_logging`` installs."""

LogFormat = Literal["console", "json"]


class TraceSwitch:
    """Whether per-message events are built and emitted."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


TRACE = TraceSwitch()
"""The process-wide switch read on every send and receive."""

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def set_tracing(on: bool) -> bool:
    """Turn per-message events on or off; returns the previous setting."""
    previous = TRACE.on
    TRACE.on = on
    return previous


def get_logger(name: str = "kvtier") -> Any:
    """A structlog logger (bound lazily, so later configuration applies)."""
    return structlog.get_logger(name)


def configure_logging(
    format: LogFormat | None = None,
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog for the process.

    ``format`` defaults to ``console`` (readable; ``kvtier serve`` passes
    ``EngineConfig.log_format``, which ``KVTIER_LOG_FORMAT`` sets);
    ``json`` writes one JSON object per line. ``level`` filters events; at
    ``debug`` the per-message mailbox events are switched on, above it they
    are not even built. Context bound with ``structlog.contextvars`` (the
    runtime binds ``correlation_id`` and ``actor`` while a message is handled)
    is merged into every event, including the user's own log lines.

    Records of the standard ``logging`` module (uvicorn, libraries) are
    rendered by the same renderer on the same stream, at ``level`` but never
    below info, so a JSON log stays one JSON object per line.
    """
    fmt = format or "console"
    if fmt not in ("console", "json"):
        raise ValueError(f"unknown log format {fmt!r} (console or json)")
    numeric = level if isinstance(level, int) else _LEVELS[level.lower()]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors.append(structlog.processors.format_exc_info)
    processors.append(renderer)
    out = stream or sys.stderr
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    _route_stdlib_logging(processors[:-1], renderer, out, max(numeric, logging.INFO))
    set_tracing(numeric <= logging.DEBUG)


def _route_stdlib_logging(chain: list[Any], renderer: Any, stream: TextIO, level: int) -> None:
    """Render stdlib ``logging`` records like structlog events (replacing our earlier handler)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, KVTIER_HANDLER, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *chain],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    # NOTE: marked so a second configure_logging replaces it and tests can remove it;
    # other handlers (pytest's capture) stay.
    setattr(handler, KVTIER_HANDLER, True)
    root.addHandler(handler)
    root.setLevel(level)
