"""The spill queue: one serial, byte-capped queue in front of the SSD writer.

``core`` holds the rules (sans-IO), ``actor`` the shell. See ``docs/cold-tier.md``.
"""

from __future__ import annotations

from . import core
from .actor import (
    SPILL_QUEUE_ADDRESS,
    HandleReleaser,
    SpillQueue,
)
from .core import DEFAULT_CAP_BYTES, QueueState

__all__ = [
    "DEFAULT_CAP_BYTES",
    "SPILL_QUEUE_ADDRESS",
    "HandleReleaser",
    "QueueState",
    "SpillQueue",
    "core",
]
