"""The durability coordinator's rules (sans-IO core), by plain calls."""

from __future__ import annotations

import pytest

from actors.durability import core
from messages import Covers, Enqueue, Release
from messages.durability import DurabilityStats, DurabilityStatsRequest, FlushResult

from .support import Driver, cloned, only_clone, only_send, results, sends

T1 = (1, 2, 3)


def started(d: Driver, tokens: tuple[int, ...] = T1, handle: str = "h1") -> str:
    """Schedule ``tokens`` and let its debounce pass; the ref of the attempt's Covers."""
    d.schedule(tokens, handle)
    return only_send(d.wake(), "ssd_writer.covers").ref


def to_queue(d: Driver, covers_ref: str, clone: str = "c1", ntok: int = 3) -> str:
    """Answer 'not covered' and let the clone step succeed; the ref of the Enqueue."""
    turn = only_clone(d.covers(covers_ref, False))
    return only_send(d.turn(turn.ref, cloned(clone, ntok)), "spill_queue.enqueue").ref


def test_a_put_is_written_behind_after_the_debounce_only() -> None:
    """A Schedule arms the 1 s debounce; nothing is sent before it, a Covers check after it."""
    d = Driver()
    effects = d.schedule(T1, "h1")
    assert sends(effects) == []
    assert core.SetAlarm(1.0) in effects
    d.now = 0.9
    assert sends(d.deliver(DurabilityStatsRequest(reply_to="x"))) == []
    send = only_send(d.wake(), "ssd_writer.covers")
    assert d.now == 1.0
    assert send.body == Covers(tokens=T1, namespace="")


def test_a_new_put_of_the_same_key_restarts_the_debounce() -> None:
    """A second Schedule of the same tokens within the debounce moves the alarm, one record."""
    d = Driver()
    d.schedule(T1, "h1")
    d.now = 0.5
    effects = d.schedule(T1, "h2")
    assert core.SetAlarm(1.5) in effects
    assert len(d.state.records) == 1
    assert d.state.records[("", T1)].handle == "h2"


def test_same_length_conversations_and_namespaces_are_separate_records() -> None:
    """Other tokens of the same length, or the same tokens in another namespace, never cancel."""
    d = Driver()
    d.schedule((1, 2, 3), "a")
    d.schedule((1, 2, 4), "b")
    d.schedule((1, 2, 3), "c", ns="adapter")
    assert set(d.state.records) == {("", (1, 2, 3)), ("", (1, 2, 4)), ("adapter", (1, 2, 3))}


def test_a_prefix_already_on_disk_is_cleaned_without_a_clone() -> None:
    """Covers says covered: the record leaves the dirty set and no engine turn is asked."""
    d = Driver()
    ref = started(d)
    effects = d.covers(ref, True)
    assert not any(isinstance(e, core.RunClone) for e in effects)
    assert d.state.records == {}
    assert d.state.already_covered == 1


def test_a_snapshot_is_cloned_in_an_idle_turn_and_enqueued_as_a_snapshot() -> None:
    """Not covered: one RunClone with the write-behind turn deadline, then the clone is enqueued."""
    d = Driver()
    ref = started(d)
    turn = only_clone(d.covers(ref, False))
    assert turn.handle == "h1"
    assert turn.deadline == pytest.approx(1.0 + d.config.turn_wait_s)
    send = only_send(d.turn(turn.ref, cloned("c1", 3)), "spill_queue.enqueue")
    assert isinstance(send.body, Enqueue)
    assert (send.body.handle, send.body.source, send.body.tokens) == ("c1", "snapshot", T1)
    d.settle(send.ref, "c1", "stored")
    assert d.state.records == {}
    assert d.state.stored == 1


def test_a_busy_engine_rearms_the_attempt_five_seconds_later() -> None:
    """An expired turn ask drops the step and re-arms the record busy_rearm_s later."""
    d = Driver()
    ref = started(d)
    turn = only_clone(d.covers(ref, False))
    d.now = 1.3
    effects = d.turn(turn.ref, None, error="expired")
    assert core.DropStep(turn.step_id) in effects
    assert d.state.alarm_at == pytest.approx(6.3)
    assert d.state.busy_rearms == 1
    assert ("", T1) in d.state.records


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [("failed", "fsync_failed"), ("failed", "io_error"), ("dropped", "over_cap")],
)
def test_a_dropped_or_failed_store_leaves_the_record_dirty_and_retried(
    outcome: str, reason: str
) -> None:
    """Anything but 'stored' keeps the record, with a back-off growing per failure."""
    d = Driver()
    enq = to_queue(d, started(d))
    d.now = 2.0
    effects = d.settle(enq, "c1", outcome, reason)  # type: ignore[arg-type]
    assert ("", T1) in d.state.records
    assert core.SetAlarm(2.0 + d.config.busy_rearm_s) in effects
    enq = to_queue(d, only_send(d.wake(), "ssd_writer.covers").ref, clone="c2")
    effects = d.settle(enq, "c2", outcome, reason)  # type: ignore[arg-type]
    assert core.SetAlarm(d.now + 2 * d.config.busy_rearm_s) in effects


