"""Simulated-runtime scenarios of the cold tier (recorded and replayed by the tests).

``spill_store_restart_restore``: an entry goes through the spill queue to
the writer, a second tier (a restart: new index, same directory) scans it,
finds it, restores it, and the materialized cache equals the original.
Everything nondeterministic stays out of the messages: file names are
digests of the tokens, the LRU order is a logical clock, read times come
from the simulated clock.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

from actors.engine.wiring import spawn_spill_queue, spawn_ssd_writer
from actors.runtime import SimulatedSystem
from actors.ssd_writer import EngineTensorSource, SsdWriterConfig
from kernels import CacheRegistry, EngineThread, cache_arrays
from messages import DrainSpills, Enqueue, Find, FindResult, Restore, RestoreResult, SpillsDrained
from tests.actors.ssd_writer.support import ASK, IDENTITY, ThreadTurns, register
from tests.tiny_models import kv_llama


def _fresh(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    Path(root).mkdir(parents=True)


async def spill_store_restart_restore(system: SimulatedSystem, *, root: str) -> None:
    """Spill -> store -> restart scan -> find -> restore -> materialize equals the original."""
    await anyio.to_thread.run_sync(_fresh, root)
    tokens = tuple(range(3, 13))
    async with EngineThread() as engine:
        model = await engine.run(kv_llama)
        registry = CacheRegistry()
        reg = await register(engine, registry, model, tokens)
        original = await engine.run(
            lambda: [
                mx.array(a[..., : len(tokens), :]) for a in cache_arrays(registry.get(reg.handle))
            ]
        )
        source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
        # NOTE: a dozen-token prompt: any longer prefix restores (no MIN_RESTORE_TOKENS floor).
        cfg = SsdWriterConfig(root=root, identity=IDENTITY, max_bytes=1 << 30,
                              min_restore_tokens=1)
        spawn_ssd_writer(system, config=cfg, source=source, name="ssd_writer")
        queue = spawn_spill_queue(system, releaser=registry, writer="ssd_writer")
        await queue.tell(Enqueue(handle=reg.handle, tokens=tokens, meta=reg.meta))
        drained = await queue.ask(DrainSpills(), timeout=ASK, expect=SpillsDrained)
        assert drained.stored == 1
        # NOTE: the restart: a new index (fresh state) scans the directory;
        # the first tier still holds its lock, so the new one restores from it
        # read-only (no LRU touch), as a second server would.
        second = spawn_ssd_writer(system, config=cfg, source=source, name="ssd_writer_b")
        found = await system.ask(
            "ssd_writer_b", Find(tokens=(*tokens, 1)), timeout=ASK, expect=FindResult
        )
        assert (found.choice, found.cached_tokens) == ("restore", len(tokens))
        assert found.path is not None
        restored = await system.ask(
            "ssd_writer_b", Restore(path=found.path), timeout=ASK, expect=RestoreResult
        )
        assert restored.ok
        assert restored.staging_id is not None
        staged = second.staging.take(restored.staging_id)
        assert staged is not None

        def same() -> bool:
            caches: list[Any] = second.staging.land(staged)
            got = [a[..., : len(tokens), :] for a in cache_arrays(caches)]
            return all(mx.array_equal(a, b).item() for a, b in zip(got, original, strict=True))

        assert await engine.run(same)
        await engine.run(original.clear)
