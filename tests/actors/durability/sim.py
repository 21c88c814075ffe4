"""The durability protocol in the simulated runtime: scripted fakes, seeded faults, checks.

One run (:func:`flush_protocol`) spawns the real ``DurabilityCoordinator``
and the real ``SpillQueue`` between scripted fakes:

- the scenario itself plays the prompt cache: it puts entries (RAM handles
  in :class:`FakeRegistry`), replaces and supersedes them, evicts them
  (disposed, or spilled through the queue) and tells the coordinator
  ``Schedule`` for every put;
- :class:`FakeGateway` grants ``RunWhenIdle`` turns (running the registered
  clone step), or answers ``expired`` when "busy", sometimes late, and
  sometimes reports a turn failed after the step ran;
- :class:`FakeWriter` answers ``Covers`` / ``SsdStatsRequest`` from
  :class:`FakeDisk` and ``Store`` after a seeded delay, failing it
  (``fsync_failed``, ``io_error``, ``disk_full``), crashing (its handler
  raises), or evicting another file for room.

Time moves only when the scenario moves it (and by the runtime's tick per
delivery); the coordinator's alarm is a :class:`SimAlarm` the scenario fires.

Checks (``World.check_*``): ``durable`` implies every prefix dirty at the
flush's start is covered on disk when it answers, or was evicted unwritten
(RAM let go of its latest put, and the coordinator counted it); no dirty
record is ever lost (a record leaves the coordinator only when its prefix
was on disk at some time after its latest put, or as evicted unwritten);
no record version is snapshotted twice in one flush; no clone leaks or is
disposed twice; and with faults off, a final flush writes everything RAM
still holds and is durable exactly when nothing it verified is uncovered.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.durability import DurabilityConfig, DurabilityState
from actors.engine.wiring import spawn_durability
from actors.runtime import (
    Actor,
    Clock,
    Context,
    ManualClock,
    SimulatedSystem,
    Supervision,
)
from actors.spill_queue import QueueState, SpillQueue
from messages import (
    Covers,
    CoversResult,
    Enqueue,
    EntryMeta,
    Envelope,
    SsdStatsRequest,
    Store,
    StoreResult,
)
from messages.durability import (
    DurabilityStats,
    DurabilityStatsRequest,
    Flush,
    FlushResult,
    Schedule,
    Wake,
)
from messages.gateway import RunWhenIdle, TurnDone

from .support import ssd_stats

Key = tuple[str, tuple[int, ...]]


# --- the RAM side ---------------------------------------------------------------


@dataclass
class _Entry:
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta
    root: str
    """The RAM handle a clone was made from (itself for a RAM handle)."""


class FakeRegistry:
    """RAM handles and their clones (the coordinator's Cloner, the queue's releaser)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.live: dict[str, _Entry] = {}
        self.cached: set[str] = set()
        """RAM handles the (scripted) prompt cache still owns: not disposed, not spilled."""
        self.clones: list[tuple[float, str]] = []
        self.double_disposals = 0
        self._ids = itertools.count(1)

    def put(self, namespace: str, tokens: tuple[int, ...], meta: EntryMeta) -> str:
        """Register a RAM entry; its handle."""
        handle = f"ram-{next(self._ids)}"
        self.live[handle] = _Entry(namespace, tokens, meta, handle)
        self.cached.add(handle)
        return handle

    def clone(self, handle: str) -> tuple[str, EntryMeta] | None:
        """Cloner.clone: a new handle onto the same entry, or None when it is gone."""
        entry = self.live.get(handle)
        if entry is None:
            return None
        clone = f"clone-{next(self._ids)}"
        self.live[clone] = _Entry(entry.namespace, entry.tokens, entry.meta, entry.root)
        self.clones.append((self.clock.now(), entry.root))
        return clone, entry.meta

    def dispose(self, handle: str) -> None:
        """Cloner.dispose / HandleReleaser.dispose: forget the handle (KeyError if unknown)."""
        if self.live.pop(handle, None) is None:
            self.double_disposals += 1
            raise KeyError(handle)

    def ram_handles(self) -> list[str]:
        """Handles the prompt cache owns, in creation order."""
        return [h for h in self.live if h in self.cached]

    def give_up(self, handle: str) -> None:
        """The prompt cache lets go of ``handle`` (disposed, or spilled to the queue)."""
        self.cached.remove(handle)