def test_a_vanished_entry_counts_as_stored_only_if_disk_covers_it() -> None:
    """The handle is gone: Covers again; covered -> clean, else the record stays, missing."""
    d = Driver()
    turn = only_clone(d.covers(started(d), False))
    recheck = only_send(d.turn(turn.ref, core.Vanished()), "ssd_writer.covers")
    d.covers(recheck.ref, True)
    assert d.state.records == {}

    d2 = Driver()
    turn = only_clone(d2.covers(started(d2), False))
    recheck = only_send(d2.turn(turn.ref, core.Vanished()), "ssd_writer.covers")
    d2.covers(recheck.ref, False)
    rec = d2.state.records[("", T1)]
    assert rec.missing
    assert rec.due is None
    assert d2.state.alarm_at is None  # NOTE: nothing to retry without a RAM copy.
    d2.schedule(T1, "h9")
    assert not d2.state.records[("", T1)].missing


def test_a_replacement_scheduled_during_a_write_gets_its_own_attempt() -> None:
    """The old version's 'stored' does not clean the new version; it is attempted on its own."""
    d = Driver()
    enq = to_queue(d, started(d))
    d.now = 1.2
    d.schedule(T1, "h2")
    d.now = 1.4
    d.settle(enq, "c1", "stored")
    rec = d.state.records[("", T1)]
    assert rec.handle == "h2"
    assert rec.due == pytest.approx(2.2)
    ref = only_send(d.wake(), "ssd_writer.covers").ref
    d.covers(ref, True)
    assert d.state.records == {}


def test_a_reply_after_its_deadline_is_ignored_and_its_clone_disposed() -> None:
    """A turn that answers after the reply timeout: the attempt already failed; the clone goes back."""
    d = Driver(core.DurabilityConfig(reply_timeout_s=2.0))
    turn = only_clone(d.covers(started(d), False))
    effects = d.wake(at=1.0 + 2.0 + d.config.turn_wait_s)
    assert core.DropStep(turn.step_id) in effects
    assert d.state.timeouts == 1
    late = d.turn(turn.ref, cloned("c7", 3))
    assert core.DisposeClone("c7") in late
    assert sends(late) == []


def test_a_clone_refused_by_a_full_queue_is_disposed_and_retried_soon() -> None:
    """Undelivered Enqueue: the clone never reached the queue, so the core disposes it."""
    d = Driver()
    enq = to_queue(d, started(d))
    effects = d._do(core.Undelivered(enq, "full", d.now))
    assert core.DisposeClone("c1") in effects
    assert d.state.written == 0
    assert d.state.records[("", T1)].due == pytest.approx(d.now + d.config.retry_s)


def test_flush_forces_every_dirty_record_one_at_a_time_ignoring_the_debounce() -> None:
    """Drain first, then one forced attempt at a time (no turn deadline), then verify each prefix."""
    d = Driver()
    d.schedule((1, 2), "a")
    d.schedule((3, 4), "b")
    asker, effects = d.flush()
    # NOTE: the debounce timers are cancelled: only the drain's reply deadline is armed.
    assert core.SetAlarm(d.config.reply_timeout_s) in effects
    drain = only_send(effects, "spill_queue.drain")
    effects = d.drained(drain.ref)
    covers = only_send(effects, "ssd_writer.covers")
    assert covers.body == Covers(tokens=(1, 2), namespace="")
    turn = only_clone(d.covers(covers.ref, False))
    assert turn.deadline is None
    enq = only_send(d.turn(turn.ref, cloned("ca", 2)), "spill_queue.enqueue")
    assert len(d.state.attempts) == 1
    effects = d.settle(enq.ref, "ca", "stored")
    covers = only_send(effects, "ssd_writer.covers")
    assert covers.body == Covers(tokens=(3, 4), namespace="")
    enq = only_send(
        d.turn(only_clone(d.covers(covers.ref, False)).ref, cloned("cb", 2)),
        "spill_queue.enqueue",
    )
    verify = only_send(d.settle(enq.ref, "cb", "stored"), "ssd_writer.covers")
    verify2 = only_send(d.covers(verify.ref, True), "ssd_writer.covers")
    stats = only_send(d.covers(verify2.ref, True), "ssd_writer.stats_request")
    answer = results(d.stats_reply(stats.ref, entries=2, longest=2))
    assert len(answer) == 1
    result = answer[0]
    assert result.durable
    assert (result.scope, result.written, result.covered, result.pending) == (2, 2, 2, 0)
    assert (result.entries, result.longest_durable_prefix_tokens) == (2, 2)
    assert any(isinstance(e, core.Answer) and e.request is asker for e in d.log)


