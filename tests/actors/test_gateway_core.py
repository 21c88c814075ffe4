"""The gateway's sans-IO core: admission, serial lane and engine-turn token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.gateway.core import (
    AdmitRequest,
    BackgroundTurnDone,
    BeginDrain,
    CancelRequest,
    CoreEvent,
    Drained,
    Effect,
    ExpireBackground,
    FinishRequest,
    GatewayState,
    LookupDone,
    PreemptTurn,
    RefuseBackground,
    RejectRequest,
    RequestAdmitted,
    RequestTurnDone,
    RunBackgroundTurn,
    RunRequestTurn,
    StartLookup,
    StopTurns,
    WantBackgroundTurn,
    WithdrawBackground,
    handle,
)


class Core:
    """The state plus ``handle`` as one object, so each test reads as a script of events."""

    def __init__(self, max_queue: int, max_burst: int = 1, *, lookups: bool = False) -> None:
        self.state = GatewayState(max_queue=max_queue, max_burst=max_burst, lookups=lookups)

    def handle(self, event: CoreEvent) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects


def _runs(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if isinstance(e, RunRequestTurn | RunBackgroundTurn)]


def test_first_request_takes_the_lane_and_its_first_turn() -> None:
    """An idle gateway admits a request at position 0 and runs its first turn at once."""
    core = Core(max_queue=2)
    effects = core.handle(AdmitRequest("r1", now=0.0))
    assert effects == [RequestAdmitted("r1", 0), RunRequestTurn("r1")]
    assert core.state.holder() == "request:r1"


def test_queue_overflow_is_rejected_with_queue_full() -> None:
    """With the lane busy, max_queue requests wait and the next one is refused as queue_full."""
    core = Core(max_queue=2)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(AdmitRequest("r2", now=0.1)) == [RequestAdmitted("r2", 1)]
    assert core.handle(AdmitRequest("r3", now=0.2)) == [RequestAdmitted("r3", 2)]
    assert core.handle(AdmitRequest("r4", now=0.3)) == [RejectRequest("r4", "queue_full", 2, 2)]
    assert core.state.stats.rejected_queue_full == 1
    assert core.state.stats.admitted == 3


def test_lane_holder_takes_turns_back_to_back_then_queue_in_order() -> None:
    """The holder's turns run until it finishes; then queued requests get the lane in arrival order."""
    core = Core(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    core.handle(AdmitRequest("r3", now=0.0))
    assert core.handle(RequestTurnDone("r1", "prefill", "continue", now=1.0)) == [RunRequestTurn("r1")]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=2.0)) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "prefill", "finished", now=3.0)) == [RunRequestTurn("r3")]
    assert core.handle(RequestTurnDone("r3", "prefill", "failed", now=4.0)) == []
    assert core.state.stats.completed == 2
    assert core.state.stats.failed == 1
    assert core.state.idle


def test_background_never_granted_while_a_request_is_active_or_queued() -> None:
    """RunWhenIdle waits while the lane is held or requests queue, and runs once everything is done."""
    core = Core(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(WantBackgroundTurn("bg1", now=0.5)) == []
    core.handle(AdmitRequest("r2", now=0.6))
    assert _runs(core.handle(RequestTurnDone("r1", "decode", "finished", now=1.0))) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "decode", "continue", now=2.0)) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "decode", "finished", now=3.0)) == [RunBackgroundTurn("bg1")]
    assert core.state.stats.background_wait_s == pytest.approx(2.5)


def test_request_arriving_during_a_background_step_waits_for_that_step_only() -> None:
    """A request admitted mid background turn runs right after it, ahead of other background waiters."""
    core = Core(max_queue=4)
    assert core.handle(WantBackgroundTurn("bg1", now=0.0)) == [RunBackgroundTurn("bg1")]
    core.handle(WantBackgroundTurn("bg2", now=0.0))
    assert core.handle(AdmitRequest("r1", now=0.1)) == [RequestAdmitted("r1", 0)]
    assert core.state.holder() == "background:bg1"
    assert core.handle(BackgroundTurnDone("bg1", now=0.2)) == [RunRequestTurn("r1")]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.5)) == [RunBackgroundTurn("bg2")]


