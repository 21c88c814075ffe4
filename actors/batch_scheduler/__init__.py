"""The batch scheduler: continuous batching as an actor (``core`` sans-IO + ``actor`` shell).

See docs/batching.md.
"""

from __future__ import annotations

from . import core
from .actor import BatchScheduler
from .engine import BatchEngine, SnapshotPoint
from .wiring import BATCH_ADDRESS, batch_factory, batch_refusal

__all__ = [
    "BATCH_ADDRESS",
    "BatchEngine",
    "BatchScheduler",
    "SnapshotPoint",
    "batch_factory",
    "batch_refusal",
    "core",
]
