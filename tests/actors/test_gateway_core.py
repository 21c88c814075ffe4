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
    Drained,
    Effect,
    FinishRequest,
    GatewayCore,
    PreemptTurn,
    RefuseBackground,
    RejectRequest,
    RequestAdmitted,
    RequestTurnDone,
    RunBackgroundTurn,
    RunRequestTurn,
    StopTurns,
    WantBackgroundTurn,
)


def _runs(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if isinstance(e, RunRequestTurn | RunBackgroundTurn)]


def test_first_request_takes_the_lane_and_its_first_turn() -> None:
    """An idle gateway admits a request at position 0 and runs its first turn at once."""
    core = GatewayCore(max_queue=2)
    effects = core.handle(AdmitRequest("r1", now=0.0))
    assert effects == [RequestAdmitted("r1", 0), RunRequestTurn("r1")]
    assert core.holder() == "request:r1"


def test_queue_overflow_is_rejected_with_queue_full() -> None:
    """With the lane busy, max_queue requests wait and the next one is refused as queue_full."""
    core = GatewayCore(max_queue=2)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(AdmitRequest("r2", now=0.1)) == [RequestAdmitted("r2", 1)]
    assert core.handle(AdmitRequest("r3", now=0.2)) == [RequestAdmitted("r3", 2)]
    assert core.handle(AdmitRequest("r4", now=0.3)) == [RejectRequest("r4", "queue_full", 2, 2)]
    assert core.stats.rejected_queue_full == 1
    assert core.stats.admitted == 3


def test_lane_holder_takes_turns_back_to_back_then_queue_in_order() -> None:
    """The holder's turns run until it finishes; then queued requests get the lane in arrival order."""
    core = GatewayCore(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    core.handle(AdmitRequest("r3", now=0.0))
    assert core.handle(RequestTurnDone("r1", "prefill", "continue", now=1.0)) == [RunRequestTurn("r1")]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=2.0)) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "prefill", "finished", now=3.0)) == [RunRequestTurn("r3")]
    assert core.handle(RequestTurnDone("r3", "prefill", "failed", now=4.0)) == []
    assert core.stats.completed == 2
    assert core.stats.failed == 1
    assert core.idle


def test_background_never_granted_while_a_request_is_active_or_queued() -> None:
    """RunWhenIdle waits while the lane is held or requests queue, and runs once everything is done."""
    core = GatewayCore(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(WantBackgroundTurn("bg1", now=0.5)) == []
    core.handle(AdmitRequest("r2", now=0.6))
    assert _runs(core.handle(RequestTurnDone("r1", "decode", "finished", now=1.0))) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "decode", "continue", now=2.0)) == [RunRequestTurn("r2")]
    assert core.handle(RequestTurnDone("r2", "decode", "finished", now=3.0)) == [RunBackgroundTurn("bg1")]
    assert core.stats.background_wait_s == pytest.approx(2.5)


def test_request_arriving_during_a_background_step_waits_for_that_step_only() -> None:
    """A request admitted mid background turn runs right after it, ahead of other background waiters."""
    core = GatewayCore(max_queue=4)
    assert core.handle(WantBackgroundTurn("bg1", now=0.0)) == [RunBackgroundTurn("bg1")]
    core.handle(WantBackgroundTurn("bg2", now=0.0))
    assert core.handle(AdmitRequest("r1", now=0.1)) == [RequestAdmitted("r1", 0)]
    assert core.holder() == "background:bg1"
    assert core.handle(BackgroundTurnDone("bg1", now=0.2)) == [RunRequestTurn("r1")]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.5)) == [RunBackgroundTurn("bg2")]


