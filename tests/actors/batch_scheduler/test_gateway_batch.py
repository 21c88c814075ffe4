"""The gateway core's engine-turn token with a batch lane: batch steps, busy rows, alternation."""

from __future__ import annotations

import pytest

from actors.gateway.core import (
    AdmitRequest,
    BackgroundTurnDone,
    BatchStatus,
    BatchTurnDone,
    BeginDrain,
    Drained,
    Effect,
    GatewayState,
    PreemptTurn,
    RequestAdmitted,
    RequestTurnDone,
    RunBackgroundTurn,
    RunBatchTurn,
    RunRequestTurn,
    WantBackgroundTurn,
    handle,
)


class Core:
    """The gateway state plus ``handle`` as one object."""

    def __init__(self, max_burst: int = 1) -> None:
        self.state = GatewayState(max_queue=4, max_burst=max_burst)

    def handle(self, event: object) -> list[Effect]:
        self.state, effects = handle(self.state, event)  # type: ignore[arg-type]
        return effects


def test_batch_rows_keep_background_out_even_while_they_only_wait() -> None:
    """busy batch rows (none ready yet) hold background steps back; once the batch is empty one is granted."""
    core = Core()
    assert core.handle(BatchStatus(busy=True, ready=False, now=0.0)) == []
    assert core.handle(WantBackgroundTurn("flush", now=0.1)) == []
    assert core.state.busy
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.2)) == [RunBatchTurn(1)]
    assert core.state.holder() == "batch:1"
    assert core.handle(BatchTurnDone(busy=True, ready=True, now=0.3)) == [RunBatchTurn(2)]
    assert core.handle(BatchTurnDone(busy=False, ready=False, now=0.4)) == [
        RunBackgroundTurn("flush")
    ]


def test_a_batch_step_and_the_serial_lane_alternate_with_single_steps() -> None:
    """With both lanes holding work, turns alternate and the lane holder gets one step per turn (no burst)."""
    core = Core(max_burst=8)
    assert core.handle(AdmitRequest("r1", now=0.0)) == [
        RequestAdmitted("r1", 0),
        RunRequestTurn("r1", 8),
    ]
    # NOTE: batch rows with work cut the lane holder's burst short (it ends after its step).
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.1)) == [PreemptTurn("r1")]
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.2, steps=2)) == [
        RunBatchTurn(1)
    ]
    assert core.handle(BatchTurnDone(busy=True, ready=True, now=0.3)) == [RunRequestTurn("r1", 1)]
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.4)) == [RunBatchTurn(2)]
    assert core.handle(BatchTurnDone(busy=True, ready=False, now=0.5)) == [RunRequestTurn("r1", 8)]
    snap = core.state.snapshot(0.6)
    assert snap["batch_lane"] == {"turns": 2, "held_s": pytest.approx(0.2)}


def test_drained_waits_for_the_batch_rows() -> None:
    """After BeginDrain, Drained comes only once the batch lane holds no rows."""
    core = Core()
    core.handle(BatchStatus(busy=True, ready=True, now=0.0))
    assert Drained() not in core.handle(BeginDrain(now=0.1))
    assert Drained() in core.handle(BatchTurnDone(busy=False, ready=False, now=0.2))


def test_background_step_in_flight_delays_the_batch_by_that_step_only() -> None:
    """A batch that becomes ready during a background step gets the very next turn."""
    core = Core()
    assert core.handle(WantBackgroundTurn("w", now=0.0)) == [RunBackgroundTurn("w")]
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.1)) == []
    assert core.handle(WantBackgroundTurn("w2", now=0.15)) == []
    assert core.handle(BackgroundTurnDone("w", now=0.2)) == [RunBatchTurn(1)]