def test_cancel_queued_request_drops_it_at_once() -> None:
    """Cancelling a queued request finishes it immediately without any turn."""
    core = Core(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    assert core.handle(CancelRequest("r2", now=0.1)) == [FinishRequest("r2", "cancelled", had_turns=False)]
    assert list(core.state.queue) == []
    assert core.state.stats.cancelled == 1


def test_cancel_running_request_frees_lane_after_the_current_step() -> None:
    """Cancelling the holder mid-turn ends it when that turn reports, and the next request runs."""
    core = Core(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    assert core.handle(CancelRequest("r1", now=0.1)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2)) == [
        FinishRequest("r1", "cancelled", had_turns=True),
        RunRequestTurn("r2"),
    ]


def test_cancel_of_a_finished_request_is_ignored() -> None:
    """A cancel racing the request's own end changes nothing."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(RequestTurnDone("r1", "decode", "finished", now=0.1))
    assert core.handle(CancelRequest("r1", now=0.2)) == []
    assert core.state.stats.cancelled == 0


def test_drain_refuses_new_requests_and_reports_drained_once() -> None:
    """After BeginDrain new requests get shutting_down; Drained fires when the last one finishes."""
    core = Core(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(BeginDrain(now=0.1)) == []
    assert core.handle(AdmitRequest("r2", now=0.2)) == [RejectRequest("r2", "shutting_down", 0, 4)]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.3)) == [Drained()]
    assert core.handle(WantBackgroundTurn("bg", now=0.4)) == [RunBackgroundTurn("bg")]


def test_stop_turns_refuses_background_waiters() -> None:
    """StopTurns answers every waiting and later RunWhenIdle ask without running it."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(WantBackgroundTurn("bg1", now=0.0))
    assert core.handle(StopTurns(now=0.1)) == [RefuseBackground("bg1")]
    assert core.handle(WantBackgroundTurn("bg2", now=0.2)) == [RefuseBackground("bg2")]
    assert core.state.stats.background_refused == 2


def test_statistics_count_grants_and_time_held() -> None:
    """Grant counters and held time add up exactly over a scripted sequence."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(RequestTurnDone("r1", "prefill", "continue", now=0.5))
    core.handle(WantBackgroundTurn("bg", now=0.6))
    core.handle(RequestTurnDone("r1", "decode", "finished", now=0.75))
    core.handle(BackgroundTurnDone("bg", now=1.0))
    snap = core.state.snapshot(now=1.0)
    assert snap["grants"] == {"request": 2, "prefill": 1, "decode": 1, "background": 1}
    assert snap["held_s"] == {"request": pytest.approx(0.75), "background": pytest.approx(0.25)}
    assert snap["holder"] is None
    assert snap["background_wait_s"] == {"total": pytest.approx(0.15), "max": pytest.approx(0.15)}


def test_turn_report_from_a_non_holder_is_a_bug() -> None:
    """A turn report that does not match the holder raises instead of corrupting state."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    with pytest.raises(ValueError, match="holder"):
        core.handle(BackgroundTurnDone("bg", now=0.1))


def test_bursts_are_granted_to_the_lane_holder_and_a_cancel_preempts_one() -> None:
    """With max_burst > 1 every request turn is a burst grant; a cancel while one runs emits PreemptTurn once and finishes the request when it reports."""
    core = Core(max_queue=2, max_burst=8)
    assert core.handle(AdmitRequest("r1", now=0.0)) == [RequestAdmitted("r1", 0), RunRequestTurn("r1", 8)]
    assert core.handle(AdmitRequest("r2", now=0.1)) == [RequestAdmitted("r2", 1)]
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2, steps=8)) == [RunRequestTurn("r1", 8)]
    assert core.handle(CancelRequest("r1", now=0.3)) == [PreemptTurn("r1")]
    assert core.handle(CancelRequest("r1", now=0.35)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.4, steps=3)) == [
        FinishRequest("r1", "cancelled", had_turns=True),
        RunRequestTurn("r2", 8),
    ]
    snap = core.state.snapshot(now=0.4)
    assert snap["grants"] == {"request": 3, "prefill": 0, "decode": 11, "background": 0}
    assert snap["bursts"] == {"granted": 3, "max_steps": 8, "longest": 8, "preempted": 1}
    assert snap["requests"]["cancelled"] == 1  # type: ignore[index]


