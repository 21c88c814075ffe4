"""The gateway core parks a lane holder blocked on its full stream while another request waits:
the waiting request takes the serial lane; the parked one takes it back, before the queue, once
its held tokens went out; a cancel, a finish or a drain while parked loses nothing."""

from __future__ import annotations

from actors.gateway.core import (
    AdmitRequest,
    BeginDrain,
    CancelRequest,
    CoreEvent,
    Drained,
    Effect,
    FinishRequest,
    GatewayState,
    LaneUnblocked,
    RejectRequest,
    RequestTurnDone,
    RunBackgroundTurn,
    RunRequestTurn,
    WantBackgroundTurn,
    handle,
)


class Core:
    """The state plus ``handle`` as one object, so each test reads as a script of events."""

    def __init__(self, max_queue: int = 4) -> None:
        self.state = GatewayState(max_queue=max_queue)
        self.now = 0.0

    def handle(self, event: CoreEvent) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects

    def blocked_holder_and_a_waiter(self) -> list[Effect]:
        """r1 holds the lane and its turn ends blocked while r2 waits in the queue."""
        self.handle(AdmitRequest("r1", now=0.0))
        self.handle(AdmitRequest("r2", now=0.1))
        return self.handle(RequestTurnDone("r1", "decode", "blocked", now=0.2))


def _runs(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if isinstance(e, RunRequestTurn | RunBackgroundTurn)]


def test_a_blocked_holder_parks_and_the_waiting_request_takes_the_lane() -> None:
    """r1's turn ends blocked with r2 queued: r1 parks (its generation stays open) and r2 gets
    the lane and a turn at once, instead of waiting up to the stream-write deadline."""
    core = Core()
    effects = core.blocked_holder_and_a_waiter()
    assert _runs(effects) == [RunRequestTurn("r2")]
    assert core.state.lane == "r2"
    assert core.state.parked == {"r1": "blocked"}
    assert not any(isinstance(e, FinishRequest) for e in effects)
    snap = core.state.snapshot(0.2)
    assert (snap["parked"], snap["parked_turns"], snap["blocked_turns"]) == (1, 1, 1)


def test_a_blocked_holder_with_nobody_waiting_keeps_the_lane() -> None:
    """Alone, a blocked holder keeps the lane and takes no turn until it is unblocked."""
    core = Core()
    core.handle(AdmitRequest("r1", now=0.0))
    effects = core.handle(RequestTurnDone("r1", "decode", "blocked", now=0.2))
    assert _runs(effects) == []
    assert (core.state.lane, core.state.parked) == ("r1", {})
    effects = core.handle(LaneUnblocked("r1", "continue", now=0.3))
    assert _runs(effects) == [RunRequestTurn("r1")]


def test_an_unblocked_parked_request_takes_the_lane_back_before_the_queue() -> None:
    """Once r1's held tokens went out it is next for the lane: after r2 finishes, r1 (not r3,
    queued earlier than r1's unblocking) takes the lane, as a holder that had turns."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    core.handle(AdmitRequest("r3", now=0.3))
    assert _runs(core.handle(LaneUnblocked("r1", "continue", now=0.4))) == []
    assert core.state.parked == {"r1": "ready"}
    effects = core.handle(RequestTurnDone("r2", "decode", "finished", now=0.5))
    assert _runs(effects) == [RunRequestTurn("r1")]
    assert (core.state.lane, core.state.parked, list(core.state.queue)) == ("r1", {}, ["r3"])
    effects = core.handle(CancelRequest("r1", now=0.6))
    # NOTE: a cancel during r1's turn waits for the turn's report (the engine step in flight).
    assert core.state.lane_cancelled
    effects = core.handle(RequestTurnDone("r1", "decode", "continue", now=0.7))
    assert FinishRequest("r1", "cancelled", had_turns=True) in effects
    assert _runs(effects) == [RunRequestTurn("r3")]


def test_a_new_request_does_not_pass_an_unblocked_parked_one() -> None:
    """With the lane free and r1 parked and unblocked in the same moment, r1 takes the lane
    and a request admitted then waits in the queue."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    core.handle(LaneUnblocked("r1", "continue", now=0.3))
    core.handle(CancelRequest("r2", now=0.35))
    core.handle(RequestTurnDone("r2", "decode", "continue", now=0.4))
    assert core.state.lane == "r1"
    effects = core.handle(AdmitRequest("r4", now=0.45))
    assert list(core.state.queue) == ["r4"]
    assert _runs(effects) == []


