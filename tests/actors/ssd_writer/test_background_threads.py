"""The store worker's file work runs on its own threads at the lowest CPU priority (nice 19).

Background durability work (prompt spills, generation checkpoints, their
removals) must yield the CPU to decode (docs/cold-tier.md, "Generation
checkpoints"); the rest of the tier's file work (the index's scan, a
restore) keeps the process's priority.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource, build_cold_tier
from actors.ssd_writer.background import BACKGROUND_NICE, BackgroundThreads
from kernels import CacheRegistry, EngineThread
from kernels.cache import OsFilePort
from messages import Store, StoreResult
from tests.actors.ssd_writer.support import ASK, IDENTITY, ThreadTurns, config, register

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's"),
]


def _priority() -> tuple[str, int]:
    """The calling thread's name and nice value."""
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_a_call_runs_on_a_named_thread_at_the_lowest_priority() -> None:
    """The call runs on a ``kvtier-ssd-store`` thread whose nice value is 19; the caller's own
    thread keeps its priority."""
    before = _priority()[1]
    name, nice = await BackgroundThreads().run(_priority)
    assert name.startswith("kvtier-ssd-store")
    assert nice == BACKGROUND_NICE
    assert _priority()[1] == before


async def test_a_call_s_result_and_exception_reach_the_caller() -> None:
    """Arguments travel to the call, its result comes back, its exception is raised in the caller."""
    pool = BackgroundThreads()
    assert await pool.run(int, "11", base=2) == 3
    with pytest.raises(ZeroDivisionError):
        await pool.run(divmod, 1, 0)


async def test_a_cancelled_caller_waits_until_the_call_returned() -> None:
    """A cancellation never abandons a running call (its arguments may be lent views): the
    caller goes on only after the call returned, and its next await is cancelled."""
    release = threading.Event()
    returned: list[float] = []

    def slow() -> None:
        release.wait(5)
        returned.append(time.monotonic())

    threading.Timer(0.3, release.set).start()
    after_call: list[float] = []
    with anyio.move_on_after(0.05) as scope:
        await BackgroundThreads().run(slow)
        after_call.append(time.monotonic())
        await anyio.sleep(1)
    assert scope.cancelled_caught
    assert len(returned) == 1
    assert len(after_call) == 1
    assert returned[0] <= after_call[0]


class _RecordingPort(OsFilePort):
    """The real file port; records each call's method and the calling thread's nice value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr) or name == "calls":
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            thread, nice = _priority()
            self.calls.append((name, thread, nice))
            return attr(*args, **kwargs)

        return recorded


async def test_the_store_worker_writes_at_nice_19_and_the_index_scans_at_the_process_s(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """A prompt entry stored through the real actors: every positional write and fsync ran on a
    background thread at nice 19; the index's startup scan ran at the process's priority."""
    port = _RecordingPort()
    registry = CacheRegistry()
    tokens = (1, 2, 3, 4, 5, 6)
    reg = await register(engine, registry, model, tokens)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    process_nice = _priority()[1]
    async with ActorSystem() as system:
        spawn_ssd_writer(system, config=config(tmp_path), source=source, port=port)
        stored = await system.ask("ssd_writer", Store(handle=reg.handle, tokens=tokens,
                                                      meta=reg.meta),
                                  timeout=ASK, expect=StoreResult)  # fmt: skip
        assert stored.stored, stored.reason
    writes = [(t, n) for m, t, n in port.calls if m in ("pwrite_all", "fsync")]
    scans = [n for m, _t, n in port.calls if m == "scandir"]
    assert len(writes) >= 4
    assert {n for _t, n in writes} == {BACKGROUND_NICE}
    assert all(t.startswith("kvtier-ssd-store") for t, _n in writes)
    assert scans
    assert set(scans) == {process_nice}
    registry.dispose(reg.handle)


def test_a_simulation_s_runner_runs_the_store_worker_s_work_too() -> None:
    """With an injected runner (a simulation's), the tier has no background threads of its own."""

    class Inline:
        async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    runner = Inline()
    tier = build_cold_tier(config=config(Path("/nonexistent")), io_runner=runner)
    assert tier.background is None
    assert isinstance(build_cold_tier(config=config(Path("/nonexistent"))).background,
                      BackgroundThreads)
