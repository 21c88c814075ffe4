"""RG-1: each write step's read-back runs inside a granted engine turn, on the engine thread.

The SSD writer's tensor source asks for a turn (``run_when_idle``) and reads
a group of tensors back (``tensors_bytes``, up to ``VIEW_GROUP_BYTES``) in
that same turn: the idle decision and the read-back are one turn. Reading
before the turn is granted would run MLX work on the event loop while a
request may hold the engine (mutation: call ``tensors_bytes`` before
``run_when_idle`` in ``EngineTensorSource``). A turn per tensor instead of
per group cut the batch's step chain 64 times per 8B-shape entry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

import actors.ssd_writer.ports as ports
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread
from kernels.cache import tensors_bytes
from tests.actors.ssd_writer.support import IDENTITY, register

pytestmark = pytest.mark.anyio

T = TypeVar("T")


class WatchedTurns:
    """Engine turns as engine-thread jobs that record whether a turn is in progress."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine
        self.inside = False
        self.turns = 0

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """One granted turn: ``fn`` runs on the engine thread while ``inside`` is set."""
        self.turns += 1
        self.inside = True
        try:
            return await self.engine.run(fn)
        finally:
            self.inside = False


async def _spill(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[WatchedTurns, list[tuple[bool, int, int]], int, list[int], int]:
    """Plan, read every tensor in order, finish; the turns, the reads, the engine thread, sizes."""
    registry = CacheRegistry()
    tokens = (1, 2, 3, 4, 5)
    reg = await register(engine, registry, model, tokens)
    turns = WatchedTurns(engine)
    engine_thread = await engine.run(threading.get_ident)
    reads: list[tuple[bool, int, int]] = []

    def watched(plan: Any, indices: Any) -> Any:
        reads.append((turns.inside, threading.get_ident(), len(indices)))
        return tensors_bytes(plan, indices)

    monkeypatch.setattr(ports, "tensors_bytes", watched)
    source = EngineTensorSource(turns, registry, IDENTITY)
    plan = await source.plan(reg.handle, namespace="", tokens=tokens)
    sizes = [t.nbytes for t in plan.tensors]
    for i in range(len(sizes)):
        view = await source.tensor(plan, i)
        assert len(memoryview(view)) == sizes[i]
        del view
    await source.finish(plan)
    registry.dispose(reg.handle)
    return turns, reads, engine_thread, sizes, len(sizes)


async def test_every_tensor_is_read_back_inside_a_granted_turn_on_the_engine_thread(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan, the read-back and finish: every read-back happens while its turn runs, on the engine thread; a small entry's tensors in the plan's turn, finish in none."""
    turns, reads, engine_thread, sizes, n = await _spill(engine, model, monkeypatch)
    assert n >= 2
    assert sum(sizes) <= ports.VIEW_GROUP_BYTES
    # NOTE: the plan's turn takes the views too; finish takes no turn.
    assert reads == [(True, engine_thread, n)]
    assert turns.turns == 1


async def test_a_turn_takes_at_most_a_group_of_tensor_bytes(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the group bound at two tensors' bytes, each turn reads back at most two tensors, all of them in turns."""
    probe = CacheRegistry()
    reg = await register(engine, probe, model, (1, 2, 3, 4, 5))
    source = EngineTensorSource(WatchedTurns(engine), probe, IDENTITY)
    plan = await source.plan(reg.handle, namespace="", tokens=(1, 2, 3, 4, 5))
    largest = max(t.nbytes for t in plan.tensors)
    await source.finish(plan)
    probe.dispose(reg.handle)
    monkeypatch.setattr(ports, "VIEW_GROUP_BYTES", 2 * largest)
    turns, reads, engine_thread, _sizes, n = await _spill(engine, model, monkeypatch)
    assert n >= 4
    assert all(inside and thread == engine_thread for inside, thread, _ in reads)
    assert all(1 <= count <= 2 for _, _, count in reads)
    assert sum(count for _, _, count in reads) == n
    # NOTE: the first group rides the plan's turn; finish takes none.
    assert turns.turns == len(reads)


async def test_finish_takes_no_turn_and_releases_at_the_registrys_next_drain_on_the_engine_thread(
    engine: EngineThread, model: Any
) -> None:
    """A finished plan keeps its arrays until the registry's next drain (no engine turn of its
    own), and that drain, on the engine thread, drops them; so does the source's next turn."""
    registry = CacheRegistry()
    reg = await register(engine, registry, model, (1, 2, 3, 4, 5))
    turns = WatchedTurns(engine)
    source = EngineTensorSource(turns, registry, IDENTITY)
    engine_thread = await engine.run(threading.get_ident)
    for release in ("drain", "next turn"):
        plan = await source.plan(reg.handle, namespace="", tokens=(1, 2, 3, 4, 5))
        before = turns.turns
        await source.finish(plan)
        assert turns.turns == before, "finish asked for a turn"
        assert all(a is not None for a in plan._arrays), "released off the engine thread"
        if release == "drain":
            released_on = await engine.run(lambda: (registry.drain(), threading.get_ident())[1])
            assert released_on == engine_thread
        else:
            # NOTE: the source's next turn releases it first thing (a spill while idle).
            await source.finish(await source.plan(reg.handle, namespace="", tokens=(1, 2, 3, 4, 5)))
        assert all(a is None for a in plan._arrays), f"not released by the {release}"
    await engine.run(registry.drain)
    registry.dispose(reg.handle)