# --- the disk -------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    trimmable: bool
    min_reusable: int


def _covers(files: dict[Key, _File], key: Key) -> bool:
    """The SSD index's rule: the exact tokens, or a trimmable descendant that may be cut to them."""
    if key in files:
        return True
    ns, tokens = key
    n = len(tokens)
    return any(
        fns == ns and len(ft) > n and f.trimmable and f.min_reusable <= n and ft[:n] == tokens
        for (fns, ft), f in files.items()
    )


class FakeDisk:
    """Committed files and the history of every change (to ask "covered at time t?")."""

    def __init__(self) -> None:
        self.files: dict[Key, _File] = {}
        self.history: list[tuple[float, str, Key, _File | None]] = []

    def commit(self, key: Key, file: _File, now: float) -> None:
        """A new file: replaces its duplicate, supersedes the ancestors it serves (as the index)."""
        if file.trimmable:
            ns, tokens = key
            for other in [k for k in self.files if k[0] == ns and len(k[1]) < len(tokens)]:
                if tokens[: len(other[1])] == other[1] and file.min_reusable <= len(other[1]):
                    self.remove(other, now)
        self.files[key] = file
        self.history.append((now, "add", key, file))

    def remove(self, key: Key, now: float) -> None:
        """A file leaves the index (superseded or evicted)."""
        del self.files[key]
        self.history.append((now, "remove", key, None))

    def covers(self, key: Key) -> bool:
        """Whether the index covers ``key`` now."""
        return _covers(self.files, key)

    def covered_between(self, key: Key, start: float, end: float) -> bool:
        """Whether ``key`` was covered at some time in [start, end].

        The state at time t is the one after every change made at or before t.
        """
        files: dict[Key, _File] = {}
        seen_start = False
        for at, group in itertools.groupby(self.history, key=lambda change: change[0]):
            if at > start and not seen_start:
                seen_start = True
                if _covers(files, key):  # NOTE: the state at ``start``.
                    return True
            if at > end:
                return False
            for _, op, k, f in group:
                if op == "add":
                    assert f is not None
                    files[k] = f
                else:
                    files.pop(k, None)
            if at >= start:
                seen_start = True
                if _covers(files, key):
                    return True
        return not seen_start and _covers(files, key)

    def covered_at(self, key: Key, at: float) -> bool:
        """Whether ``key`` was covered at time ``at``."""
        return self.covered_between(key, at, at)


# --- faults ---------------------------------------------------------------------


