"""The coordinator's shell on the real runtime: the loop alarm drives the debounce and re-arms."""

from __future__ import annotations

import random

import anyio
import pytest

from actors.durability import DurabilityConfig, DurabilityState
from actors.engine.wiring import spawn_durability
from actors.runtime import ActorSystem, Supervision
from actors.spill_queue import QueueState, SpillQueue
from messages import EntryMeta
from messages.durability import Flush, FlushResult, Schedule

from .sim import FakeGateway, FakeRegistry, FakeWriter, Faults, SimSteps, World

pytestmark = pytest.mark.anyio


async def test_write_behind_runs_on_the_clock_and_a_busy_engine_defers_it_to_the_flush() -> None:
    """A put reaches disk after the debounce with no flush; with the engine always busy the
    next put is re-armed instead, and a flush (which waits for a turn) still writes it."""
    meta = EntryMeta(offset=3, nbytes=10, trimmable=True, min_reusable_offset=0)
    async with ActorSystem() as system:
        world = World(random.Random(0), system.clock, Faults(), FakeRegistry(system.clock))
        state = DurabilityState(config=DurabilityConfig(debounce_s=0.05, busy_rearm_s=0.05))
        keep = Supervision("resume", max_restarts=10, within=1.0)
        system.spawn("gateway", lambda: FakeGateway(world), supervision=keep)
        system.spawn("ssd_writer", lambda: FakeWriter(world), supervision=keep)
        queue = QueueState()
        system.spawn("spill_queue", lambda: SpillQueue(state=queue, releaser=world.registry))
        coord = spawn_durability(system, cloner=world.registry, steps=SimSteps(world), state=state)

        committed, rearmed = anyio.Event(), anyio.Event()
        expired: list[str] = []

        def note(what: str) -> None:
            if what == "committed":
                committed.set()
            else:
                expired.append(what)
                if len(expired) >= 2:
                    rearmed.set()

        world.notify = note
        first = world.registry.put("", (1, 2, 3), meta)
        await coord.tell(Schedule(tokens=(1, 2, 3), handle=first))
        with anyio.fail_after(10):
            await committed.wait()
        assert world.disk.covers(("", (1, 2, 3)))

        world.faults.busy = 1.0
        second = world.registry.put("", (4, 5, 6), meta)
        await coord.tell(Schedule(tokens=(4, 5, 6), handle=second))
        with anyio.fail_after(10):
            await rearmed.wait()  # NOTE: two busy answers: the attempt was re-armed once.
        assert not world.disk.covers(("", (4, 5, 6)))
        result = await coord.ask(Flush(), timeout=10.0, expect=FlushResult)
        assert result.durable
        assert (result.scope, result.written, result.entries) == (1, 1, 2)
        assert world.disk.covers(("", (4, 5, 6)))
