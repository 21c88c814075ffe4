"""RG-1: each write step's read-back runs inside its own granted engine turn, on the engine thread.

The SSD writer's tensor source asks for a turn (``run_when_idle``) and reads
the tensor back (``tensor_bytes``) in that same turn: the idle decision and
the read-back are one turn. Reading it before the turn is granted would run
MLX work on the event loop while a request may hold the engine (mutation:
call ``tensor_bytes`` before ``run_when_idle`` in ``EngineTensorSource``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

import actors.ssd_writer.ports as ports
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread
from kernels.cache import tensor_bytes
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


async def test_every_tensor_is_read_back_inside_a_granted_turn_on_the_engine_thread(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan, each tensor read-back and finish: every read-back happens while its turn runs, on
    the engine thread, one turn per tensor."""
    registry = CacheRegistry()
    tokens = (1, 2, 3, 4, 5)
    reg = await register(engine, registry, model, tokens)
    turns = WatchedTurns(engine)
    engine_thread = await engine.run(threading.get_ident)
    reads: list[tuple[bool, int]] = []

    def watched(plan: Any, index: int) -> Any:
        reads.append((turns.inside, threading.get_ident()))
        return tensor_bytes(plan, index)

    monkeypatch.setattr(ports, "tensor_bytes", watched)
    source = EngineTensorSource(turns, registry, IDENTITY)
    plan = await source.plan(reg.handle, namespace="", tokens=tokens)
    n = len(plan.tensors)
    for i in range(n):
        view = await source.tensor(plan, i)
        assert len(memoryview(view)) == plan.tensors[i].nbytes
        del view
    await source.finish(plan)
    registry.dispose(reg.handle)
    assert n >= 2
    assert reads == [(True, engine_thread)] * n
    assert turns.turns == n + 2
