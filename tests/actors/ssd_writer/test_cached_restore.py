"""A restore of a file the page cache holds: the reader's pass reads nothing, the landing does it all."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread, cache_arrays
from kernels.cache._file_port import OsFilePort, WritableBuffer
from messages import Restore, RestoreResult, SsdStats, SsdStatsRequest, StoreResult
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    ThreadTurns,
    config,
    register,
    ssd_stats,
    store_body,
)
from tests.crash.ports import ForwardingPort


class ProbingPort(ForwardingPort):
    """A real port whose page-cache answer is scripted; counts tensor reads (``pread_into``)."""

    def __init__(self, cached: bool) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.cached = cached
        self.asked = 0
        self.tensor_reads = 0

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        """The scripted answer."""
        self.asked += 1
        return self.cached

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Count, then forward."""
        self.tensor_reads += 1
        super().pread_into(fd, buf, offset)


@pytest.mark.anyio
@pytest.mark.parametrize("cached", [True, False])
async def test_a_cached_file_restores_without_a_read_and_teaches_no_disk_speed(
    tmp_path: Path, engine: EngineThread, model: Any, cached: bool
) -> None:
    """A file the page cache holds restores bit-exact with a pass that reads no tensor and feeds
    the estimator no disk speed; one it does not hold is read by the pass and does."""
    registry = CacheRegistry()
    tokens = tuple(range(1, 13))
    reg = await register(engine, registry, model, tokens)
    originals = await engine.run(
        lambda: [mx.array(a) for a in cache_arrays(registry.get(reg.handle))]
    )
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    port = ProbingPort(cached)
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path), source=source, port=port)
        stored = await system.ask(
            "ssd_writer", store_body(reg, tokens), timeout=ASK, expect=StoreResult
        )
        assert stored.path is not None
        reads_before = port.tensor_reads
        restored = await system.ask(
            "ssd_writer", Restore(path=stored.path), timeout=ASK, expect=RestoreResult
        )
        assert restored.ok
        assert restored.staging_id is not None
        staged = tier.staging.take(restored.staging_id)
        assert staged is not None
        caches = await engine.run(
            lambda: [mx.array(a) for a in cache_arrays(tier.staging.land(staged))]
        )
        for _ in range(int(ASK / 0.01)):
            if (await ssd_stats(system, tier)).restores:
                break
            await anyio.sleep(0.01)
        stats = await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
    same = await engine.run(
        lambda: [
            bool(mx.array_equal(w, g[..., : w.shape[2], :]).item())
            for w, g in zip(originals, caches, strict=True)
        ]
    )
    assert same == [True] * len(originals)
    assert (stats.restores, stats.restore_failures) == (1, 0)
    assert port.asked == 1
    pass_reads = port.tensor_reads - reads_before
    if cached:
        assert pass_reads == 0
        assert stats.disk_read_gbps is None
    else:
        assert pass_reads >= len(originals)
        assert stats.disk_read_gbps is not None
    registry.dispose(reg.handle)
