"""The spill queue's rules (sans-IO core), by plain calls and a Hypothesis state machine."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actors.spill_queue import core
from messages import (
    Body,
    DrainSpills,
    Enqueue,
    EntryMeta,
    Envelope,
    Failure,
    SpillQueueStats,
    SpillQueueStatsRequest,
    SpillsDrained,
    SpillSettled,
    SpillSource,
    StoreResult,
)

_ids = itertools.count()


def env(body: Body, correlation: str = "c") -> Envelope:
    """An envelope around ``body`` as the runtime would deliver it to the queue."""
    return Envelope(f"m-{next(_ids)}", correlation, None, "producer", "spill_queue", 0.0, body)


def enqueue(
    handle: str, nbytes: int, *, ntok: int = 3, reply: bool = False, source: SpillSource = "evict"
) -> Enqueue:
    """An Enqueue of ``ntok`` tokens pinning ``nbytes``."""
    meta = EntryMeta(offset=ntok, nbytes=nbytes, trimmable=True, min_reusable_offset=0)
    return Enqueue(
        handle=handle,
        tokens=tuple(range(ntok)),
        meta=meta,
        source=source,
        reply_to="slot" if reply else "",
    )


def released(effects: list[core.Effect]) -> list[str]:
    """Handles the effects release, in order."""
    return [e.handle for e in effects if isinstance(e, core.ReleaseHandle)]


def sent(effects: list[core.Effect]) -> list[str]:
    """Handles the effects hand to the writer, in order."""
    return [e.item.handle for e in effects if isinstance(e, core.SendStore)]


def answers(effects: list[core.Effect]) -> list[Body]:
    """Bodies the effects reply."""
    return [e.body for e in effects if isinstance(e, core.Answer)]


def test_first_item_goes_to_the_writer_at_once_and_is_released_after_its_result() -> None:
    """An idle queue sends the item; the writer's answer releases its handle and counts it."""
    state = core.QueueState(cap_bytes=100)
    state, fx = core.handle(state, env(enqueue("a", 10)))
    assert sent(fx) == ["a"]
    assert released(fx) == []
    state, fx = core.handle(state, env(StoreResult(handle="a", stored=True)))
    assert released(fx) == ["a"]
    s = core.stats(state)
    assert (s.pending, s.pending_bytes, s.stored, s.failed) == (0, 0, 1, 0)


def test_items_are_stored_one_at_a_time_in_arrival_order() -> None:
    """The next item starts only when the in-flight one settles, oldest first."""
    state = core.QueueState(cap_bytes=1000)
    _, fx = core.handle(state, env(enqueue("a", 10)))
    assert sent(fx) == ["a"]
    for h in ("b", "c"):
        _, fx = core.handle(state, env(enqueue(h, 10)))
        assert sent(fx) == []
    _, fx = core.handle(state, env(StoreResult(handle="a", stored=False, reason="disk_full")))
    assert sent(fx) == ["b"]
    _, fx = core.handle(state, env(StoreResult(handle="b", stored=True)))
    assert sent(fx) == ["c"]
    assert core.stats(state).failed == 1


