"""The SSD cold tier: index + rules (``core``), the actors (``actor``), their ports
(``ports``) and the blocking file work they run on worker threads (``io``).

See ``docs/cold-tier.md``.
"""

from __future__ import annotations

from . import core
from .actor import (
    SSD_WRITER_ADDRESS,
    ColdTier,
    Reader,
    SsdWriter,
    SsdWriterConfig,
    StoreWorker,
    cold_tier_stats,
    spawn_ssd_writer,
)
from .core import Estimator, IndexEntry, IndexState, namespace_dir
from .ports import (
    CacheSource,
    EngineTensorSource,
    EngineTurns,
    FileIdentity,
    HostStaging,
    RearmingTurns,
    StagedEntry,
    TensorSource,
    TimedEngineTurns,
)

__all__ = [
    "SSD_WRITER_ADDRESS",
    "CacheSource",
    "ColdTier",
    "EngineTensorSource",
    "EngineTurns",
    "Estimator",
    "FileIdentity",
    "HostStaging",
    "IndexEntry",
    "IndexState",
    "Reader",
    "RearmingTurns",
    "SsdWriter",
    "SsdWriterConfig",
    "StagedEntry",
    "StoreWorker",
    "TensorSource",
    "TimedEngineTurns",
    "cold_tier_stats",
    "core",
    "namespace_dir",
    "spawn_ssd_writer",
]
