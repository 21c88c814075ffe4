"""The idle scrubber's rules (``actors.ssd_writer.scrubber_core``) by plain calls and a property."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.ssd_writer import scrubber_core as core
from messages.ssd_writer import ScrubReport, ScrubTarget

TARGET = ScrubTarget(path="/c/fp/ns/a.kvt", namespace="", tokens=(1, 2), file_bytes=4000)


def _state(read_only: bool = False) -> core.ScrubberState:
    return core.ScrubberState(
        interval_s=10.0, bytes_per_s=100.0, idle_wait_s=5.0, read_only=read_only
    )


def _round_to_verify(state: core.ScrubberState, now: float = 0.0) -> None:
    """Drive a round up to its Verify effect."""
    _, fx = core.handle(state, core.Woke(now))
    assert fx == [core.AskIdle(now + 5.0)]
    _, fx = core.handle(state, core.IdleAnswered(True, now))
    assert fx == [core.AskPick()]
    _, fx = core.handle(state, core.Picked(TARGET, now))
    assert fx == [core.Verify(TARGET.path or "", "", (1, 2))]


def test_a_good_file_is_reported_and_the_next_wake_keeps_the_byte_rate() -> None:
    """A verified file is reported ok, and the next wake waits bytes / rate (40 s) when that is
    longer than the interval."""
    state = _state()
    _round_to_verify(state)
    _, fx = core.handle(state, core.Verified("ok", 1.0, nbytes=4000))
    assert fx == [core.Report(ScrubReport(path=TARGET.path or "", ok=True, bytes=4000)),
                  core.Arm(1.0 + 40.0)]
    assert not state.in_round


def test_a_bad_file_is_removed_then_reported_with_the_removal() -> None:
    """A corrupt file is removed first; the report says whether the removal was durable."""
    state = _state()
    _round_to_verify(state)
    _, fx = core.handle(state, core.Verified("corrupt", 1.0, error="hash mismatch"))
    assert fx == [core.RemoveBad(TARGET.path or "")]
    _, fx = core.handle(state, core.BadRemoved(False, 2.0))
    assert fx == [
        core.Log("ssd_cache.scrub_corrupt", TARGET.path or "", "hash mismatch", removed=False),
        core.Report(ScrubReport(path=TARGET.path or "", ok=False, reason="corrupt",
                                removed=False)),
        core.Arm(2.0 + 40.0),
    ]


def test_a_busy_engine_or_an_empty_index_checks_nothing_and_waits_one_interval() -> None:
    """A refused idle turn ends the round; so does a pick with no file."""
    state = _state()
    core.handle(state, core.Woke(0.0))
    assert core.handle(state, core.IdleAnswered(False, 3.0))[1] == [core.Arm(13.0)]
    core.handle(state, core.Woke(20.0))
    core.handle(state, core.IdleAnswered(True, 20.0))
    assert core.handle(state, core.Picked(ScrubTarget(), 21.0))[1] == [core.Arm(31.0)]
    core.handle(state, core.Woke(40.0))
    core.handle(state, core.IdleAnswered(True, 40.0))
    assert core.handle(state, core.Picked(None, 41.0))[1] == [core.Arm(51.0)]


def test_a_read_only_tier_is_not_asked_again_and_never_loses_a_file() -> None:
    """Once the index says read-only, a wake asks nobody; a bad file found before is only
    reported, never removed."""
    state = _state()
    core.handle(state, core.Woke(0.0))
    core.handle(state, core.IdleAnswered(True, 0.0))
    assert core.handle(state, core.Picked(ScrubTarget(read_only=True), 1.0))[1] == [
        core.Arm(11.0)
    ]
    assert core.handle(state, core.Woke(20.0))[1] == [core.Arm(30.0)]
    ro = _state(read_only=True)
    ro.in_round, ro.target = True, TARGET
    _, fx = core.handle(ro, core.Verified("corrupt", 1.0, error="bad"))
    assert not any(isinstance(e, core.RemoveBad) for e in fx)
    assert core.Report(ScrubReport(path=TARGET.path or "", ok=False, reason="corrupt",
                                   removed=False)) in fx


events = st.one_of(
    st.builds(core.Woke, st.just(0.0)),
    st.builds(core.IdleAnswered, st.booleans(), st.just(0.0)),
    st.builds(core.Picked, st.sampled_from([None, ScrubTarget(), TARGET]), st.just(0.0)),
    st.builds(core.Verified, st.sampled_from(["ok", "corrupt", "gone", "io_error"]),
              st.just(0.0), st.integers(0, 10_000)),
    st.builds(core.BadRemoved, st.booleans(), st.just(0.0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(events, max_size=30))
def test_every_round_ends_with_one_report_at_most_and_one_alarm(seq: list[core.Event]) -> None:
    """Over any event sequence the shell could feed (outcomes out of place raise before any
    change), a round that ends arms exactly one alarm and reports at most once; a round never
    both removes and keeps going without an outcome."""
    state = _state()
    for event in seq:
        in_round = state.in_round
        try:
            _, fx = core.handle(state, event)
        except ValueError:
            assert state.in_round == in_round
            continue
        arms = [e for e in fx if isinstance(e, core.Arm)]
        reports = [e for e in fx if isinstance(e, core.Report)]
        assert len(reports) <= 1
        if arms:
            assert len(arms) == 1
            assert fx[-1] == arms[0]
            assert not state.in_round
        waiting = [e for e in fx if isinstance(e, core.AskIdle | core.AskPick | core.Verify
                                                 | core.RemoveBad)]
        assert len(waiting) <= 1
        assert not waiting or fx[-1] is waiting[0]
