"""The embedding API: ``Engine`` and ``GenerationStream`` (``api``), the one
settings model (``config``) and the one place that spawns actors (``wiring``)."""

from __future__ import annotations

from .api import (
    CacheDemotion,
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
    MemoryPressure,
    QueueFull,
    ServerShuttingDown,
    Timings,
    TokenEvent,
    TurnUnavailable,
    Usage,
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