def _run_flush(d: Driver, *, store: str = "stored", covered: bool = True) -> core.FlushRun | None:
    """Drive a flush of one record to its end with the given store outcome; the result."""
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    turn = only_clone(d.covers(only_send(effects, "ssd_writer.covers").ref, False))
    enq = only_send(d.turn(turn.ref, cloned(f"c{d.state.seq}", 3)), "spill_queue.enqueue")
    reason = "" if store == "stored" else "fsync_failed"
    verify = only_send(d.settle(enq.ref, enq.body.handle, store, reason), "ssd_writer.covers")  # type: ignore[attr-defined, arg-type]
    stats = only_send(d.covers(verify.ref, covered), "ssd_writer.stats_request")
    d.stats_reply(stats.ref, entries=1, longest=3)
    return d.state.flush


def test_fsyncgate_a_failed_fsync_is_not_durable_until_rewritten_and_synced() -> None:
    """A forced write whose fsync failed: durable false, record dirty; the next flush rewrites it."""
    d = Driver()
    d.schedule(T1, "h1")
    _run_flush(d, store="failed", covered=False)
    first = d.state.last_flush
    assert first is not None
    assert (first.durable, first.failed, first.pending) == (False, 1, 1)
    assert ("", T1) in d.state.records
    _run_flush(d)
    second = d.state.last_flush
    assert second is not None
    assert second.durable
    assert (second.failed, second.written) == (0, 1)
    assert d.state.records == {}


def test_a_missing_prefix_covered_by_a_descendant_is_durable_at_verification() -> None:
    """A record gone from RAM is forced as a Covers only; the final check may find it covered."""
    d = Driver()
    turn = only_clone(d.covers(started(d), False))
    recheck = only_send(d.turn(turn.ref, core.Vanished()), "ssd_writer.covers")
    d.covers(recheck.ref, False)
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    forced = only_send(effects, "ssd_writer.covers")
    verify = only_send(d.covers(forced.ref, False), "ssd_writer.covers")
    assert not any(isinstance(e, core.RunClone) for e in d.log[-3:])
    stats = only_send(d.covers(verify.ref, True), "ssd_writer.stats_request")
    (result,) = results(d.stats_reply(stats.ref))
    assert result.durable
    assert result.uncovered == 0
    assert d.state.records == {}


def _evicted_before_write(d: Driver, tokens: tuple[int, ...] = T1, handle: str = "h1") -> None:
    """Schedule ``tokens``; its write-behind finds the RAM entry gone and no file: missing."""
    turn = only_clone(d.covers(started(d, tokens, handle), False))
    d.covers(only_send(d.turn(turn.ref, core.Vanished()), "ssd_writer.covers").ref, False)
    assert d.state.records[("", tokens)].missing


def _flush_with_nothing_covered(d: Driver) -> FlushResult:
    """Drive a flush whose every Covers answers 'not covered'; its result."""
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    while True:
        pending = [s for s in sends(effects) if s.body.kind == "ssd_writer.covers"]
        if not pending:
            break
        effects = d.covers(pending[0].ref, False)
    stats = only_send(effects, "ssd_writer.stats_request")
    (result,) = results(d.stats_reply(stats.ref))
    return result


