"""The reader's rules (``actors.ssd_writer.reader_core``) by plain calls and a property."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.ssd_writer import reader_core as core
from messages import Envelope, ReadEntry, RestoreReport, RestoreResult

PATH = "/c/fp/ns/a.kvt"


def _asked(*, read_only: bool = False, now: float = 0.0) -> tuple[core.ReaderState, Envelope]:
    state = core.ReaderState()
    body = ReadEntry(path=PATH, namespace="", tokens=(1, 2, 3), ticket="t", reply_to="asker",
                     read_only=read_only)
    request = Envelope("m", "c", None, "ssd_writer", "ssd_writer.read", 0.0, body)
    _, fx = core.handle(state, core.ReadAsked(request, now))
    assert fx == [core.Open(PATH, "", (1, 2, 3))]
    return state, request


def _reports(effects: list[core.Effect]) -> list[RestoreReport]:
    return [e.body for e in effects if isinstance(e, core.Report)]


def test_a_good_read_offers_the_staged_file_then_reports_its_pass() -> None:
    """Open, stage, offer (read_s to the open file), pass with the LRU touch, one ok report whose
    seconds run from the ask to the end of the pass."""
    state, _ = _asked(now=10.0)
    assert core.handle(state, core.Opened("restore-1", 3, 500, 10.5))[1] == [
        core.Stage("restore-1")
    ]
    (offer,) = core.handle(state, core.Staged(True, 10.5))[1]
    assert offer == core.Offer(RestoreResult(ok=True, path=PATH, ticket="t", staging_id="restore-1",
                                             entry_tokens=3, bytes=500, read_s=0.5))
    assert core.handle(state, core.Delivered(True, 10.6))[1] == [core.Pass(touch=True)]
    _, fx = core.handle(state, core.Passed("ok", 12.0, nbytes=500, touched=True))
    assert _reports(fx) == [RestoreReport(path=PATH, ok=True, bytes=500, seconds=2.0,
                                          touched=True)]
    assert state.read is None


def test_a_corrupt_header_is_removed_answered_and_reported() -> None:
    """A bad header: removed durably first; the asker gets corrupt; the report says removed."""
    state, _ = _asked()
    assert core.handle(state, core.OpenFailed("corrupt", 0.1, "bad magic"))[1] == [
        core.RemoveBad(PATH)
    ]
    _, fx = core.handle(state, core.BadRemoved(True, 0.2))
    assert core.Answer(RestoreResult(ok=False, path=PATH, reason="corrupt", ticket="t")) in fx
    assert _reports(fx) == [RestoreReport(path=PATH, ok=False, reason="corrupt", removed=True)]
    assert state.removed == 1


def test_a_read_only_tier_neither_touches_nor_removes() -> None:
    """With read_only in the ReadEntry, the pass does not touch the file and a corrupt one is
    only reported (not removed)."""
    state, _ = _asked(read_only=True)
    _, fx = core.handle(state, core.OpenFailed("corrupt", 0.1, "bad magic"))
    assert not any(isinstance(e, core.RemoveBad) for e in fx)
    assert _reports(fx) == [RestoreReport(path=PATH, ok=False, reason="corrupt", removed=False)]
    state, _ = _asked(read_only=True)
    core.handle(state, core.Opened("r", 3, 500, 0.0))
    core.handle(state, core.Staged(True, 0.0))
    assert core.handle(state, core.Delivered(True, 0.0))[1] == [core.Pass(touch=False)]


def test_an_asker_who_left_gets_its_entry_dropped_and_no_pass() -> None:
    """The offer was not delivered: the staged entry is discarded, the pass abandoned, the read
    reported stopped."""
    state, _ = _asked()
    core.handle(state, core.Opened("r", 3, 500, 0.0))
    core.handle(state, core.Staged(True, 0.0))
    _, fx = core.handle(state, core.Delivered(False, 0.1))
    assert fx[:2] == [core.Discard("r"), core.Abandon("the asker left")]
    assert _reports(fx) == [RestoreReport(path=PATH, ok=False, reason="stopped")]
    assert not any(isinstance(e, core.Pass) for e in fx)


def test_a_pass_that_finds_a_bad_tensor_drops_the_entry_and_answers_no_one_again() -> None:
    """After the offer, a corrupt pass discards the staged entry and removes the file; the asker
    (already answered) gets nothing more."""
    state, _ = _asked()
    core.handle(state, core.Opened("r", 3, 500, 0.0))
    core.handle(state, core.Staged(True, 0.0))
    core.handle(state, core.Delivered(True, 0.0))
    assert core.handle(state, core.Passed("corrupt", 1.0, error="hash"))[1] == [
        core.Discard("r"), core.RemoveBad(PATH)
    ]
    _, fx = core.handle(state, core.BadRemoved(True, 1.1))
    assert not any(isinstance(e, core.Answer | core.Offer) for e in fx)
    assert _reports(fx) == [RestoreReport(path=PATH, ok=False, reason="corrupt", removed=True)]


outcomes = st.one_of(
    st.builds(core.OpenFailed, st.sampled_from(["corrupt", "gone", "io_error"]), st.just(1.0)),
    st.builds(core.Opened, st.just("r"), st.just(3), st.just(500), st.just(1.0)),
    st.builds(core.Staged, st.booleans(), st.just(1.0)),
    st.builds(core.Delivered, st.booleans(), st.just(1.0)),
    st.builds(core.Passed, st.sampled_from(["ok", "corrupt", "stopped", "io_error"]),
              st.just(2.0), st.integers(0, 500), st.booleans()),
    st.builds(core.BadRemoved, st.booleans(), st.just(2.0)),
)


def _next(effects: list[core.Effect], data: st.DataObject) -> core.Event | None:
    """The outcome the shell would feed for the effect that waits for one (the last)."""
    if not effects:
        return None
    last = effects[-1]
    match last:
        case core.Open():
            return data.draw(st.one_of(
                st.builds(core.OpenFailed, st.sampled_from(["corrupt", "gone", "io_error"]),
                          st.just(1.0)),
                st.just(core.Opened("r", 3, 500, 1.0))))
        case core.Stage():
            return core.Staged(data.draw(st.booleans()), 1.0)
        case core.Offer():
            return core.Delivered(data.draw(st.booleans()), 1.0)
        case core.Pass():
            return data.draw(st.builds(
                core.Passed, st.sampled_from(["ok", "corrupt", "stopped", "io_error"]),
                st.just(2.0), st.integers(0, 500), st.booleans()))
        case core.RemoveBad():
            return core.BadRemoved(data.draw(st.booleans()), 2.0)
        case _:
            return None


@settings(max_examples=150, deadline=None)
@given(st.booleans(), st.data())
def test_every_read_answers_its_asker_once_and_reports_once(
    read_only: bool, data: st.DataObject
) -> None:
    """Whatever each IO step's outcome, a read ends with exactly one report to the index and
    exactly one answer or offer to the asker; a read-only read never removes or touches."""
    state, _ = _asked(read_only=read_only)
    every: list[core.Effect] = [core.Open(PATH, "", (1, 2, 3))]
    event = _next(every, data)
    while event is not None:
        _, fx = core.handle(state, event)
        every.extend(fx)
        event = _next(fx, data)
    assert state.read is None
    assert len(_reports(every)) == 1
    assert len([e for e in every if isinstance(e, core.Answer | core.Offer)]) == 1
    if read_only:
        assert not any(isinstance(e, core.RemoveBad) for e in every)
        assert core.Pass(touch=True) not in every


@given(st.lists(outcomes, max_size=5))
def test_an_outcome_without_a_read_raises(seq: list[core.Event]) -> None:
    """No read in progress: any outcome is refused."""
    state = core.ReaderState()
    for event in seq:
        try:
            core.handle(state, event)
        except ValueError:
            continue
        raise AssertionError(f"{event} was accepted without a read")