def test_over_the_cap_the_oldest_queued_item_is_dropped_and_released_at_once() -> None:
    """The oldest not-in-flight item goes; the in-flight one and the newest stay."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("flying", 50)))
    core.handle(state, env(enqueue("old", 30)))
    _, fx = core.handle(state, env(enqueue("new", 40)))
    assert released(fx) == ["old"]
    assert [i.handle for i in state.queued] == ["new"]
    assert state.in_flight is not None
    assert state.in_flight.handle == "flying"
    s = core.stats(state)
    assert (s.dropped, s.dropped_bytes, s.pending, s.pending_bytes) == (1, 30, 2, 90)


def test_the_item_just_enqueued_is_never_its_own_victim() -> None:
    """An item larger than the cap is kept (soft cap) when it is the only queued one."""
    state = core.QueueState(cap_bytes=10)
    core.handle(state, env(enqueue("flying", 5)))
    _, fx = core.handle(state, env(enqueue("huge", 500)))
    assert released(fx) == []
    assert [i.handle for i in state.queued] == ["huge"]


def test_cap_zero_keeps_only_the_newest_and_the_in_flight_item() -> None:
    """With cap 0 every enqueue drops all older queued items."""
    state = core.QueueState(cap_bytes=0)
    core.handle(state, env(enqueue("flying", 5)))
    core.handle(state, env(enqueue("a", 5)))
    _, fx = core.handle(state, env(enqueue("b", 5)))
    assert released(fx) == ["a"]
    _, fx = core.handle(state, env(enqueue("c", 5)))
    assert released(fx) == ["b"]
    assert [i.handle for i in state.queued] == ["c"]
    _, fx = core.handle(state, env(StoreResult(handle="flying", stored=True)))
    assert sent(fx) == ["c"]


def test_settled_notice_goes_to_a_producer_that_asked_on_every_path() -> None:
    """Stored, failed and dropped items each answer their Enqueue with the outcome."""
    state = core.QueueState(cap_bytes=10)
    e1, e2, e3 = (
        env(enqueue("a", 5, reply=True, source="snapshot")),
        env(enqueue("b", 8, reply=True)),
        env(enqueue("c", 8, reply=True)),
    )
    core.handle(state, e1)
    core.handle(state, e2)
    _, fx = core.handle(state, e3)  # drops b
    (dropped,) = [e for e in fx if isinstance(e, core.Answer)]
    assert dropped.request is e2
    assert isinstance(dropped.body, SpillSettled)
    assert (dropped.body.outcome, dropped.body.reason) == ("dropped", "over_cap")
    _, fx = core.handle(state, env(StoreResult(handle="a", stored=True)))
    (stored,) = [e for e in fx if isinstance(e, core.Answer)]
    assert stored.request is e1
    assert isinstance(stored.body, SpillSettled)
    assert (stored.body.outcome, stored.body.source) == ("stored", "snapshot")
    _, fx = core.handle(state, env(StoreResult(handle="c", stored=False, reason="too_large")))
    (failed,) = [e for e in fx if isinstance(e, core.Answer)]
    assert failed.request is e3
    assert isinstance(failed.body, SpillSettled)
    assert (failed.body.outcome, failed.body.reason) == ("failed", "too_large")


def test_a_stale_store_result_does_not_settle_the_next_item() -> None:
    """A result naming another handle than the in-flight one is ignored."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("a", 5)))
    _, fx = core.handle(state, env(StoreResult(handle="zzz", stored=True)))
    assert fx == []
    assert state.in_flight is not None
    assert state.in_flight.handle == "a"


def test_a_runtime_failure_reply_fails_the_in_flight_item() -> None:
    """The writer's handler raising (a Failure at the queue) releases and counts the item."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("a", 5)))
    core.handle(state, env(enqueue("b", 5)))
    _, fx = core.handle(state, env(Failure(error="RuntimeError", actor="ssd_writer")))
    assert released(fx) == ["a"]
    assert sent(fx) == ["b"]
    assert core.stats(state).failed == 1


def test_writer_unavailable_fails_the_item_and_moves_on() -> None:
    """A Store that cannot be delivered settles as failed and the next item is tried."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("a", 5)))
    core.handle(state, env(enqueue("b", 5)))
    _, fx = core.handle(state, core.StoreUnavailable("a", "writer_unavailable"))
    assert released(fx) == ["a"]
    assert sent(fx) == ["b"]


def test_drain_waits_until_nothing_is_queued_or_in_flight() -> None:
    """DrainSpills is answered at once when idle, else when the last item settles."""
    state = core.QueueState(cap_bytes=100)
    _, fx = core.handle(state, env(DrainSpills(reply_to="w0")))
    assert [type(b) for b in answers(fx)] == [SpillsDrained]
    core.handle(state, env(enqueue("a", 5)))
    core.handle(state, env(enqueue("b", 5)))
    waiter = env(DrainSpills(reply_to="w1"))
    _, fx = core.handle(state, waiter)
    assert fx == []
    _, fx = core.handle(state, env(StoreResult(handle="a", stored=True)))
    assert answers(fx) == []
    _, fx = core.handle(state, env(StoreResult(handle="b", stored=False, reason="io_error")))
    (answer,) = [e for e in fx if isinstance(e, core.Answer)]
    assert answer.request is waiter
    assert answer.body == SpillsDrained(enqueued=2, stored=1, dropped=0, failed=1, refused=0)