def test_single_step_turns_are_never_preempted() -> None:
    """With max_burst 1 (one step per turn) a cancel in flight only marks the holder, as before bursts existed."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(CancelRequest("r1", now=0.1)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2)) == [
        FinishRequest("r1", "cancelled", had_turns=True)
    ]


def test_a_report_of_more_steps_than_granted_is_a_bug() -> None:
    """A runner that reports more steps than its grant (or none) is refused instead of skewing the statistics."""
    core = Core(max_queue=1, max_burst=4)
    core.handle(AdmitRequest("r1", now=0.0))
    with pytest.raises(ValueError, match="granted 4"):
        core.handle(RequestTurnDone("r1", "decode", "continue", now=0.1, steps=5))
    with pytest.raises(ValueError, match="granted 4"):
        core.handle(RequestTurnDone("r1", "decode", "continue", now=0.1, steps=0))
    with pytest.raises(ValueError, match="max_burst"):
        GatewayState(max_queue=1, max_burst=0)


def test_a_request_waits_for_its_lookup_and_background_runs_meanwhile() -> None:
    """With lookups on, the lane holder's first turn waits for LookupDone; meanwhile the idle engine may grant one background step, and the request goes next."""
    core = Core(max_queue=2, lookups=True)
    assert core.handle(AdmitRequest("r1", now=0.0)) == [RequestAdmitted("r1", 0), StartLookup("r1")]
    assert core.state.holder() is None
    assert core.handle(WantBackgroundTurn("bg1", now=0.1)) == [RunBackgroundTurn("bg1")]
    core.handle(WantBackgroundTurn("bg2", now=0.1))
    assert core.handle(LookupDone("r1", now=0.2)) == []
    assert core.handle(BackgroundTurnDone("bg1", now=0.3)) == [RunRequestTurn("r1")]
    assert core.state.stats.lookups == 1


def test_the_queue_head_looks_up_while_the_lane_holder_runs() -> None:
    """The next request's lookup starts as soon as it heads the queue, so it overlaps the holder's turns; the one behind it waits its turn to look up."""
    core = Core(max_queue=3, lookups=True)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(LookupDone("r1", now=0.1)) == [RunRequestTurn("r1")]
    assert core.handle(AdmitRequest("r2", now=0.2)) == [RequestAdmitted("r2", 1), StartLookup("r2")]
    assert core.handle(AdmitRequest("r3", now=0.3)) == [RequestAdmitted("r3", 2)]
    core.handle(LookupDone("r2", now=0.4))
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.5)) == [
        StartLookup("r3"),
        RunRequestTurn("r2"),
    ]


def test_cancel_during_a_lookup_forgets_it() -> None:
    """A request cancelled while its lookup runs finishes without turns; its late LookupDone changes nothing."""
    core = Core(max_queue=2, lookups=True)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(CancelRequest("r1", now=0.1)) == [FinishRequest("r1", "cancelled", had_turns=False)]
    assert core.handle(LookupDone("r1", now=0.2)) == []
    assert core.state.lookup == {}
    assert core.state.idle


def test_a_background_ask_past_its_deadline_is_dropped_not_granted() -> None:
    """A RunWhenIdle whose deadline passed while requests ran is expired when the engine frees, and the next waiter runs instead."""
    core = Core(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(WantBackgroundTurn("late", now=0.1, deadline=0.5))
    core.handle(WantBackgroundTurn("patient", now=0.2, deadline=None))
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=1.0)) == [
        ExpireBackground("late"),
        RunBackgroundTurn("patient"),
    ]
    assert core.state.stats.background_expired == 1
    assert core.state.stats.background_turns == 1