def test_cancel_queued_request_drops_it_at_once() -> None:
    """Cancelling a queued request finishes it immediately without any turn."""
    core = GatewayCore(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    assert core.handle(CancelRequest("r2", now=0.1)) == [FinishRequest("r2", "cancelled", had_turns=False)]
    assert list(core.queue) == []
    assert core.stats.cancelled == 1


def test_cancel_running_request_frees_lane_after_the_current_step() -> None:
    """Cancelling the holder mid-turn ends it when that turn reports, and the next request runs."""
    core = GatewayCore(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(AdmitRequest("r2", now=0.0))
    assert core.handle(CancelRequest("r1", now=0.1)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2)) == [
        FinishRequest("r1", "cancelled", had_turns=True),
        RunRequestTurn("r2"),
    ]


def test_cancel_of_a_finished_request_is_ignored() -> None:
    """A cancel racing the request's own end changes nothing."""
    core = GatewayCore(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(RequestTurnDone("r1", "decode", "finished", now=0.1))
    assert core.handle(CancelRequest("r1", now=0.2)) == []
    assert core.stats.cancelled == 0


def test_drain_refuses_new_requests_and_reports_drained_once() -> None:
    """After BeginDrain new requests get shutting_down; Drained fires when the last one finishes."""
    core = GatewayCore(max_queue=4)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(BeginDrain(now=0.1)) == []
    assert core.handle(AdmitRequest("r2", now=0.2)) == [RejectRequest("r2", "shutting_down", 0, 4)]
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.3)) == [Drained()]
    assert core.handle(WantBackgroundTurn("bg", now=0.4)) == [RunBackgroundTurn("bg")]


def test_stop_turns_refuses_background_waiters() -> None:
    """StopTurns answers every waiting and later RunWhenIdle ask without running it."""
    core = GatewayCore(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(WantBackgroundTurn("bg1", now=0.0))
    assert core.handle(StopTurns(now=0.1)) == [RefuseBackground("bg1")]
    assert core.handle(WantBackgroundTurn("bg2", now=0.2)) == [RefuseBackground("bg2")]
    assert core.stats.background_refused == 2


def test_statistics_count_grants_and_time_held() -> None:
    """Grant counters and held time add up exactly over a scripted sequence."""
    core = GatewayCore(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    core.handle(RequestTurnDone("r1", "prefill", "continue", now=0.5))
    core.handle(WantBackgroundTurn("bg", now=0.6))
    core.handle(RequestTurnDone("r1", "decode", "finished", now=0.75))
    core.handle(BackgroundTurnDone("bg", now=1.0))
    snap = core.snapshot(now=1.0)
    assert snap["grants"] == {"request": 2, "prefill": 1, "decode": 1, "background": 1}
    assert snap["held_s"] == {"request": pytest.approx(0.75), "background": pytest.approx(0.25)}
    assert snap["holder"] is None
    assert snap["background_wait_s"] == {"total": pytest.approx(0.15), "max": pytest.approx(0.15)}


def test_turn_report_from_a_non_holder_is_a_bug() -> None:
    """A turn report that does not match the holder raises instead of corrupting state."""
    core = GatewayCore(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    with pytest.raises(ValueError, match="holder"):
        core.handle(BackgroundTurnDone("bg", now=0.1))


def test_bursts_are_granted_to_the_lane_holder_and_a_cancel_preempts_one() -> None:
    """With max_burst > 1 every request turn is a burst grant; a cancel while one runs emits PreemptTurn once and finishes the request when it reports."""
    core = GatewayCore(max_queue=2, max_burst=8)
    assert core.handle(AdmitRequest("r1", now=0.0)) == [RequestAdmitted("r1", 0), RunRequestTurn("r1", 8)]
    assert core.handle(AdmitRequest("r2", now=0.1)) == [RequestAdmitted("r2", 1)]
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2, steps=8)) == [RunRequestTurn("r1", 8)]
    assert core.handle(CancelRequest("r1", now=0.3)) == [PreemptTurn("r1")]
    assert core.handle(CancelRequest("r1", now=0.35)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.4, steps=3)) == [
        FinishRequest("r1", "cancelled", had_turns=True),
        RunRequestTurn("r2", 8),
    ]
    snap = core.snapshot(now=0.4)
    assert snap["grants"] == {"request": 3, "prefill": 0, "decode": 11, "background": 0}
    assert snap["bursts"] == {"granted": 3, "max_steps": 8, "longest": 8, "preempted": 1}
    assert snap["requests"]["cancelled"] == 1  # type: ignore[index]