def test_a_parked_request_cancelled_is_finished_with_its_turns() -> None:
    """A cancel of a parked request finishes it at once as one that had turns (the runner
    drops its open generation), and it never takes the lane again."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    effects = core.handle(CancelRequest("r1", now=0.3))
    assert FinishRequest("r1", "cancelled", had_turns=True) in effects
    assert core.state.parked == {}
    assert core.state.stats.cancelled == 1
    core.handle(LaneUnblocked("r1", "cancelled", now=0.35))  # NOTE: the runner's late report.
    assert core.state.stats.cancelled == 1
    effects = core.handle(RequestTurnDone("r2", "decode", "finished", now=0.4))
    assert core.state.lane is None
    assert _runs(effects) == []


def test_a_parked_request_whose_last_token_went_out_is_completed() -> None:
    """LaneUnblocked(finished) or (cancelled: stream gone or deadline) ends a parked request."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    core.handle(AdmitRequest("r3", now=0.3))
    core.handle(RequestTurnDone("r2", "decode", "blocked", now=0.4))
    assert core.state.lane == "r3"
    assert core.state.parked == {"r1": "blocked", "r2": "blocked"}
    core.handle(LaneUnblocked("r1", "finished", now=0.5))
    core.handle(LaneUnblocked("r2", "cancelled", now=0.6))
    assert core.state.parked == {}
    assert (core.state.stats.completed, core.state.stats.cancelled) == (1, 1)


def test_a_parked_id_is_a_duplicate_and_a_drain_waits_for_it() -> None:
    """A parked request still counts: its id is refused as a duplicate, and a drain reports
    Drained only after it ended."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    effects = core.handle(AdmitRequest("r1", now=0.3))
    assert any(isinstance(e, RejectRequest) and e.reason == "duplicate_id" for e in effects)
    core.handle(BeginDrain(now=0.4))
    effects = core.handle(RequestTurnDone("r2", "decode", "finished", now=0.5))
    assert not any(isinstance(e, Drained) for e in effects)
    effects = core.handle(LaneUnblocked("r1", "finished", now=0.6))
    assert any(isinstance(e, Drained) for e in effects)


def test_no_idle_background_step_while_a_parked_request_is_blocked() -> None:
    """A parked request blocked on its reader keeps idle background work out, as a blocked
    holder does: its reader may make room any moment. Once unblocked and run, background goes."""
    core = Core()
    core.blocked_holder_and_a_waiter()
    core.handle(WantBackgroundTurn("bg", now=0.3, deadline=None))
    effects = core.handle(RequestTurnDone("r2", "decode", "finished", now=0.4))
    assert _runs(effects) == []
    effects = core.handle(LaneUnblocked("r1", "continue", now=0.5))
    assert _runs(effects) == [RunRequestTurn("r1")]
    effects = core.handle(RequestTurnDone("r1", "decode", "finished", now=0.6))
    assert _runs(effects) == [RunBackgroundTurn("bg")]


def test_parked_requests_are_bounded_as_the_queue_is() -> None:
    """With max_queue parked requests (each keeps its caches open), the next blocked holder keeps
    the lane: the request behind it waits as before parking, at most the stream-write deadline."""
    core = Core(max_queue=1)
    core.blocked_holder_and_a_waiter()
    assert (core.state.lane, core.state.parked) == ("r2", {"r1": "blocked"})
    core.handle(AdmitRequest("r3", now=0.3))
    effects = core.handle(RequestTurnDone("r2", "decode", "blocked", now=0.4))
    assert _runs(effects) == []
    assert (core.state.lane, list(core.state.queue)) == ("r2", ["r3"])
    effects = core.handle(LaneUnblocked("r1", "finished", now=0.5))
    # NOTE: a place is free again: r2 parks and r3 runs.
    assert _runs(effects) == [RunRequestTurn("r3")]
    assert core.state.parked == {"r2": "blocked"}
