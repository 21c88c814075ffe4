"""The RAM tier: byte-capped LRU of token-prefix entries (rules in ``core``,
the actor shell in ``actor``)."""

from __future__ import annotations

from .actor import (
    DRAIN_STEP,
    PROMPT_CACHE_ADDRESS,
    HandleDisposer,
    PromptCache,
)

__all__ = [
    "DRAIN_STEP",
    "PROMPT_CACHE_ADDRESS",
    "HandleDisposer",
    "PromptCache",
]