@dataclass
class Faults:
    """Per-run fault probabilities (all zero once ``off()``)."""

    store_fail: float = 0.0
    crash: float = 0.0
    slow: float = 0.0
    evict: float = 0.0
    busy: float = 0.0
    burst: float = 0.0
    """A burst of other spills reaches the queue as a store ends (items waiting get dropped)."""
    late_turn: float = 0.0
    turn_failed: float = 0.0

    def off(self) -> None:
        """No more faults."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0.0)


@dataclass
class World:
    """Everything a run shares: the fakes' state, the fault dice, the script's log."""

    rng: random.Random
    clock: Clock
    faults: Faults
    registry: FakeRegistry
    disk: FakeDisk = field(default_factory=FakeDisk)
    steps: dict[str, Callable[[], Any]] = field(default_factory=dict)
    scheduled: dict[Key, float] = field(default_factory=dict)
    handles: dict[Key, str] = field(default_factory=dict)
    """The RAM handle of each key's latest put."""
    results: list[FlushResult] = field(default_factory=list)
    state: DurabilityState | None = None
    covers_log: list[tuple[float, Key, bool]] = field(default_factory=list)
    """Every Covers the writer answered: (time, key, covered)."""
    spilling: int = 0
    """Evictions the Spiller still holds."""
    notify: Callable[[str], None] | None = None
    """Told "committed" / "expired" when the writer commits / the gateway answers busy."""

    def note(self, what: str) -> None:
        """Tell ``notify`` (real-runtime tests wait on it)."""
        if self.notify is not None:
            self.notify(what)

    def roll(self, p: float) -> bool:
        """True with probability ``p`` (the run's seeded dice)."""
        return p > 0 and self.rng.random() < p

    # -- checks ---------------------------------------------------------------

    def evicted(self, key: Key) -> bool:
        """Whether RAM let go of ``key``'s latest put (evicted, superseded or disposed)."""
        return self.handles[key] not in self.registry.cached

    def check_nothing_lost(self, now: float) -> None:
        """Every key ever put is still dirty, or was on disk at some time after its latest put,
        or was given up as evicted unwritten: RAM let go of it, and the count covers it."""
        assert self.state is not None
        unwritten = 0
        for key, at in self.scheduled.items():
            if key in self.state.records or self.disk.covered_between(key, at, now):
                continue
            assert self.evicted(key), f"dirty record lost: {key}"
            unwritten += 1
        assert unwritten <= self.state.evicted_unwritten, "evicted unwritten, but not counted"

    def check_flush(self, result: FlushResult, scheduled_before: dict[Key, float]) -> None:
        """``durable`` => every prefix dirty at the flush's start was on disk when the flush
        last looked (after its writes); and no version was snapshotted twice during the flush.

        NOTE: "when it last looked": other producers' writes may evict a file
        (the tier's cap) at any moment, even right after the check; the
        disk's history must agree with that last answer.
        """
        if result.durable:
            start, end = result.started_at, result.finished_at
            for key, at in scheduled_before.items():
                if self.disk.covered_between(key, at, start):
                    continue  # NOTE: already on disk after its latest put: not dirty.
                answers = [(t, c) for t, k, c in self.covers_log if k == key and start <= t <= end]
                if not answers and self.evicted(key):
                    # NOTE: given up as evicted unwritten before this flush began
                    # (check_nothing_lost holds it to the count).
                    continue
                assert answers, f"durable, but {key} was never checked"
                last_at, last = answers[-1]
                if not last:
                    # NOTE: allowed only as evicted unwritten: RAM let go of it
                    # and the flush forgot it (and counted it).
                    assert self.evicted(key), f"durable, but {key} was not on disk"
                    assert self.state is not None
                    assert key not in self.state.records or (
                        self.state.records[key].scheduled_at > at
                    ), f"durable, but {key} is still dirty"
                    assert result.evicted_unwritten > 0, f"{key} evicted, but not reported"
                    continue
                assert self.disk.covered_at(key, last_at), f"durable, but {key} is not on disk"
        window = [
            root
            for at, root in self.registry.clones
            if result.started_at <= at <= result.finished_at
        ]
        assert len(window) == len(set(window)), "a record version was written twice in one flush"


class SimAlarm:
    """The coordinator's alarm in a simulated run: the scenario fires it."""

    def __init__(self) -> None:
        self.at: float | None = None
        self._wake: Callable[[], None] | None = None

    def set(self, at: float | None, wake: Callable[[], None]) -> None:
        """Alarm.set."""
        self.at, self._wake = at, wake

    def fire(self) -> None:
        """The alarm goes off (the coordinator gets a Wake)."""
        wake, self.at, self._wake = self._wake, None, None
        if wake is not None:
            wake()


class SimSteps:
    """StepRegistry shared by the coordinator (add/discard) and the fake gateway (take)."""

    def __init__(self, world: World) -> None:
        self._steps = world.steps

    def add(self, step_id: str, fn: Callable[[], Any]) -> object:
        """StepRegistry.add."""
        self._steps[step_id] = fn
        return None

    def discard(self, step_id: str) -> None:
        """StepRegistry.discard."""
        self._steps.pop(step_id, None)


