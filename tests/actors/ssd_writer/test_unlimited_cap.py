"""``--ssd-cache-max 0`` means no cap: a start keeps every file, stores go on, a full disk soft-fails.

Real temp directories, the real codec, a tiny model on a real engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource, core
from kernels import CacheRegistry, EngineThread
from messages import StoreResult
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    FaultPort,
    ThreadTurns,
    config,
    files,
    register,
    ssd_stats,
    store_body,
)

pytestmark = pytest.mark.anyio


async def test_a_start_with_cap_zero_keeps_every_existing_file(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """Files written under a cap survive a restart with max_bytes 0, stay indexed, and stores go on."""
    registry = CacheRegistry()
    first = await register(engine, registry, model, (1, 2, 3, 4))
    second = await register(engine, registry, model, (5, 6, 7, 8))
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source)
        res = await system.ask(
            "ssd_writer", store_body(first, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        assert res.stored
    before = files(tmp_path, ".kvt")
    assert len(before) == 1
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path, max_bytes=0), source=source)
        ok = await system.ask(
            "ssd_writer", store_body(second, (5, 6, 7, 8)), timeout=ASK, expect=StoreResult
        )
        stats = await ssd_stats(system, tier)
        assert ok.stored, ok.reason
        assert (stats.entries, stats.evicted, stats.max_bytes) == (2, 0, 0)
    after = files(tmp_path, ".kvt")
    assert set(before) < set(after)
    assert len(after) == 2
    for h in (first.handle, second.handle):
        registry.dispose(h)


async def test_without_a_cap_a_full_disk_soft_fails_and_keeps_the_other_files(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """With max_bytes 0, ENOSPC while writing answers disk_full, leaves no temp file and keeps older files."""
    registry = CacheRegistry()
    first = await register(engine, registry, model, (1, 2, 3, 4))
    second = await register(engine, registry, model, (5, 6, 7, 8))
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path, max_bytes=0), source=source)
        res = await system.ask(
            "ssd_writer", store_body(first, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        assert res.stored
    kept = files(tmp_path, ".kvt")
    port = FaultPort("write_tensor", "enospc")
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system, config=config(tmp_path, max_bytes=0), source=source, port=port
        )
        full = await system.ask(
            "ssd_writer", store_body(second, (5, 6, 7, 8)), timeout=ASK, expect=StoreResult
        )
        assert port.fired
        assert (full.stored, full.reason) == (False, "disk_full")
        assert ((await ssd_stats(system, tier)).entries, (await ssd_stats(system, tier)).disk_full) == (1, 1)
    assert files(tmp_path, ".kvt") == kept
    assert files(tmp_path, ".tmp") == []
    for h in (first.handle, second.handle):
        registry.dispose(h)


def test_the_startup_scan_of_an_uncapped_tier_removes_nothing() -> None:
    """The scan with max_bytes 0 indexes every valid file and asks for no over-cap removal."""
    state = core.IndexState(root="/r", fingerprint="fp", max_bytes=0)
    scanned = tuple(
        core.ScannedFile(
            path=f"/r/fp/{core.namespace_dir('')}/{i}.kvt",
            directory=f"/r/fp/{core.namespace_dir('')}",
            problem=None,
            entry=core.IndexEntry(
                path=f"/r/fp/{core.namespace_dir('')}/{i}.kvt",
                namespace="",
                tokens=(i, i + 1),
                file_bytes=10**12,
                last_used=i,
                trimmable=False,
                min_reusable_offset=2,
            ),
            file_bytes=10**12,
        )
        for i in range(3)
    )
    state, effects = core.handle(
        state, core.ScanLoaded(core.ScanResult(files=scanned), locked=True, now=0.0)
    )
    assert [e for e in effects if isinstance(e, core.RemoveNow)] == []
    assert (len(state.entries), state.evicted) == (3, 0)
