"""The cold tier's actors on the real runtime: real temp directory, real codec, tiny model.

Every MLX call runs on a real ``EngineThread``; the tensor source's engine
turns are that thread's jobs (what the gateway's ``RunWhenIdle`` grants in
serving).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from actors.engine.wiring import spawn_spill_queue, spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource, namespace_dir
from kernels import CacheRegistry, EngineThread, cache_arrays
from kernels.cache import CacheFileCorrupt
from messages import (
    DrainSpills,
    Enqueue,
    Find,
    FindResult,
    Restore,
    RestoreResult,
    SpillsDrained,
    SsdStats,
    SsdStatsRequest,
    StoreResult,
)
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    CapCheckingPort,
    ThreadRecordingPort,
    ThreadTurns,
    config,
    disk_bytes,
    exists,
    files,
    flip_last_byte,
    register,
    ssd_stats,
    store_body,
)

pytestmark = pytest.mark.anyio


async def test_store_restart_scan_find_restore_materialize_round_trip(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """An entry stored through the queue is found after a restart, restored and bit-exact."""
    registry = CacheRegistry()
    tokens = tuple(range(1, 13))
    reg = await register(engine, registry, model, tokens)
    originals = await engine.run(
        lambda: [mx.array(a) for a in cache_arrays(registry.get(reg.handle))]
    )
    turns = ThreadTurns(engine)
    source = EngineTensorSource(turns, registry, IDENTITY)
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path), source=source)
        queue = spawn_spill_queue(system, releaser=registry)
        await queue.tell(Enqueue(handle=reg.handle, tokens=tokens, meta=reg.meta))
        drained = await queue.ask(DrainSpills(), timeout=ASK, expect=SpillsDrained)
        assert drained.stored == 1
        n_tensors = len(originals)
        # NOTE: one turn: the plan, with the small entry's tensors' views
        # (VIEW_GROUP_BYTES); finish takes none (released at the next drain).
        assert n_tensors >= 2
        assert turns.turns == 1
        assert (await ssd_stats(system, tier)).spills == 1
    # the queue released the handle once the store settled
    assert reg.handle not in registry
    (path,) = files(tmp_path, ".kvt")
    assert path.parent == tmp_path / IDENTITY.fingerprint / namespace_dir("")
    assert files(tmp_path, ".tmp") == []

    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path), source=source)
        found = await system.ask(
            "ssd_writer", Find(tokens=(*tokens, 99)), timeout=ASK, expect=FindResult
        )
        assert (found.choice, found.cached_tokens, found.entry_tokens) == ("restore", 12, 12)
        assert found.path == str(path)
        restored = await system.ask(
            "ssd_writer", Restore(path=found.path), timeout=ASK, expect=RestoreResult
        )
        assert restored.ok
        assert restored.staging_id is not None
        staged = tier.staging.take(restored.staging_id)
        assert staged is not None
        caches = await engine.run(tier.staging.land, staged)
        stats = await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
        assert (stats.entries, stats.restores) == (1, 1)

    def compare() -> bool:
        got = cache_arrays(caches)
        return len(got) == len(originals) and all(
            mx.array_equal(a[..., : len(tokens), :], b[..., : len(tokens), :]).item()
            for a, b in zip(got, originals, strict=True)
        )

    assert await engine.run(compare)

    def drop() -> None:
        caches.clear()
        originals.clear()

    await engine.run(drop)


async def test_file_io_never_runs_on_the_loop_or_the_engine_thread(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """Every file-port call of a scan, store and restore runs on a worker thread."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (5, 6, 7, 8))
    engine_ident = await engine.run(threading.get_ident)
    port = ThreadRecordingPort()
    async with ActorSystem() as system:
        spawn_ssd_writer(
            system,
            config=config(tmp_path),
            source=EngineTensorSource(ThreadTurns(engine), registry, IDENTITY),
            port=port,
        )
        res = await system.ask(
            "ssd_writer", store_body(reg, (5, 6, 7, 8)), timeout=ASK, expect=StoreResult
        )
        assert res.stored
        found = await system.ask(
            "ssd_writer", Find(tokens=(5, 6, 7, 8, 9)), timeout=ASK, expect=FindResult
        )
        assert found.path is not None
        restored = await system.ask(
            "ssd_writer", Restore(path=found.path), timeout=ASK, expect=RestoreResult
        )
        assert restored.ok
    registry.dispose(reg.handle)
    loop_ident = threading.get_ident()
    assert port.threads
    assert loop_ident not in port.threads
    assert engine_ident not in port.threads


