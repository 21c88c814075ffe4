"""A generation checkpoint's engine turn copies nothing, and its MLX buffers die on the engine thread.

The store worker's checkpoint turn (``EngineTensorSource.checkpoint_views``)
plans the file and hands out views that share the snapshot arrays' memory;
the bytes are read by a worker thread while the file is written, and the
views are released in the source's ``finish`` turn. Every view a source
hands out (prompt entries' and checkpoints') has its last reference dropped
on the engine thread, also when the asker stopped waiting for its turn.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import actors.ssd_writer.ports as ports
from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread, RegisteredCache, cache_arrays
from kernels.cache import GenerationCheckpoint, tensors_bytes
from messages import EntryMeta, Store, StoreResult
from messages.spill_queue import CheckpointRecord
from tests.actors.ssd_writer.support import ASK, IDENTITY, ThreadTurns, config, files, register

pytestmark = pytest.mark.anyio

T = TypeVar("T")
KEY = "ab" * 16
PROMPT = (1, 2, 3, 4, 5)
EMITTED = (6, 7, 8)


async def _snapshot(engine: EngineThread, registry: CacheRegistry, model: Any) -> RegisteredCache:
    """The registry's owned snapshot of a live cache after ``PROMPT + EMITTED`` (as a checkpoint)."""
    tokens = (*PROMPT, *EMITTED)

    def job() -> RegisteredCache:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(tokens)]), cache=cache), *cache_arrays(cache))
        reg = registry.snapshot(cache, offset=len(tokens))
        mx.eval(*cache_arrays(registry.get(reg.handle)))
        return reg

    return await engine.run(job)


def _record(pending: int = 9) -> GenerationCheckpoint:
    return GenerationCheckpoint(KEY, len(PROMPT), pending, len(EMITTED), None)


def _store(reg: RegisteredCache) -> Store:
    record = CheckpointRecord(request_key=KEY, prompt_len=len(PROMPT), pending_token=9,
                              sample_index=len(EMITTED))
    meta = EntryMeta(offset=len(PROMPT) + len(EMITTED), nbytes=reg.meta.nbytes,
                     trimmable=True, min_reusable_offset=0)
    return Store(handle=reg.handle, tokens=(*PROMPT, *EMITTED), meta=meta, checkpoint=record)


async def test_the_checkpoint_turn_hands_out_views_of_the_snapshot_not_host_copies(
    engine: EngineThread, model: Any
) -> None:
    """Every view the checkpoint turn returns shares memory with the registry's snapshot array
    of its tensor (no byte is copied in the turn), and holds that tensor's planned bytes."""
    registry = CacheRegistry()
    reg = await _snapshot(engine, registry, model)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    plan, views = await source.checkpoint_views(
        reg.handle, namespace="", tokens=(*PROMPT, *EMITTED), checkpoint=_record()
    )

    def check() -> list[bool]:
        snapshot: list[Any] = cache_arrays(registry.get(reg.handle))
        arrays = [np.frombuffer(memoryview(a).cast("B"), np.uint8) for a in snapshot]
        return [any(np.shares_memory(np.frombuffer(v, np.uint8), a) for a in arrays)
                for v in views]

    try:
        assert len(views) == len(plan.tensors) >= 4
        assert [len(memoryview(v)) for v in views] == [t.nbytes for t in plan.tensors]
        assert await engine.run(check) == [True] * len(views)
    finally:
        views.clear()
        await source.finish(plan)
        registry.dispose(reg.handle)


class _Tracked(bytearray):
    """Host bytes standing in for an MLX buffer: records the thread that drops its last reference."""

    deaths: list[int]

    def __del__(self) -> None:
        self.deaths.append(threading.get_ident())