# --- the fake actors --------------------------------------------------------------


class Delays:
    """Items an actor holds for a number of its own steps (one ``Wake`` to itself per step).

    NOTE: ``durability.wake`` is reused as the fakes' step message (a body
    every run can trace and replay); at most one is in flight per actor.
    """

    def __init__(self) -> None:
        self.items: list[list[Any]] = []

    async def hold(self, item: Any, steps: int, ctx: Context) -> None:
        """Release ``item`` after ``steps`` (>= 1) steps."""
        self.items.append([item, steps])
        if len(self.items) == 1:
            await ctx.tell(ctx.name, Wake())

    async def step(self, ctx: Context) -> list[Any]:
        """One step passed: the items released now, in the order they were held."""
        for entry in self.items:
            entry[1] -= 1
        ready = [item for item, left in self.items if left <= 0]
        self.items = [e for e in self.items if e[1] > 0]
        if self.items:
            await ctx.tell(ctx.name, Wake())
        return ready


class FakeGateway(Actor):
    """Grants background turns (running the step), or answers ``expired`` when busy."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.delays = Delays()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        w = self.world
        if isinstance(body, RunWhenIdle):
            if w.roll(w.faults.late_turn):
                await self.delays.hold(envelope, w.rng.randrange(1, 8), ctx)
                return
            await self._answer(envelope, ctx)
        elif isinstance(body, Wake):
            for request in await self.delays.step(ctx):
                await self._answer(request, ctx)

    async def _answer(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        w = self.world
        if body.deadline is not None and w.roll(w.faults.busy):
            w.steps.pop(body.step_id, None)
            done = TurnDone(step_id=body.step_id, ok=False, error_code="expired")
            w.note("expired")
        else:
            fn = w.steps.pop(body.step_id, None)
            if fn is None:
                done = TurnDone(step_id=body.step_id, ok=False, error_code="unknown_step")
            else:
                fn()
                failed = w.roll(w.faults.turn_failed)
                done = TurnDone(
                    step_id=body.step_id, ok=not failed, error_code="turn_failed" if failed else ""
                )
        await ctx.reply(envelope, done)


class FakeWriter(Actor):
    """The SSD index and store worker in one: Covers/SsdStats at once, Store after a delay."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.delays = Delays()
        self._ids = itertools.count()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        w = self.world
        if w.roll(w.faults.crash) and not isinstance(body, Wake):
            raise RuntimeError("the writer crashed")
        if isinstance(body, Covers):
            if w.roll(w.faults.burst):
                await self._ghosts(1, ctx, "ghost-lead")
            key = (body.namespace, body.tokens)
            covered = w.disk.covers(key)
            w.covers_log.append((ctx.clock.now(), key, covered))
            await ctx.reply(envelope, CoversResult(covered=covered))
        elif isinstance(body, SsdStatsRequest):
            longest = max((len(k[1]) for k in w.disk.files), default=0)
            await ctx.reply(envelope, ssd_stats(len(w.disk.files), longest))
        elif isinstance(body, Store):
            # NOTE: every write takes a few steps (a queue behind it fills up); slow ones many.
            steps = w.rng.randrange(0, 4) + (w.rng.randrange(1, 16) if w.roll(w.faults.slow) else 0)
            if steps:
                await self.delays.hold(envelope, steps, ctx)
                return
            await self._store(envelope, ctx)
        elif isinstance(body, Wake):
            for request in await self.delays.step(ctx):
                await self._store(request, ctx)

    async def _ghosts(self, n: int, ctx: Context, namespace: str = "ghost") -> None:
        """Other producers' spills (never scheduled): they fill the queue and push items out.

        NOTE: a "ghost" store never bursts again (no chain reaction); a
        "ghost-lead" one may, so a snapshot queued behind it can be pushed out.
        """
        w = self.world
        for _ in range(n):
            ghost = (namespace, (next(self._ids),))
            meta = EntryMeta(offset=1, nbytes=100, trimmable=True, min_reusable_offset=0)
            handle = w.registry.put(*ghost, meta)
            w.registry.give_up(handle)
            spill = Enqueue(handle=handle, namespace=ghost[0], tokens=ghost[1], meta=meta)
            await ctx.tell("spill_queue", spill)

    async def _store(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, Store)
        w = self.world
        now = ctx.clock.now()
        if body.namespace != "ghost" and w.roll(w.faults.burst):
            await self._ghosts(2, ctx)
        if w.roll(w.faults.store_fail):
            reason = w.rng.choice(("fsync_failed", "io_error", "disk_full"))
            await ctx.reply(envelope, StoreResult(handle=body.handle, stored=False, reason=reason))
            return
        key = (body.namespace, body.tokens)
        others = [k for k in w.disk.files if k != key]
        if others and w.roll(w.faults.evict):
            w.disk.remove(w.rng.choice(others), now)
        meta = body.meta
        w.disk.commit(key, _File(meta.trimmable, meta.min_reusable_offset), now)
        w.note("committed")
        await ctx.reply(envelope, StoreResult(handle=body.handle, stored=True))


