"""Store faults through an injecting file port: every write step, ENOSPC / EIO / short write.

Each fault must soft-fail the store (``stored=False`` with a reason), leave
no temp or partial file behind, keep the index and the cap right, and the
next store must succeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread
from messages import Find, FindResult, StoreResult
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    FaultPort,
    ThreadTurns,
    config,
    disk_bytes,
    files,
    register,
    ssd_stats,
    store_body,
)

pytestmark = pytest.mark.anyio

STEPS = (
    "open_temp",
    "truncate",
    "write_tensor",
    "write_header",
    "fsync",
    "close",
    "replace",
    "fsync_dir",
)
_FSYNC_LIKE = {"fsync", "close", "fsync_dir"}
CASES = [(step, fault) for step in STEPS for fault in ("enospc", "eio")] + [
    ("write_tensor", "short"),
    ("write_header", "short"),
]


def expected_reason(step: str, fault: str) -> str:
    """What the writer reports: a full disk, a failed sync (never retried), or an I/O error."""
    if fault == "enospc":
        return "disk_full"
    return "fsync_failed" if step in _FSYNC_LIKE else "io_error"


@pytest.mark.parametrize(("step", "fault"), CASES)
async def test_a_fault_at_any_write_step_soft_fails_and_leaves_nothing(
    tmp_path: Path, engine: EngineThread, model: Any, step: str, fault: str
) -> None:
    """The store is not stored, no file remains, the index is empty, the next store works."""
    registry = CacheRegistry()
    first = await register(engine, registry, model, (1, 2, 3, 4))
    second = await register(engine, registry, model, (5, 6, 7, 8))
    port = FaultPort(step, fault)
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system,
            config=config(tmp_path),
            source=EngineTensorSource(ThreadTurns(engine), registry, IDENTITY),
            port=port,
        )
        res = await system.ask(
            "ssd_writer", store_body(first, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        assert port.fired
        assert (res.stored, res.reason) == (False, expected_reason(step, fault))
        assert files(tmp_path, ".tmp") == []
        assert files(tmp_path, ".kvt") == []
        stats = await ssd_stats(system, tier)
        assert (stats.entries, stats.bytes, stats.reserved_bytes, stats.store_failures) == (
            0,
            0,
            0,
            1,
        )
        miss = await system.ask(
            "ssd_writer", Find(tokens=(1, 2, 3, 4, 5)), timeout=ASK, expect=FindResult
        )
        assert miss.choice == "miss"
        ok = await system.ask(
            "ssd_writer", store_body(second, (5, 6, 7, 8)), timeout=ASK, expect=StoreResult
        )
        assert ok.stored
        assert (await ssd_stats(system, tier)).bytes == ok.file_bytes == disk_bytes(tmp_path)
    for h in (first.handle, second.handle):
        registry.dispose(h)