async def test_cap_counts_temp_files_and_evicts_lru_before_writing(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """Under a small cap, bytes on disk (temp files included) never exceed it at any write."""
    registry = CacheRegistry()
    first = await register(engine, registry, model, (1, 2, 3, 4))
    port = CapCheckingPort(tmp_path)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as system:
        probe = spawn_ssd_writer(system, config=config(tmp_path / "probe"), source=source)
        res = await system.ask(
            "ssd_writer", store_body(first, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        one_file = res.file_bytes
        assert (await ssd_stats(system, probe)).bytes == one_file
    cap = 2 * one_file + one_file // 2  # room for two files, not three
    port.cap = cap
    handles = []
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system, config=config(tmp_path / "capped", cap), source=source, port=port
        )
        for i in range(5):
            tokens = (10 + i, 2, 3, 4)
            reg = await register(engine, registry, model, tokens)
            handles.append(reg.handle)
            res = await system.ask(
                "ssd_writer", store_body(reg, tokens), timeout=ASK, expect=StoreResult
            )
            assert res.stored
            assert disk_bytes(tmp_path / "capped") <= cap
            assert (await ssd_stats(system, tier)).bytes + (await ssd_stats(system, tier)).reserved_bytes <= cap
        stats = await ssd_stats(system, tier)
        assert (stats.entries, stats.evicted) == (2, 3)
        # the two newest survive
        found = await system.ask(
            "ssd_writer", Find(tokens=(14, 2, 3, 4, 0)), timeout=ASK, expect=FindResult
        )
        assert found.cached_tokens == 4
        gone = await system.ask(
            "ssd_writer", Find(tokens=(10, 2, 3, 4, 0)), timeout=ASK, expect=FindResult
        )
        assert gone.choice == "miss"
    assert port.max_seen <= cap
    for h in [first.handle, *handles]:
        registry.dispose(h)


async def test_an_entry_larger_than_the_cap_is_not_stored(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """too_large: nothing written, nothing evicted."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (1, 2, 3))
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system,
            config=config(tmp_path, max_bytes=1000),
            source=EngineTensorSource(ThreadTurns(engine), registry, IDENTITY),
        )
        res = await system.ask(
            "ssd_writer", store_body(reg, (1, 2, 3)), timeout=ASK, expect=StoreResult
        )
        assert (res.stored, res.reason) == (False, "too_large")
        assert (await ssd_stats(system, tier)).too_large == 1
    assert files(tmp_path, ".kvt") == []
    assert files(tmp_path, ".tmp") == []
    registry.dispose(reg.handle)


async def test_supersession_removes_the_ancestor_file(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """A trimmable descendant's commit unlinks its ancestor's file; Find then trims the new one."""
    registry = CacheRegistry()
    short = await register(engine, registry, model, (1, 2, 3))
    long = await register(engine, registry, model, (1, 2, 3, 4, 5, 6))
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system,
            config=config(tmp_path),
            source=EngineTensorSource(ThreadTurns(engine), registry, IDENTITY),
        )
        a = await system.ask(
            "ssd_writer", store_body(short, (1, 2, 3)), timeout=ASK, expect=StoreResult
        )
        b = await system.ask(
            "ssd_writer", store_body(long, (1, 2, 3, 4, 5, 6)), timeout=ASK, expect=StoreResult
        )
        assert b.superseded == 1
        found = await system.ask(
            "ssd_writer", Find(tokens=(1, 2, 3, 9)), timeout=ASK, expect=FindResult
        )
        assert (found.path, found.cached_tokens, found.entry_tokens) == (b.path, 3, 6)
        assert (await ssd_stats(system, tier)).entries == 1
    assert a.path is not None
    assert not exists(a.path)
    for h in (short.handle, long.handle):
        registry.dispose(h)


async def test_scan_reaps_orphans_removes_corrupt_and_ignores_foreign_dirs(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """A restart removes temp orphans and corrupt files, keeps and counts foreign directories."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (1, 2, 3, 4))
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source)
        res = await system.ask(
            "ssd_writer", store_body(reg, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
    registry.dispose(reg.handle)
    assert res.path is not None
    ns_dir = Path(res.path).parent
    (ns_dir / "0123.kvt.tmp").write_bytes(b"partial")
    (ns_dir / "junk.kvt").write_bytes(b"not a cache file at all" * 100)
    foreign = tmp_path / "another-fingerprint" / "abc"
    foreign.mkdir(parents=True)
    (foreign / "keep.kvt").write_bytes(b"x")
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source)
        stats = await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
    assert (stats.entries, stats.corrupt_removed, stats.orphans_reaped, stats.foreign_dirs) == (
        1,
        1,
        1,
        1,
    )
    assert files(ns_dir, ".tmp") == []
    assert not (ns_dir / "junk.kvt").exists()
    assert (foreign / "keep.kvt").exists()
    assert stats.ready


async def test_a_flipped_bit_is_a_miss_the_file_is_removed_and_counted(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """A corrupted tensor fails its landing (the pass only reads): no caches, unlinked, counted."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (1, 2, 3, 4))
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path), source=source)
        res = await system.ask(
            "ssd_writer", store_body(reg, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        assert res.path is not None
        flip_last_byte(res.path)
        restored = await system.ask(
            "ssd_writer", Restore(path=res.path), timeout=ASK, expect=RestoreResult
        )
        # NOTE: the answer comes once the file is open, before the pass.
        assert restored.ok
        assert restored.staging_id is not None
        staged = tier.staging.take(restored.staging_id)
        assert staged is not None
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            await engine.run(tier.staging.land, staged)
        after = await system.ask(
            "ssd_writer", Find(tokens=(1, 2, 3, 4, 5)), timeout=ASK, expect=FindResult
        )
        assert after.choice == "miss"
        stats = await ssd_stats(system, tier)
        assert (stats.corrupt_removed, stats.entries) == (1, 0)
    assert not exists(res.path)
    assert len(tier.staging) == 0
    registry.dispose(reg.handle)


async def test_a_second_server_on_the_directory_is_read_only(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """While one tier holds the directory lock, another restores but stores and removes nothing."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (1, 2, 3, 4))
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    async with ActorSystem() as first:
        spawn_ssd_writer(first, config=config(tmp_path), source=source)
        res = await first.ask(
            "ssd_writer", store_body(reg, (1, 2, 3, 4)), timeout=ASK, expect=StoreResult
        )
        assert res.stored
        async with ActorSystem() as second:
            other = spawn_ssd_writer(second, config=config(tmp_path), source=source)
            refused = await second.ask(
                "ssd_writer", store_body(reg, (9, 9)), timeout=ASK, expect=StoreResult
            )
            assert (refused.stored, refused.reason) == (False, "invalid")
            refused = await second.ask(
                "ssd_writer", store_body(reg, (1, 2, 3, 5)), timeout=ASK, expect=StoreResult
            )
            assert (refused.stored, refused.reason) == (False, "read_only")
            found = await second.ask(
                "ssd_writer", Find(tokens=(1, 2, 3, 4, 5)), timeout=ASK, expect=FindResult
            )
            assert found.cached_tokens == 4
            assert (await ssd_stats(second, other)).read_only
    # the lock is released once the first system stops: a third one may write
    async with ActorSystem() as third:
        tier = spawn_ssd_writer(third, config=config(tmp_path), source=source)
        await third.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
        assert not (await ssd_stats(third, tier)).read_only
    registry.dispose(reg.handle)