def test_single_step_turns_are_never_preempted() -> None:
    """With max_burst 1 (one step per turn) a cancel in flight only marks the holder, as before bursts existed."""
    core = GatewayCore(max_queue=1)
    core.handle(AdmitRequest("r1", now=0.0))
    assert core.handle(CancelRequest("r1", now=0.1)) == []
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2)) == [
        FinishRequest("r1", "cancelled", had_turns=True)
    ]


def test_a_report_of_more_steps_than_granted_is_a_bug() -> None:
    """A runner that reports more steps than its grant (or none) is refused instead of skewing the statistics."""
    core = GatewayCore(max_queue=1, max_burst=4)
    core.handle(AdmitRequest("r1", now=0.0))
    with pytest.raises(ValueError, match="granted 4"):
        core.handle(RequestTurnDone("r1", "decode", "continue", now=0.1, steps=5))
    with pytest.raises(ValueError, match="granted 4"):
        core.handle(RequestTurnDone("r1", "decode", "continue", now=0.1, steps=0))
    with pytest.raises(ValueError, match="max_burst"):
        GatewayCore(max_queue=1, max_burst=0)


_EVENT = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
    st.tuples(st.just("bg"), st.integers(0, 5)),
    st.tuples(st.just("done"), st.sampled_from(["continue", "finished", "failed"])),
    st.tuples(st.just("drain"), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_EVENT, max_size=60), st.integers(0, 3), st.sampled_from([1, 4]))
def test_invariants_hold_for_any_event_sequence(
    script: list[tuple[str, object]], max_queue: int, max_burst: int
) -> None:
    """For random event sequences (single steps or bursts): one turn at a time, background only when no request waits, bounded queue."""
    core = GatewayCore(max_queue=max_queue, max_burst=max_burst)
    now = 0.0
    bg_seq = 0
    for op, arg in script:
        now += 0.01
        if op == "admit":
            effects = core.handle(AdmitRequest(f"r{arg}", now=now))
        elif op == "cancel":
            effects = core.handle(CancelRequest(f"r{arg}", now=now))
        elif op == "bg":
            bg_seq += 1
            effects = core.handle(WantBackgroundTurn(f"b{bg_seq}", now=now))
        elif op == "drain":
            effects = core.handle(BeginDrain(now=now))
        else:
            if core.turn is None:
                continue
            if core.turn.owner == "request":
                outcome = arg if isinstance(arg, str) else "continue"
                effects = core.handle(
                    RequestTurnDone(core.turn.ident, "decode", outcome, now=now, steps=core.turn.max_steps)  # type: ignore[arg-type]
                )
            else:
                effects = core.handle(BackgroundTurnDone(core.turn.ident, now=now))
        runs = _runs(effects)
        assert len(runs) <= 1
        for effect in effects:
            if isinstance(effect, PreemptTurn):
                # NOTE: only a running burst of the cancelled lane holder is preempted.
                assert max_burst > 1
                assert core.turn is not None
                assert core.turn.ident == effect.request_id == core.lane
                assert core.lane_cancelled
        for run in runs:
            if isinstance(run, RunBackgroundTurn):
                assert core.lane is None
                assert not core.queue
        assert len(core.queue) <= max_queue
        if core.turn is not None and core.turn.owner == "background":
            assert core.lane is None or core.lane not in core.queue
        if core.turn is None:
            # NOTE: an idle engine with someone waiting would be a stall.
            assert core.lane is None
            assert not core.queue
            assert not core.background