def test_stop_releases_queued_and_in_flight_handles_and_answers_waiters() -> None:
    """Stopping settles every owned item (released once) and answers drain waiters."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("a", 5)))
    core.handle(state, env(enqueue("b", 5)))
    core.handle(state, env(DrainSpills(reply_to="w")))
    _, fx = core.handle(state, core.Stopping())
    assert sorted(released(fx)) == ["a", "b"]
    assert [type(b) for b in answers(fx)] == [SpillsDrained]
    _, fx = core.handle(state, env(enqueue("c", 5, reply=True)))
    assert released(fx) == ["c"]
    (notice,) = answers(fx)
    assert isinstance(notice, SpillSettled)
    assert notice.outcome == "refused"


def test_a_duplicate_handle_is_refused_without_a_second_release() -> None:
    """Enqueueing a handle the queue already owns never releases it twice."""
    state = core.QueueState(cap_bytes=100)
    core.handle(state, env(enqueue("a", 5)))
    _, fx = core.handle(state, env(enqueue("a", 5)))
    assert released(fx) == []
    assert core.stats(state).refused == 1


def test_an_invalid_item_is_failed_and_released_at_once() -> None:
    """Tokens that disagree with meta.offset never reach the writer."""
    state = core.QueueState(cap_bytes=100)
    bad = Enqueue(
        handle="x",
        tokens=(1, 2),
        meta=EntryMeta(offset=5, nbytes=1, trimmable=True, min_reusable_offset=0),
    )
    _, fx = core.handle(state, env(bad))
    assert released(fx) == ["x"]
    assert sent(fx) == []
    assert core.stats(state).failed == 1


def test_stats_request_is_answered() -> None:
    """SpillQueueStatsRequest answers the current gauges."""
    state = core.QueueState(cap_bytes=7)
    _, fx = core.handle(state, env(SpillQueueStatsRequest(reply_to="s")))
    (body,) = answers(fx)
    assert isinstance(body, SpillQueueStats)
    assert body.cap_bytes == 7


class QueueMachine(RuleBasedStateMachine):
    """Random enqueues, results, failures, drains and a stop against the queue's invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.cap = 0
        self.state = core.QueueState(cap_bytes=0)
        self.accepted: list[str] = []
        self.released: Counter[str] = Counter()
        self.started: list[str] = []
        self.n = 0
        self.stopped = False

    def _apply(self, effects: list[core.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, core.ReleaseHandle):
                self.released[effect.handle] += 1
            elif isinstance(effect, core.SendStore):
                self.started.append(effect.item.handle)

    @rule(cap=st.sampled_from([0, 10, 50, 200]))
    def set_cap(self, cap: int) -> None:
        """Change the cap between runs (applies from the next enqueue)."""
        self.cap = cap
        self.state.cap_bytes = cap

    @rule(nbytes=st.integers(0, 120))
    def put(self, nbytes: int) -> None:
        """Enqueue a fresh handle; check the soft cap and the victims right after."""
        self.n += 1
        handle = f"h{self.n}"
        queued_before = [i.handle for i in self.state.queued]
        _, fx = core.handle(self.state, env(enqueue(handle, nbytes)))
        self._apply(fx)
        if self.stopped:
            assert self.released[handle] == 1
            return
        self.accepted.append(handle)
        dropped = list(released(fx))
        # Victims are exactly the oldest queued items, in order, never the new one.
        assert dropped == queued_before[: len(dropped)]
        assert handle not in dropped
        queued = [i.handle for i in self.state.queued]
        assert core.pending_bytes(self.state) <= self.cap or queued == [handle] or queued == []

    @rule(stored=st.booleans())
    def result(self, stored: bool) -> None:
        """The writer answers the in-flight item."""
        if self.state.in_flight is None:
            return
        h = self.state.in_flight.handle
        _, fx = core.handle(self.state, env(StoreResult(handle=h, stored=stored)))
        self._apply(fx)
        assert self.released[h] == 1

    @rule()
    def writer_failed(self) -> None:
        """The writer's handler raised."""
        _, fx = core.handle(self.state, env(Failure(error="E")))
        self._apply(fx)

    @rule()
    def stop(self) -> None:
        """The queue stops: everything owned is released."""
        _, fx = core.handle(self.state, core.Stopping())
        self._apply(fx)
        self.stopped = True

    @invariant()
    def releases_exactly_once_and_only_settled(self) -> None:
        """Each handle is released at most once, and exactly once unless still owned."""
        owned = {i.handle for i in self.state.queued}
        if self.state.in_flight is not None:
            owned.add(self.state.in_flight.handle)
        for h in self.accepted:
            assert self.released[h] == (0 if h in owned else 1), h
        assert all(n == 1 for n in self.released.values())

    @invariant()
    def one_in_flight_in_arrival_order(self) -> None:
        """Items start in arrival order; while one is queued, one is in flight."""
        order = {h: i for i, h in enumerate(self.accepted)}
        assert self.started == sorted(self.started, key=order.__getitem__)
        if self.state.queued and not self.stopped:
            assert self.state.in_flight is not None

    @invariant()
    def counters_add_up(self) -> None:
        """enqueued = stored + failed + dropped + pending (refused are not enqueued)."""
        s = core.stats(self.state)
        assert s.enqueued == s.stored + s.failed + s.dropped + s.pending
        assert s.pending_bytes == sum(i.nbytes for i in self.state.queued) + s.in_flight_bytes


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
