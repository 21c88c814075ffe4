"""D4-3: the SSD tier's LRU is the files' mtime, touched on a hit, so it survives a restart.

The index orders entries by a counter while it runs, but after a restart
only the files' mtimes say which entry was used last. A restore must set
its file's mtime to now (``actors.ssd_writer.io.pass_entry``); otherwise a
restarted tier evicts the entry that was just used instead of the one that
was not (mutation: drop the ``utime`` in ``pass_entry``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread
from messages import (
    Find,
    FindResult,
    Restore,
    RestoreResult,
    SsdStats,
    SsdStatsRequest,
    StoreResult,
)
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    ThreadTurns,
    config,
    register,
    ssd_stats,
    store_body,
)

pytestmark = pytest.mark.anyio

A, B, C = (21, 2, 3, 4), (22, 2, 3, 4), (23, 2, 3, 4)


async def _find(system: ActorSystem, tokens: tuple[int, ...]) -> FindResult:
    return await system.ask("ssd_writer", Find(tokens=(*tokens, 0)), timeout=ASK, expect=FindResult)


async def test_a_restored_file_outlives_an_unused_newer_one_across_a_restart(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """A stored before B; a restart, a restore of A (its mtime now newest), another restart and
    a store over a two-file cap: B is evicted, A is kept."""
    registry = CacheRegistry()
    regs = {t: await register(engine, registry, model, t) for t in (A, B, C)}
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    paths: dict[tuple[int, ...], str] = {}
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source)
        for tokens in (A, B):
            res = await system.ask("ssd_writer", store_body(regs[tokens], tokens),
                                   timeout=ASK, expect=StoreResult)
            assert res.stored
            assert res.path is not None
            paths[tokens] = res.path
            one_file = res.file_bytes
    # NOTE: distinct, ordered mtimes (A older than B), as two stores a minute apart.
    base = os.stat(paths[B]).st_mtime_ns - 120 * 10**9
    os.utime(paths[A], ns=(base, base))
    os.utime(paths[B], ns=(base + 60 * 10**9,) * 2)
    cap = 2 * one_file + one_file // 2

    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path, cap), source=source)
        found = await _find(system, A)
        restored = await system.ask("ssd_writer", Restore(path=found.path or ""),
                                    timeout=ASK, expect=RestoreResult)
        assert restored.ok
        assert restored.staging_id is not None
        staged = tier.staging.take(restored.staging_id)
        assert staged is not None
        caches = await engine.run(tier.staging.land, staged)
        await engine.run(caches.clear)
        with anyio.fail_after(ASK):
            while True:  # NOTE: the reader's report (after its pass and touch) reaches the index.
                stats = await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK,
                                         expect=SsdStats)
                if stats.restores == 1:
                    break
                await anyio.sleep(0.01)
    assert os.stat(paths[A]).st_mtime_ns > os.stat(paths[B]).st_mtime_ns

    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path, cap), source=source)
        res = await system.ask("ssd_writer", store_body(regs[C], C), timeout=ASK,
                               expect=StoreResult)
        assert res.stored
        assert (await ssd_stats(system, tier)).evicted == 1
        assert (await _find(system, A)).cached_tokens == len(A)
        assert (await _find(system, B)).choice == "miss"
    for reg in regs.values():
        registry.dispose(reg.handle)
