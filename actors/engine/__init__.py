"""The embedding API: ``Engine`` and ``GenerationStream`` (``api``), the one
settings model (``config``) and the one place that spawns actors (``wiring``)."""

from __future__ import annotations

from .api import (
    ChatMessage,
    Completion,
    ContextTooLong,
    DoneEvent,
    Engine,
    EngineClosed,
    EngineNotStarted,
    EngineOptions,
    GenerationEvent,
    GenerationFailed,
    GenerationParams,
    GenerationStream,
    InvalidRequest,
    KvQuant,
    KvtierError,
    QueueFull,
    ServerShuttingDown,
    Timings,
    TokenEvent,
    TurnUnavailable,
    Usage,
)

__all__ = [
    "ChatMessage",
    "Completion",
    "ContextTooLong",
    "DoneEvent",
    "Engine",
    "EngineClosed",
    "EngineNotStarted",
    "EngineOptions",
    "GenerationEvent",
    "GenerationFailed",
    "GenerationParams",
    "GenerationStream",
    "InvalidRequest",
    "KvQuant",
    "KvtierError",
    "QueueFull",
    "ServerShuttingDown",
    "Timings",
    "TokenEvent",
    "TurnUnavailable",
    "Usage",
]
