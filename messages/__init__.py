"""Typed message bodies exchanged by kvtier's actors (data only, no behaviour)."""

from __future__ import annotations

from ._base import Body, Request
from ._envelope import EXTERNAL, Envelope, EnvelopeRecord, envelope_from_json, envelope_to_json
from ._union import AnyBody, body_adapter, body_classes, parse_body
from .prompt_cache import (
    EntryMeta,
    EntryRole,
    PromptCacheStats,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Take,
    TakeResult,
)
from .runtime import Add, Count, Failure, GetTotal, Ping, Pong, Total, Work, WorkDone

__all__ = [
    "EXTERNAL",
    "Add",
    "AnyBody",
    "Body",
    "Count",
    "EntryMeta",
    "EntryRole",
    "Envelope",
    "EnvelopeRecord",
    "Failure",
    "GetTotal",
    "Ping",
    "Pong",
    "PromptCacheStats",
    "PromptCacheStatsRequest",
    "Put",
    "PutResult",
    "Release",
    "Request",
    "Take",
    "TakeResult",
    "Total",
    "Work",
    "WorkDone",
    "body_adapter",
    "body_classes",
    "envelope_from_json",
    "envelope_to_json",
    "parse_body",
]
