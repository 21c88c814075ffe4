"""In-flight generation checkpoints (docs/cold-tier.md, "Generation checkpoints").

``key``: the request key that decides which later request may resume a
checkpoint, and which requests are not checkpointed in v1. ``store``: the
checkpoint files (write the newest durably before removing the previous,
find the newest valid one, invalidate). ``counters``: the figures ``/stats``
shows. ``serving``: what the turn runner needs (key at admission, lookup,
the snapshot handed to the spill queue). ``loads``: a lookup's result on its
way back to the actor shell that started it (gateway, batch scheduler).
"""

from __future__ import annotations

from .counters import CheckpointCounters
from .key import KEY_VERSION, checkpoint_refusal, request_key
from .loads import CheckpointLoads
from .serving import Captured, CheckpointBackend, CheckpointHandoff, CheckpointPort, ResumeFrom
from .store import (
    CHECKPOINT_DIR,
    CHECKPOINT_SUFFIX,
    DeltaBase,
    FoundCheckpoint,
    checkpoint_dir,
    find_checkpoint,
    remove_checkpoints,
    write_checkpoint,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_SUFFIX",
    "KEY_VERSION",
    "Captured",
    "CheckpointBackend",
    "CheckpointCounters",
    "CheckpointHandoff",
    "CheckpointLoads",
    "CheckpointPort",
    "DeltaBase",
    "FoundCheckpoint",
    "ResumeFrom",
    "checkpoint_dir",
    "checkpoint_refusal",
    "find_checkpoint",
    "remove_checkpoints",
    "request_key",
    "write_checkpoint",
]