def _tracking(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Make the source's views exports of :class:`_Tracked` bytes; (handed out, deaths' threads)."""
    handed: list[int] = []
    deaths: list[int] = []

    def tracked_bytes(plan: Any, indices: Any, tails: Any = None) -> list[memoryview]:
        out: list[memoryview] = []
        for index, real in zip(indices, tensors_bytes(plan, indices, tails), strict=True):
            buf = _Tracked(real)
            buf.deaths = deaths
            handed.append(index)
            out.append(memoryview(buf))
        return out

    monkeypatch.setattr(ports, "tensors_bytes", tracked_bytes)
    return handed, deaths


async def test_no_view_a_write_used_is_last_released_off_the_engine_thread(
    tmp_path: Path, engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt entry and a checkpoint written through the real store worker: every view the
    source handed out is released (once the actors stop), each on the engine thread."""
    handed, deaths = _tracking(monkeypatch)
    registry = CacheRegistry()
    prompt = await register(engine, registry, model, PROMPT)
    snap = await _snapshot(engine, registry, model)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    engine_thread = await engine.run(threading.get_ident)
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source)
        stored = await system.ask("ssd_writer", Store(handle=prompt.handle, tokens=PROMPT,
                                                      meta=prompt.meta),
                                  timeout=ASK, expect=StoreResult)  # fmt: skip
        assert stored.stored
        stored = await system.ask("ssd_writer", _store(snap), timeout=ASK, expect=StoreResult)
        assert stored.stored, stored.reason
    assert len(files(tmp_path, ".kvc")) == 1
    # NOTE: finished plans are released at the registry's next drain (the
    # next batch step or request turn, here run by hand).
    await engine.run(registry.drain)
    gc.collect()
    assert len(handed) >= 8
    assert len(deaths) == len(handed)
    assert set(deaths) == {engine_thread}
    registry.dispose(prompt.handle)
    registry.dispose(snap.handle)


class _AbandonedTurns:
    """Engine turns whose asker stops waiting: the first turn runs, then the await fails."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine
        self.abandon_next = True

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread; the first call then raises as a timed-out wait would."""
        result = await self.engine.run(fn)
        if self.abandon_next:
            self.abandon_next = False
            del result
            raise TimeoutError("the asker stopped waiting")
        return result