def test_a_prefix_evicted_before_its_write_is_reported_once_and_stays_durable() -> None:
    """Evicted from RAM before any write and uncovered after the drain: the flush is durable
    with evicted_unwritten=1, the record is forgotten, and the next flush reports 0."""
    d = Driver()
    _evicted_before_write(d)
    first = _flush_with_nothing_covered(d)
    assert (first.durable, first.evicted_unwritten, first.uncovered, first.pending) == (
        True, 1, 0, 0,
    )
    assert d.state.records == {}
    assert core.stats(d.state).evicted_unwritten == 1
    second = _flush_with_nothing_covered(d)
    assert (second.durable, second.evicted_unwritten, second.scope) == (True, 0, 0)
    assert core.stats(d.state).evicted_unwritten == 1


def test_a_prefix_ram_still_holds_keeps_the_flush_not_durable_beside_an_evicted_one() -> None:
    """An evicted-unwritten prefix never excuses one RAM still holds: a failed write of the
    held one keeps durable false (pending=1) while the evicted one is reported."""
    d = Driver()
    _evicted_before_write(d)
    d.schedule((7, 8), "h2")
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    # NOTE: the missing record is forced as a Covers only; the held one is cloned and fails.
    effects = d.covers(only_send(effects, "ssd_writer.covers").ref, False)
    turn = only_clone(d.covers(only_send(effects, "ssd_writer.covers").ref, False))
    enq = only_send(d.turn(turn.ref, cloned("c9", 2)), "spill_queue.enqueue")
    effects = d.settle(enq.ref, "c9", "failed", "io_error")
    effects = d.covers(only_send(effects, "ssd_writer.covers").ref, False)
    effects = d.covers(only_send(effects, "ssd_writer.covers").ref, False)
    done = d.stats_reply(only_send(effects, "ssd_writer.stats_request").ref, nbytes=900,
                         max_bytes=1000)
    (result,) = results(done)
    assert (result.durable, result.pending, result.failed, result.evicted_unwritten) == (
        False, 1, 1, 1,
    )
    assert set(d.state.records) == {("", (7, 8))}
    # NOTE: the warning says how full the SSD tier was (a full tier evicts what the flush wrote).
    (warning,) = [e for e in done if isinstance(e, core.Log) and e.event == "durability.not_durable"]
    assert dict(warning.fields)["ssd_bytes"] == 900
    assert dict(warning.fields)["ssd_max_bytes"] == 1000


def test_a_missing_record_given_up_over_the_cap_counts_as_evicted_not_lost() -> None:
    """Over max_records the oldest missing record goes first and is evicted_unwritten, so the
    next flush stays durable; a given-up record RAM held still counts as lost."""
    d = Driver(core.DurabilityConfig(max_records=1))
    _evicted_before_write(d)
    d.schedule((5, 6), "h2")
    assert set(d.state.records) == {("", (5, 6))}
    assert (d.state.lost, d.state.evicted_unwritten) == (0, 1)
    d.schedule((9,), "h3")
    assert (d.state.lost, d.state.evicted_unwritten) == (1, 1)


def test_flush_waits_for_attempts_in_flight_and_does_not_write_a_version_twice() -> None:
    """An attempt running when the flush begins settles first; enqueued during the flush and
    failed, it is counted failed and not forced again in the same flush."""
    d = Driver()
    turn = only_clone(d.covers(started(d), False))
    _, effects = d.flush()
    assert sends(effects) == []  # NOTE: settling: no drain while an attempt runs.
    enq = only_send(d.turn(turn.ref, cloned("c1", 3)), "spill_queue.enqueue")
    effects = d.settle(enq.ref, "c1", "failed", "io_error")
    drain = only_send(effects, "spill_queue.drain")
    effects = d.drained(drain.ref)
    verify = only_send(effects, "ssd_writer.covers")  # NOTE: straight to verification.
    stats = only_send(d.covers(verify.ref, False), "ssd_writer.stats_request")
    (result,) = results(d.stats_reply(stats.ref))
    assert (result.durable, result.written, result.failed, result.pending) == (False, 1, 1, 1)


def test_a_flush_asked_during_a_flush_runs_after_it_with_its_own_scope() -> None:
    """The second asker is answered by a second flush that includes puts made meanwhile."""
    d = Driver()
    d.schedule(T1, "h1")
    d.flush()
    d.schedule((7, 8), "h2")
    second, _ = d.flush()
    assert d.state.flush_queue == [second]
    assert d.state.flush is not None
    assert d.state.flush.scope == (("", T1),)


