"""The spill queue shell on the real runtime, with a scripted writer actor."""

from __future__ import annotations

import anyio
import pytest

from actors.engine.wiring import _spill_queue_factory, spawn_spill_queue
from actors.runtime import Actor, ActorSystem, Context
from actors.spill_queue import core as spill_core
from messages import (
    DrainSpills,
    Enqueue,
    EntryMeta,
    Envelope,
    SpillQueueStats,
    SpillQueueStatsRequest,
    SpillsDrained,
    SpillSettled,
    Store,
    StoreResult,
)
from messages.gateway import RunWhenIdle, TurnDone

pytestmark = pytest.mark.anyio
ASK = 5.0


class RecordingReleaser:
    """Records every disposed handle (the registry's role)."""

    def __init__(self) -> None:
        self.disposed: list[str] = []

    def dispose(self, handle: str) -> None:
        """Record ``handle``."""
        self.disposed.append(handle)


class GatedWriter(Actor):
    """Answers each Store only when the test opens its gate; can raise for one handle."""

    def __init__(self, gate: anyio.Event, seen: list[str], fail: str = "") -> None:
        self.gate = gate
        self.seen = seen
        self.fail = fail

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Wait for the gate, then store (or raise for ``fail``)."""
        body = envelope.body
        assert isinstance(body, Store)
        self.seen.append(body.handle)
        await self.gate.wait()
        if body.handle == self.fail:
            raise RuntimeError("writer broke")
        await ctx.reply(envelope, StoreResult(handle=body.handle, stored=True))


def item(handle: str, nbytes: int, reply_to: str = "") -> Enqueue:
    """An Enqueue of 3 tokens pinning ``nbytes``."""
    meta = EntryMeta(offset=3, nbytes=nbytes, trimmable=True, min_reusable_offset=0)
    return Enqueue(handle=handle, tokens=(1, 2, 3), meta=meta, reply_to=reply_to)


async def test_queue_drops_over_cap_while_the_writer_is_busy_then_drains() -> None:
    """A busy writer does not block intake; over the cap the oldest queued item is released."""
    releaser = RecordingReleaser()
    gate = anyio.Event()
    seen: list[str] = []
    async with ActorSystem() as system:
        system.spawn("ssd_writer", lambda: GatedWriter(gate, seen))
        queue = spawn_spill_queue(system, releaser=releaser, cap_bytes=100)
        for h, n in (("a", 60), ("b", 30), ("c", 30)):
            await queue.tell(item(h, n))
        stats = await queue.ask(SpillQueueStatsRequest(), timeout=ASK, expect=SpillQueueStats)
        assert (stats.pending, stats.dropped) == (2, 1)
        assert releaser.disposed == ["b"]
        gate.set()
        drained = await queue.ask(DrainSpills(), timeout=ASK, expect=SpillsDrained)
        assert (drained.stored, drained.dropped) == (2, 1)
        assert seen == ["a", "c"]
        assert sorted(releaser.disposed) == ["a", "b", "c"]


async def test_a_failing_writer_fails_the_item_and_the_producer_hears_it() -> None:
    """The writer's handler raising settles the item as failed, released, and notified."""
    releaser = RecordingReleaser()
    gate = anyio.Event()
    gate.set()
    async with ActorSystem() as system:
        system.spawn("ssd_writer", lambda: GatedWriter(gate, [], fail="x"))
        queue = spawn_spill_queue(system, releaser=releaser)
        async with system.open_inbox() as inbox:
            await queue.tell(item("x", 1, reply_to=inbox.address))
            envelope = await inbox.receive(timeout=ASK)
        assert isinstance(envelope.body, SpillSettled)
        assert (envelope.body.outcome, envelope.body.reason) == ("failed", "writer_failed")
        assert releaser.disposed == ["x"]


async def test_no_writer_fails_items_instead_of_holding_them() -> None:
    """Without a writer actor every item fails at once and its handle is released."""
    releaser = RecordingReleaser()
    async with ActorSystem() as system:
        queue = spawn_spill_queue(system, releaser=releaser)
        await queue.tell(item("a", 1))
        await queue.tell(item("b", 1))
        drained = await queue.ask(DrainSpills(), timeout=ASK, expect=SpillsDrained)
        assert drained.failed == 2
        assert releaser.disposed == ["a", "b"]


class SilentWriter(Actor):
    """Takes every Store and never answers (a store still in flight)."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Ignore the Store."""


async def test_stopping_the_system_releases_what_the_queue_still_owns() -> None:
    """Queued and in-flight handles are released when the queue stops."""
    releaser = RecordingReleaser()
    async with ActorSystem(stop_timeout=2.0) as system:
        system.spawn("ssd_writer", SilentWriter)
        queue = spawn_spill_queue(system, releaser=releaser)
        await queue.tell(item("a", 1))
        await queue.tell(item("b", 1))
        await queue.ask(SpillQueueStatsRequest(), timeout=ASK, expect=SpillQueueStats)
        await system.stop(order=["spill_queue"])
    assert sorted(releaser.disposed) == ["a", "b"]


class RecordingGateway(Actor):
    """A scripted gateway: records each RunWhenIdle and answers that it ran."""

    def __init__(self, asked: list[RunWhenIdle], got: anyio.Event) -> None:
        self.asked = asked
        self.got = got

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Record the ask, answer TurnDone."""
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        self.asked.append(body)
        self.got.set()
        await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=True))


async def test_the_drain_after_a_release_is_asked_for_idle_only() -> None:
    """A stored item's release asks the gateway for the drain turn, idle only (every turn drains as it ends)."""
    releaser = RecordingReleaser()
    gate = anyio.Event()
    gate.set()
    asked: list[RunWhenIdle] = []
    got = anyio.Event()
    state = spill_core.QueueState(cap_bytes=100, drain_step="prompt_cache.drain")
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: RecordingGateway(asked, got))
        system.spawn("ssd_writer", lambda: GatedWriter(gate, []))
        queue = system.spawn("spill_queue",
                             _spill_queue_factory(state, releaser, "ssd_writer", "gateway"))
        await queue.tell(item("a", 10))
        drained = await queue.ask(DrainSpills(), timeout=ASK, expect=SpillsDrained)
        assert drained.stored == 1
        with anyio.fail_after(ASK):
            await got.wait()
    assert releaser.disposed == ["a"]
    assert [a.step_id for a in asked] == ["prompt_cache.drain"]
    assert all(a.idle_only for a in asked)
