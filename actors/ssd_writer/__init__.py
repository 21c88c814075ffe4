"""The SSD cold tier: the index's rules (``core``) and shell (``actor``), the store
worker (``store_core`` + ``store``), the reader (``reader_core`` + ``reader``) and the scrubber (``scrubber_core`` +
``scrubber``), their ports (``ports``) and the blocking file work they run on worker
threads (``io``).

See ``docs/cold-tier.md``.
"""

from __future__ import annotations

from . import core, reader_core, scrubber_core, store_core
from .actor import (
    SSD_WRITER_ADDRESS,
    ColdTier,
    IndexKeep,
    IoRunner,
    SsdWriter,
    SsdWriterConfig,
    ThreadPool,
    build_cold_tier,
    cold_tier_stats,
)
from .background import BackgroundThreads
from .core import CostLine, Estimator, IndexEntry, IndexState, namespace_dir
from .io import check_tier_dirs, default_max_bytes
from .offline import FingerprintUsage, PurgeReport, list_tier, purge_tier
from .ports import (
    CacheSource,
    EngineTensorSource,
    EngineTurns,
    FileIdentity,
    HostStaging,
    LandingObservation,
    RearmingTurns,
    StagedEntry,
    TensorSource,
    TimedEngineTurns,
    cold_fingerprint,
)
from .reader import Reader
from .scrubber import Scrubber
from .store import StoreWorker

__all__ = [
    "SSD_WRITER_ADDRESS",
    "BackgroundThreads",
    "CacheSource",
    "ColdTier",
    "CostLine",
    "EngineTensorSource",
    "EngineTurns",
    "Estimator",
    "FileIdentity",
    "FingerprintUsage",
    "HostStaging",
    "IndexEntry",
    "IndexKeep",
    "IndexState",
    "IoRunner",
    "LandingObservation",
    "PurgeReport",
    "Reader",
    "RearmingTurns",
    "Scrubber",
    "SsdWriter",
    "SsdWriterConfig",
    "StagedEntry",
    "StoreWorker",
    "TensorSource",
    "ThreadPool",
    "TimedEngineTurns",
    "build_cold_tier",
    "check_tier_dirs",
    "cold_fingerprint",
    "cold_tier_stats",
    "core",
    "default_max_bytes",
    "list_tier",
    "namespace_dir",
    "purge_tier",
    "reader_core",
    "scrubber_core",
    "store_core",
]