async def test_views_of_an_abandoned_checkpoint_turn_die_in_the_next_turn_on_the_engine_thread(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint turn whose asker stopped waiting after it ran leaves its views with the
    source, which releases them in its next turn, on the engine thread."""
    handed, deaths = _tracking(monkeypatch)
    registry = CacheRegistry()
    reg = await _snapshot(engine, registry, model)
    source = EngineTensorSource(_AbandonedTurns(engine), registry, IDENTITY)
    engine_thread = await engine.run(threading.get_ident)
    with pytest.raises(TimeoutError):
        await source.checkpoint_views(reg.handle, namespace="", tokens=(*PROMPT, *EMITTED),
                                      checkpoint=_record())  # fmt: skip
    gc.collect()
    abandoned = len(handed)
    assert abandoned
    assert deaths == []
    # NOTE: the plan's turn hands out views of its own; they live until finish.
    plan = await source.plan(reg.handle, namespace="", tokens=(*PROMPT, *EMITTED))
    assert len(deaths) == abandoned
    assert set(deaths) == {engine_thread}
    await source.finish(plan)
    registry.dispose(reg.handle)


class _LateTurns:
    """Engine turns whose asker stops waiting first: the turn runs only afterwards."""

    def __init__(self) -> None:
        self.late: list[Callable[[], Any]] = []

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """Keep ``fn`` for a later run and fail the wait at once."""
        self.late.append(fn)
        raise TimeoutError("the asker stopped waiting before the turn ran")


async def test_a_checkpoint_turn_that_runs_after_its_asker_left_releases_its_views_itself(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn that runs after its asker stopped waiting releases its views in that same turn,
    on the engine thread, and leaves nothing held."""
    handed, deaths = _tracking(monkeypatch)
    registry = CacheRegistry()
    reg = await _snapshot(engine, registry, model)
    turns = _LateTurns()
    source = EngineTensorSource(turns, registry, IDENTITY)
    engine_thread = await engine.run(threading.get_ident)
    with pytest.raises(TimeoutError):
        await source.checkpoint_views(reg.handle, namespace="", tokens=(*PROMPT, *EMITTED),
                                      checkpoint=_record())  # fmt: skip
    (late,) = turns.late
    _, views = await engine.run(late)
    assert views == []
    assert handed
    assert len(deaths) == len(handed)
    assert set(deaths) == {engine_thread}
    registry.dispose(reg.handle)


FILLER = 4 << 20
"""Bytes :func:`_fill_cache` frees into MLX's buffer cache."""


def _fill_cache() -> int:
    """Engine thread: free a 4 MiB array into MLX's buffer cache; the cache's bytes afterwards."""
    filler = mx.zeros((1 << 20,), dtype=mx.float32)
    mx.eval(filler)
    del filler
    return int(mx.get_cache_memory())


@pytest.fixture(
    params=[(True, "on", True), (True, None, False), (False, "on", False)],
    ids=["migrating-on", "migrating-default", "not-migrating-on"],
)
def empties(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Host reads migrating or not, KVTIER_CUDA_RELEASE_CACHE on or unset; whether a release
    should then empty MLX's buffer cache."""
    from kernels.cache import _kv_writer

    migrate, release, expected = request.param
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", migrate)
    if release is None:
        monkeypatch.delenv(_kv_writer.RELEASE_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(_kv_writer.RELEASE_CACHE_ENV, release)
    return bool(expected)


async def test_a_finished_checkpoint_frees_its_host_copies_where_switched_on(
    engine: EngineThread, model: Any, empties: bool
) -> None:
    """Where host reads migrate pages (CUDA managed memory) and KVTIER_CUDA_RELEASE_CACHE=on, the
    release of a finished checkpoint (at the registry's next drain) empties MLX's buffer cache;
    by default, and where nothing migrates, the cache is kept."""
    registry = CacheRegistry()
    reg = await _snapshot(engine, registry, model)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    plan, views = await source.checkpoint_views(
        reg.handle, namespace="", tokens=(*PROMPT, *EMITTED), checkpoint=_record()
    )
    assert views
    views.clear()
    filled = await engine.run(_fill_cache)
    assert filled >= FILLER
    await source.finish(plan)
    # NOTE: finish takes no turn; the release runs at the registry's next drain.
    await engine.run(registry.drain)
    # NOTE: the released plan's buffers (kilobytes for this model) may be
    # cached afterwards; emptied, the cache no longer holds the 4 MiB filler,
    # kept, it does.
    after = await engine.run(lambda: int(mx.get_cache_memory()))
    assert (after < FILLER) is empties
    registry.dispose(reg.handle)


async def test_a_spill_frees_each_dropped_group_of_host_copies_where_switched_on(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch, empties: bool
) -> None:
    """A prompt spill's turn that drops the previous group's views empties MLX's buffer cache
    before it takes the next group's where host reads migrate and KVTIER_CUDA_RELEASE_CACHE=on;
    otherwise the cache is kept."""
    # NOTE: one tensor per group, so the second tensor's turn drops the first group.
    monkeypatch.setattr(ports, "VIEW_GROUP_BYTES", 1)
    registry = CacheRegistry()
    prompt = await register(engine, registry, model, PROMPT)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    plan = await source.plan(prompt.handle, namespace="", tokens=PROMPT)
    assert len(plan.tensors) >= 2
    assert len(await source.tensor(plan, 0)) == plan.tensors[0].nbytes
    filled = await engine.run(_fill_cache)
    second = await source.tensor(plan, 1)
    assert len(second) == plan.tensors[1].nbytes
    # NOTE: the turn's own transients (the next group's copy intermediates,
    # kilobytes for this model) may be cached afterwards; emptied, the cache
    # no longer holds the 4 MiB filler, kept, it does.
    after = await engine.run(lambda: int(mx.get_cache_memory()))
    assert filled >= FILLER
    assert (after < FILLER) is empties
    del second
    await source.finish(plan)
    registry.dispose(prompt.handle)
