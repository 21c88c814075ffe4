"""The gateway's engine-turn token with batch step chains: who gets a chain, who preempts it."""

from __future__ import annotations

from actors.gateway.core import (
    AdmitRequest,
    BatchStatus,
    BatchTurnDone,
    CancelRequest,
    Effect,
    GatewayState,
    PreemptBatchTurn,
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

    def __init__(self, max_burst: int = 16) -> None:
        self.state = GatewayState(max_queue=4, max_burst=max_burst)

    def handle(self, event: object) -> list[Effect]:
        self.state, effects = handle(self.state, event)  # type: ignore[arg-type]
        return effects


def test_the_batch_lane_alone_gets_chains_and_the_stats_count_steps_per_grant() -> None:
    """With no serial work each batch grant allows max_burst steps; steps reported add up, grants stay few."""
    core = Core(max_burst=16)
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.0)) == [RunBatchTurn(1, 16)]
    assert core.handle(BatchTurnDone(True, True, 0.1, steps=16)) == [RunBatchTurn(2, 16)]
    assert core.handle(BatchTurnDone(False, False, 0.2, steps=5)) == []
    snap = core.state.snapshot(0.3)
    assert snap["batch_lane"]["turns"] == 2  # type: ignore[index]
    assert snap["batch_chains"] == {"steps": 21, "granted": 2, "longest": 16, "preempted": 0}


def test_serial_work_preempts_a_chain_once_then_the_lanes_alternate_single_steps() -> None:
    """A lane holder arriving mid-chain preempts it (once); then each lane gets one step per turn."""
    core = Core(max_burst=16)
    core.handle(BatchStatus(busy=True, ready=True, now=0.0))
    assert core.handle(AdmitRequest("r1", now=0.1)) == [
        RequestAdmitted("r1", 0),
        PreemptBatchTurn(1),
    ]
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.15)) == []  # told once
    assert core.handle(BatchTurnDone(True, True, 0.2, steps=3)) == [RunRequestTurn("r1", 1)]
    assert core.handle(RequestTurnDone("r1", "decode", "continue", now=0.3)) == [RunBatchTurn(2, 1)]
    assert core.handle(BatchTurnDone(True, True, 0.4)) == [RunRequestTurn("r1", 1)]
    # NOTE: once the serial lane is empty, the batch chains again.
    assert core.handle(RequestTurnDone("r1", "decode", "finished", now=0.5)) == [
        RunBatchTurn(3, 16)
    ]
    assert core.state.stats.batch_preempted == 1


def test_a_cancel_of_a_burst_already_preempted_by_the_batch_sends_no_second_stop() -> None:
    """A serial burst stopped for batch rows is not told to stop again by its requester's cancel."""
    core = Core(max_burst=16)
    assert core.handle(AdmitRequest("r1", now=0.0))[-1] == RunRequestTurn("r1", 16)
    assert core.handle(BatchStatus(busy=True, ready=True, now=0.1)) == [PreemptTurn("r1")]
    assert core.handle(CancelRequest("r1", now=0.2)) == []
    assert core.state.lane_cancelled


def test_background_work_waits_through_chains_until_the_batch_is_empty() -> None:
    """A background ask never gets the turn between batch chains while rows exist."""
    core = Core(max_burst=16)
    core.handle(BatchStatus(busy=True, ready=True, now=0.0))
    assert core.handle(WantBackgroundTurn("flush", now=0.05)) == []
    assert core.handle(BatchTurnDone(True, True, 0.1, steps=16)) == [RunBatchTurn(2, 16)]
    assert core.handle(BatchTurnDone(True, False, 0.2, steps=2)) == []
    assert core.handle(BatchStatus(busy=False, ready=False, now=0.3)) == [
        RunBackgroundTurn("flush")
    ]