class Spiller(Actor):
    """Evictions on their way to the spill queue: each arrives there after a seeded delay.

    NOTE: spills landing while a snapshot waits in the queue behind a slow
    store are what the queue's cap drops (the oldest queued item first).
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.delays = Delays()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Enqueue):
            self.world.spilling += 1
            await self.delays.hold(body, self.world.rng.randrange(1, 12), ctx)
        elif isinstance(body, Wake):
            for spill in await self.delays.step(ctx):
                self.world.spilling -= 1
                await ctx.tell("spill_queue", spill)


# --- the scenario -----------------------------------------------------------------


def _faults(rng: random.Random) -> Faults:
    level = rng.choice((0.0, 0.1, 0.25, 0.5))
    return Faults(
        store_fail=level * rng.random(),
        crash=level * rng.random() * 0.3,
        slow=level * rng.random() * 2,
        evict=level * rng.random() * 0.5,
        busy=level * rng.random() * 2,
        burst=rng.choice((0.0, 0.6)) * rng.random(),
        late_turn=level * rng.random(),
        turn_failed=level * rng.random() * 0.3,
    )


async def flush_protocol(
    system: SimulatedSystem, *, seed: int, actions: int = 8, sink: list[World] | None = None
) -> None:
    """One seeded run: puts, evictions, time passing and flushes under faults, then a final flush."""
    rng = random.Random(seed)
    clock = system.clock
    assert isinstance(clock, ManualClock)
    world = World(rng, clock, _faults(rng), FakeRegistry(clock))
    if sink is not None:
        sink.append(world)
    config = DurabilityConfig(
        max_attempts=rng.choice((1, 2, 3)),
        reply_timeout_s=rng.choice((2.0, 6.0, 30.0)),
        max_records=10_000,
    )
    world.state = DurabilityState(config=config)
    alarm = SimAlarm()
    forever = Supervision("resume", max_restarts=1_000_000, within=1.0)
    system.spawn("gateway", lambda: FakeGateway(world), capacity=256, supervision=forever)
    system.spawn("ssd_writer", lambda: FakeWriter(world), capacity=256, supervision=forever)
    system.spawn("spiller", lambda: Spiller(world), capacity=256)
    queue = QueueState(cap_bytes=rng.choice((0, 0, 150, 10_000)))
    system.spawn("spill_queue", lambda: SpillQueue(state=queue, releaser=world.registry))
    coord = spawn_durability(
        system, cloner=world.registry, steps=SimSteps(world), alarm=alarm, state=world.state
    )
    conversations: list[Key] = []
    counter = itertools.count(100)

    async def put(key: Key, trimmable: bool) -> None:
        ns, tokens = key
        n = len(tokens)
        meta = EntryMeta(
            offset=n,
            nbytes=rng.randrange(50, 200),
            trimmable=trimmable,
            min_reusable_offset=rng.randrange(0, n + 1) if trimmable else n,
        )
        for handle in world.registry.ram_handles():
            entry = world.registry.live[handle]
            same = (entry.namespace, entry.tokens) == key
            # NOTE: the prompt cache's Put: a duplicate is replaced, ancestors a
            # trimmable descendant serves are superseded (both disposed).
            ancestor = (
                trimmable
                and entry.namespace == ns
                and len(entry.tokens) < n
                and tokens[: len(entry.tokens)] == entry.tokens
                and meta.min_reusable_offset <= len(entry.tokens)
            )
            if same or ancestor:
                world.registry.give_up(handle)
                world.registry.dispose(handle)
        handle = world.registry.put(ns, tokens, meta)
        world.scheduled[key] = clock.now()
        world.handles[key] = handle
        await coord.tell(Schedule(namespace=ns, tokens=tokens, handle=handle))
        conversations.append(key)

    async def flush() -> None:
        before = dict(world.scheduled)
        result = await coord.ask(Flush(), timeout=60.0, expect=FlushResult)
        world.results.append(result)
        world.check_flush(result, before)
        world.check_nothing_lost(clock.now())

    for _ in range(actions):
        action = rng.choices(("put", "evict", "time", "flush"), (40, 20, 25, 15))[0]
        if action == "put":
            ns = rng.choice(("", "b"))
            trimmable = ns == ""
            extend = [k for k in conversations if k[0] == ns]
            if extend and rng.random() < 0.6:
                base = rng.choice(extend)
                grow = rng.choice((0, 1, 2))  # NOTE: 0 re-puts the same tokens.
                key = (ns, base[1] + tuple(rng.randrange(8) for _ in range(grow)))
            else:
                key = (ns, (next(counter), *(rng.randrange(8) for _ in range(rng.randrange(1, 3)))))
            await put(key, trimmable)
        elif action == "evict":
            # NOTE: up to three at once: spills arriving together are what the
            # queue's cap drops (the oldest queued item first).
            handles = world.registry.ram_handles()
            for handle in rng.sample(handles, min(len(handles), rng.randrange(1, 4))):
                entry = world.registry.live[handle]
                world.registry.give_up(handle)
                if rng.random() < 0.4:
                    world.registry.dispose(handle)
                    continue
                await system.tell(
                    "spiller",
                    Enqueue(
                        handle=handle,
                        namespace=entry.namespace,
                        tokens=entry.tokens,
                        meta=entry.meta,
                        source="evict",
                    ),
                )
        elif action == "time":
            step = rng.choice((0.3, 1.1, 5.5))
            if alarm.at is not None and rng.random() < 0.7:
                step = max(alarm.at - clock.now(), 0.0)
            clock.advance(step)
            if alarm.at is not None and alarm.at <= clock.now():
                alarm.fire()
        else:
            await flush()
        if rng.random() < 0.6:
            # NOTE: else the next action comes at the same instant, racing what this one started.
            await coord.ask(DurabilityStatsRequest(), timeout=60.0, expect=DurabilityStats)
    # NOTE: the coordinator's mailbox is FIFO: once this is answered it has every Schedule.
    await coord.ask(DurabilityStatsRequest(), timeout=60.0, expect=DurabilityStats)
    world.check_nothing_lost(clock.now())

    # NOTE: faults off and no eviction left on its way, then one more flush:
    # everything RAM holds must reach disk.
    world.faults.off()
    while world.spilling:
        await coord.ask(DurabilityStatsRequest(), timeout=60.0, expect=DurabilityStats)
    await flush()
    final = world.results[-1]
    assert (final.pending, final.dropped, final.failed, final.lost) == (0, 0, 0, 0), final
    assert final.durable == (final.uncovered == 0), final
    for key, rec in world.state.records.items():
        # NOTE: what is left dirty is gone from RAM and not on disk: nothing could write it.
        assert rec.missing, key
        assert rec.handle not in world.registry.live, key
        assert not world.disk.covers(key), key