def test_records_over_the_cap_are_given_up_and_the_next_flush_says_so() -> None:
    """Past max_records the oldest record is lost (counted); the next flush is not durable."""
    d = Driver(core.DurabilityConfig(max_records=2, write_behind=False))
    d.schedule((1,), "a")
    d.schedule((2,), "b")
    d.schedule((3,), "c")
    assert set(d.state.records) == {("", (2,)), ("", (3,))}
    assert d.state.lost == 1
    _, effects = d.flush()
    d.drained(only_send(effects, "spill_queue.drain").ref)
    # NOTE: two forced attempts and two verifications, each a Covers answered "covered".
    for _ in range(4):
        (ref,) = d.state.outstanding
        assert d.state.outstanding[ref].purpose in ("attempt", "verify")
        d.covers(ref, True)
    (stats_ref,) = d.state.outstanding
    (result,) = results(d.stats_reply(stats_ref))
    assert (result.durable, result.lost, result.covered) == (False, 1, 2)


def test_without_write_behind_records_wait_for_a_flush() -> None:
    """write_behind=False: a Schedule arms no timer."""
    d = Driver(core.DurabilityConfig(write_behind=False))
    effects = d.schedule(T1, "h1")
    assert not any(isinstance(e, core.SetAlarm) for e in effects)
    assert d.state.records[("", T1)].due is None


def test_a_send_to_a_stopped_actor_fails_the_attempt() -> None:
    """Undelivered 'gone' on the Covers: the attempt ends and the record backs off."""
    d = Driver()
    ref = started(d)
    d._do(core.Undelivered(ref, "gone", d.now))
    rec = d.state.records[("", T1)]
    assert rec.attempt is None
    assert rec.failures == 1


def test_stop_answers_flush_askers_not_durable_and_drops_waiting_steps() -> None:
    """Stopping mid-flush answers every asker durable=false and drops the clone step."""
    d = Driver()
    turn = only_clone(d.covers(started(d), False))
    _asker, _ = d.flush()
    effects = d.stop()
    (result,) = results(effects)
    assert not result.durable
    assert core.DropStep(turn.step_id) in effects
    assert core.SetAlarm(None) in effects


def test_stats_count_dirty_missing_and_pending() -> None:
    """Stats: dirty records, those RAM still holds, and missing ones."""
    d = Driver()
    turn = only_clone(d.covers(started(d, (2,), "b"), False))
    d.covers(only_send(d.turn(turn.ref, core.Vanished()), "ssd_writer.covers").ref, False)
    d.schedule((1,), "a")
    (answer,) = [
        e for e in d.deliver(DurabilityStatsRequest(reply_to="x")) if isinstance(e, core.Answer)
    ]
    body = answer.body
    assert isinstance(body, DurabilityStats)
    assert (body.dirty, body.pending_snapshots, body.missing, body.vanished) == (2, 1, 1, 1)


def test_an_unknown_message_is_a_typed_error() -> None:
    """A body the coordinator has no rule for raises UnknownDurabilityMessage."""
    d = Driver()
    with pytest.raises(core.UnknownDurabilityMessage):
        d.deliver(Release(lease_id="l1"))


@pytest.mark.parametrize(
    "bad", [{"turn_wait_s": 0.0}, {"max_attempts": 0}, {"debounce_s": -1.0}, {"max_records": 0}]
)
def test_config_rejects_values_that_cannot_work(bad: dict[str, float]) -> None:
    """Non-positive waits, no attempts or no records are refused at construction."""
    with pytest.raises(ValueError):
        core.DurabilityConfig(**bad)  # type: ignore[arg-type]


def test_a_replacement_put_during_a_forced_write_is_forced_in_the_same_flush() -> None:
    """A new version of a key in scope, put while its write runs, gets its own forced attempt
    before verification (and, finding the prefix on disk, writes nothing)."""
    d = Driver()
    d.schedule(T1, "h1")
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    turn = only_clone(d.covers(only_send(effects, "ssd_writer.covers").ref, False))
    enq = only_send(d.turn(turn.ref, cloned("c1", 3)), "spill_queue.enqueue")
    d.schedule(T1, "h2")
    forced = only_send(d.settle(enq.ref, "c1", "stored"), "ssd_writer.covers")
    assert d.state.outstanding[forced.ref].purpose == "attempt"
    verify = only_send(d.covers(forced.ref, True), "ssd_writer.covers")
    assert d.state.outstanding[verify.ref].purpose == "verify"
    stats = only_send(d.covers(verify.ref, True), "ssd_writer.stats_request")
    (result,) = results(d.stats_reply(stats.ref))
    assert result.durable
    assert result.written == 1
    assert d.state.records == {}
