"""The embedding API: ``Engine`` and ``GenerationStream`` (``api``), the one
settings model (``config``) and the one place that spawns actors (``wiring``)."""

from __future__ import annotations

from actors.errors import (
    ContextTooLong,
    EngineClosed,
    EngineNotStarted,
    GenerationFailed,
    InvalidRequest,
    KvtierError,
    MemoryPressure,
    QueueFull,
    ServerShuttingDown,
    TurnUnavailable,
)
from messages.gateway import (
    DoneEvent,
    GenerationEvent,
    GenerationParams,
    Timings,
    TokenEvent,
    Usage,
)

from .api import (
    CacheDemotion,
    ChatMessage,
    Completion,
    Engine,
    EngineOptions,
    GenerationStream,
    KvQuant,
)
from .config import ConfigError, EngineConfig

__all__ = [
    "CacheDemotion",
    "ChatMessage",
    "Completion",
    "ConfigError",
    "ContextTooLong",
    "DoneEvent",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineNotStarted",
    "EngineOptions",
    "GenerationEvent",
    "GenerationFailed",
    "GenerationParams",
    "GenerationStream",
    "InvalidRequest",
    "KvQuant",
    "KvtierError",
    "MemoryPressure",
    "QueueFull",
    "ServerShuttingDown",
    "Timings",
    "TokenEvent",
    "TurnUnavailable",
    "Usage",
]
