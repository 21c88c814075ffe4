"""The RAM tier: byte-capped LRU of token-prefix entries (rules in ``core``,
the actor shell in ``actor``)."""

from __future__ import annotations

from .actor import (
    PROMPT_CACHE_ADDRESS,
    HandleDisposer,
    PromptCache,
    SpilledEntry,
    SpillSink,
    spawn_prompt_cache,
)

__all__ = [
    "PROMPT_CACHE_ADDRESS",
    "HandleDisposer",
    "PromptCache",
    "SpillSink",
    "SpilledEntry",
    "spawn_prompt_cache",
]
