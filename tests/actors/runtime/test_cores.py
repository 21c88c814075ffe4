"""Sans-IO cores and ports, tested without any runtime."""

from __future__ import annotations

from actors.runtime import ManualClock, Reply, SeededRng, SequentialIds, Tell
from messages import Envelope

from .demo import Coordinator
from .demo_messages import Work, WorkDone


def _envelope(body: Work | WorkDone, msg_id: str = "m1") -> Envelope:
    return Envelope(msg_id, "c1", None, "external", "coord", 0.0, body)


def test_coordinator_core_splits_work_and_replies_after_both_halves() -> None:
    """The pure ``handle`` tells each worker half the work and replies once both finished."""
    core = Coordinator(("w1", "w2"))
    request = _envelope(Work(job="j", amounts=(1, 2, 3), reply_to="inbox-1"))
    state, effects = core.handle(core.initial_state(), request)
    assert effects == [
        Tell("w1", Work(job="j", amounts=(1, 3), reply_to="coord")),
        Tell("w2", Work(job="j", amounts=(2,), reply_to="coord")),
    ]
    state, effects = core.handle(state, _envelope(WorkDone(job="j", total=4), "m2"))
    assert effects == ()
    state, effects = core.handle(state, _envelope(WorkDone(job="j", total=6), "m3"))
    assert effects == (Reply(request, WorkDone(job="j", total=6)),)
    assert state == {}


def test_simulated_ports_are_deterministic() -> None:
    """Manual clock, sequential ids and a seeded rng repeat exactly."""
    clock = ManualClock()
    clock.advance(0.001)
    clock.advance(0.002)
    assert clock.now() == 0.003
    ids = SequentialIds()
    assert [ids.new_id("m-"), ids.new_id("m-"), ids.new_id("c-")] == ["m-1", "m-2", "c-1"]
    assert [SeededRng(5).randrange(100) for _ in range(3)] == [SeededRng(5).randrange(100)] * 3