def test_withdrawing_a_granted_background_step_takes_the_grant_back() -> None:
    """A grant whose asker is gone (withdrawn before it reached the runner) is undone and the next waiter is granted."""
    core = Core(max_queue=1)
    assert core.handle(WantBackgroundTurn("gone", now=0.0)) == [RunBackgroundTurn("gone")]
    core.handle(WantBackgroundTurn("next", now=0.0))
    assert core.handle(WithdrawBackground("gone", now=0.1)) == [
        ExpireBackground("gone"),
        RunBackgroundTurn("next"),
    ]
    assert core.state.stats.background_turns == 1
    assert core.handle(WithdrawBackground("unknown", now=0.2)) == []


_EVENT = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
    st.tuples(st.just("lookup"), st.integers(0, 5)),
    st.tuples(st.just("bg"), st.integers(0, 3)),
    st.tuples(st.just("withdraw"), st.integers(0, 3)),
    st.tuples(st.just("done"), st.sampled_from(["continue", "finished", "failed"])),
    st.tuples(st.just("drain"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENT, max_size=60), st.integers(0, 3), st.sampled_from([1, 4]), st.booleans())
def test_invariants_hold_for_any_event_sequence(
    script: list[tuple[str, object]], max_queue: int, max_burst: int, lookups: bool
) -> None:
    """For random event sequences (single steps or bursts, with or without lookups): one turn at a time, background only when no request can run, bounded queue, no stall."""
    core = Core(max_queue=max_queue, max_burst=max_burst, lookups=lookups)
    state = core.state
    now = 0.0
    bg_seq = 0
    asked: list[str] = []
    for op, arg in script:
        now += 0.01
        if op == "admit":
            effects = core.handle(AdmitRequest(f"r{arg}", now=now))
        elif op == "cancel":
            effects = core.handle(CancelRequest(f"r{arg}", now=now))
        elif op == "lookup":
            effects = core.handle(LookupDone(f"r{arg}", now=now))
        elif op == "bg":
            bg_seq += 1
            asked.append(f"b{bg_seq}")
            deadline = now + 0.01 * int(str(arg)) if arg else None
            effects = core.handle(WantBackgroundTurn(f"b{bg_seq}", now=now, deadline=deadline))
        elif op == "withdraw":
            if not asked:
                continue
            effects = core.handle(WithdrawBackground(asked[int(str(arg)) % len(asked)], now=now))
        elif op == "drain":
            effects = core.handle(BeginDrain(now=now))
        else:
            if state.turn is None:
                continue
            if state.turn.owner == "request":
                outcome = arg if isinstance(arg, str) else "continue"
                effects = core.handle(
                    RequestTurnDone(state.turn.ident, "decode", outcome, now=now, steps=state.turn.max_steps)  # type: ignore[arg-type]
                )
            else:
                effects = core.handle(BackgroundTurnDone(state.turn.ident, now=now))
        runs = _runs(effects)
        assert len(runs) <= 1
        for effect in effects:
            if isinstance(effect, PreemptTurn):
                # NOTE: only a running burst of the cancelled lane holder is preempted.
                assert max_burst > 1
                assert state.turn is not None
                assert state.turn.ident == effect.request_id == state.lane
                assert state.lane_cancelled
            if isinstance(effect, StartLookup):
                assert lookups
                assert effect.request_id in (state.lane, *list(state.queue)[:1])
        for run in runs:
            if isinstance(run, RunBackgroundTurn):
                # NOTE: granted only when no request can run.
                assert state.lane is None or not state.ready(state.lane)
                assert not state.queue or state.lane is not None
            else:
                assert isinstance(run, RunRequestTurn)
                assert run.request_id == state.lane
                assert state.ready(run.request_id)
        assert len(state.queue) <= max_queue
        if state.turn is not None and state.turn.owner == "background":
            # NOTE: a request that already ran is never paused for background work.
            assert not state.lane_had_turns
        if state.turn is None:
            # NOTE: an idle engine with someone able to run would be a stall.
            assert state.lane is None or not state.ready(state.lane)
            assert not state.queue or state.lane is not None
            assert not state.background
