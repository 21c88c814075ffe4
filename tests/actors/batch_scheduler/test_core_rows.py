"""The batch scheduler's core: cold-tier hits lent to joining rows, rows failing alone, leases at stop."""

from __future__ import annotations

from typing import Any

from actors.batch_scheduler.core import (
    Admit,
    Cancel,
    Effect,
    EmitToken,
    EndStream,
    Event,
    ExitOut,
    JoinRow,
    LookupAnswered,
    ObservePrefill,
    ReleaseLease,
    ReportTurn,
    RowFailure,
    SchedulerState,
    StepFailed,
    StepFinished,
    StepOut,
    Stopping,
    SubmitStep,
    TokenOut,
    TurnGranted,
    handle,
)
from messages.gateway import DoneEvent, ErrorEvent, Generate, GenerationParams
from messages.prompt_cache import TakeResult

SSD_HIT = TakeResult(lease_id="L1", cached_tokens=6, entry_tokens=9, staging_id="s1", tier="ssd")


def gen(rid: str, n: int = 8) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(range(1, n + 1)),
        params=GenerationParams(max_tokens=4),
        stream_to=f"inbox.{rid}",
    )


class Core:
    """The state plus ``handle``, so each test reads as a script of events."""

    def __init__(self, max_rows: int = 2) -> None:
        self.state = SchedulerState(max_rows=max_rows, max_queue=2, lookups=True)
        self.turn = 0

    def handle(self, event: Event) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects

    def grant(self, now: float = 1.0) -> list[Effect]:
        self.turn += 1
        return self.handle(TurnGranted(self.turn, now))


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def test_an_ssd_hit_is_lent_to_the_joining_row_with_its_staging_id() -> None:
    """A lookup answered from the cold tier (staging id, no RAM handle) joins with its staged
    bytes and cached_tokens; the lease goes back once the step joined it; the counters say
    the row was restored and how many tokens it reused."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", SSD_HIT, 0.1))
    assert of(core.grant(), SubmitStep) == [SubmitStep(1, (JoinRow(gen("a"), None, 6, "s1"),), ())]
    out = StepOut(joined=(("a", 6),), restored=("a",), prefill_tokens=1)
    done = core.handle(StepFinished(1, out, 1.5))
    assert of(done, ReleaseLease) == [ReleaseLease("L1")]
    assert core.state.rows["a"].cached_tokens == 6
    snap = core.state.snapshot()
    assert snap["ssd"] == {"restored": 1, "restored_tokens": 6, "restore_failed": 0}
    assert snap["cached_tokens"] == 6


def test_an_ssd_hit_that_could_not_be_restored_reports_no_reuse() -> None:
    """A row whose staged bytes could not be restored joined cold: usage.cached_tokens is 0,
    the failure is counted, the lease still goes back."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", SSD_HIT, 0.1))
    core.grant()
    failed = core.handle(StepFinished(1, StepOut(joined=(("a", 0),), restore_failed=("a",)), 1.5))
    assert of(failed, ReleaseLease) == [ReleaseLease("L1")]
    core.grant(2.0)
    out = StepOut(
        tokens=(TokenOut("a", 0, 5, "x", finish_reason="length"),),
        exits=(ExitOut("a", "length", 1),),
    )
    (end,) = of(core.handle(StepFinished(2, out, 2.5)), EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.usage.cached_tokens == 0
    assert core.state.snapshot()["ssd"] == {
        "restored": 0,
        "restored_tokens": 0,
        "restore_failed": 1,
    }


def test_every_path_of_a_row_holding_an_ssd_hit_releases_its_lease() -> None:
    """The staged bytes of an SSD hit are dropped with its lease: a cancel before the join, a
    failed step after the join was submitted, and the scheduler stopping with a row that
    waits to join each release the lease exactly once."""
    cancelled = Core()
    cancelled.handle(Admit(gen("a"), "c-a", 0.0))
    cancelled.handle(LookupAnswered("a", SSD_HIT, 0.1))
    assert of(cancelled.handle(Cancel("a", 0.2)), ReleaseLease) == [ReleaseLease("L1")]

    failed = Core()
    failed.handle(Admit(gen("a"), "c-a", 0.0))
    failed.handle(LookupAnswered("a", SSD_HIT, 0.1))
    failed.grant()
    effects = failed.handle(StepFailed(1, "batch_step_failed", "boom", 1.0))
    assert of(effects, ReleaseLease) == [ReleaseLease("L1")]

    stopping = Core()
    stopping.handle(Admit(gen("a"), "c-a", 0.0))
    stopping.handle(LookupAnswered("a", SSD_HIT, 0.1))
    assert of(stopping.handle(Stopping(0.2)), ReleaseLease) == [ReleaseLease("L1")]
    assert of(stopping.handle(Stopping(0.3)), ReleaseLease) == [], "released once"


def _two_rows_granted() -> Core:
    """A core with rows "a" (nothing cached) and "b" (an SSD hit, lease L1) looked up and granted."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Admit(gen("b"), "c-b", 0.0))
    core.handle(LookupAnswered("a", TakeResult(), 0.1))
    core.handle(LookupAnswered("b", SSD_HIT, 0.1))
    core.grant()
    return core


def test_a_row_failing_alone_ends_with_its_error_and_the_others_go_on() -> None:
    """A RowFailure (the memory guard's refusal) ends that row's stream with an ErrorEvent
    carrying MemoryPressure and its lease released; the other row's token is streamed, it
    stays in the batch, and the report lists only the failed row as gone."""
    core = _two_rows_granted()
    out = StepOut(
        joined=(("a", 0),),
        failed=(RowFailure("b", "MemoryPressure", "not enough memory"),),
    )
    effects = core.handle(StepFinished(1, out, 1.0))
    assert ReleaseLease("L1") in effects
    (end,) = of(effects, EndStream)
    assert end.stream_to == "inbox.b"
    assert isinstance(end.final, ErrorEvent)
    assert (end.final.error_code, end.final.detail) == ("MemoryPressure", "not enough memory")
    (report,) = of(effects, ReportTurn)
    assert report.report.left == ("b",)
    assert set(core.state.rows) == {"a"}
    core.grant(2.0)
    later = core.handle(
        StepFinished(2, StepOut(tokens=(TokenOut("a", 0, 9, "x"),), decode_rows=1), 2.0)
    )
    assert [t.stream_to for t in of(later, EmitToken)] == ["inbox.a"]
    snap = core.state.snapshot()
    assert (snap["memory_refused"], snap["rows_failed_alone"]) == (1, 1)
    requests = snap["requests"]
    assert isinstance(requests, dict)
    assert requests["failed"] == 1


def test_a_decoding_row_failing_alone_keeps_the_tokens_it_streamed() -> None:
    """A joined row refused during its decode gets its ErrorEvent after the tokens already
    streamed; no DoneEvent, and nothing is released twice (its lease went back at the join)."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", SSD_HIT, 0.1))
    core.grant()
    core.handle(StepFinished(1, StepOut(joined=(("a", 6),), restored=("a",)), 1.0))
    core.grant(2.0)
    core.handle(StepFinished(2, StepOut(tokens=(TokenOut("a", 0, 3, "x"),)), 2.0))
    core.grant(3.0)
    effects = core.handle(
        StepFinished(3, StepOut(failed=(RowFailure("a", "MemoryPressure", "m"),)), 3.0)
    )
    assert of(effects, ReleaseLease) == []
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert end.final.error_code == "MemoryPressure"
    assert not core.state.busy


def _observer(**fields: Any) -> list[Effect]:
    """Effects of one granted step (granted at 1.0, finished at 1.5) with ``fields``."""
    core = Core()
    core.state.observe_prefill = True
    core.handle(Admit(gen("a", 60), "c-a", 0.0))
    core.handle(LookupAnswered("a", TakeResult(), 0.1))
    core.grant(1.0)
    return core.handle(StepFinished(1, StepOut(joined=(("a", 0),), **fields), 1.5))


def test_a_step_that_only_prefilled_reports_its_prefill_speed() -> None:
    """A step that forwarded at least 32 prompt tokens and decoded no row reports its tokens and
    time (its joins left out) to the restore-or-recompute estimator; a step that also decoded,
    or forwarded fewer tokens reports nothing."""
    assert of(_observer(prefill_tokens=58), ObservePrefill) == [ObservePrefill(58, 0.5)]
    assert of(_observer(prefill_tokens=58, decode_rows=1), ObservePrefill) == []
    restored = _observer(prefill_tokens=58, restored=("a",), join_s=0.25)
    assert of(restored, ObservePrefill) == [ObservePrefill(58, 0.25)]
    assert of(_observer(prefill_tokens=20), ObservePrefill) == []
    quiet = Core()
    quiet.handle(Admit(gen("a", 60), "c-a", 0.0))
    quiet.handle(LookupAnswered("a", TakeResult(), 0.1))
    quiet.grant(1.0)
    out = StepOut(joined=(("a", 0),), prefill_tokens=58)
    assert of(quiet.handle(StepFinished(1, out, 1.5)), ObservePrefill) == []


def _joins(effects: list[Effect]) -> list[str]:
    """The request ids a submitted step joins."""
    return [j.request.request_id for s in of(effects, SubmitStep) for j in s.joins]


def test_a_row_refused_for_memory_beside_a_joined_row_goes_back_to_admission_at_once() -> None:
    """A row the guard refused before its prefill (MemoryShortAtStart) while another row is
    joined is not held until that row leaves: its stream ends with that code at once (the
    engine API takes it back to admission, where a relief can move cached entries out), its
    lease goes back, it counts as taken back, not failed, and the joined row goes on."""
    core = _two_rows_granted()
    out = StepOut(joined=(("a", 0),),
                  failed=(RowFailure("b", "MemoryShortAtStart", "not enough memory"),))
    effects = core.handle(StepFinished(1, out, 1.0))
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert (end.final.request_id, end.final.error_code) == ("b", "MemoryShortAtStart")
    assert len(of(effects, ReleaseLease)) == 1
    assert set(core.state.rows) == {"a"}
    snap = core.state.snapshot()
    assert (snap["memory_taken_back"], snap["memory_refused"], snap["rows_failed_alone"]) \
        == (1, 0, 0)
    (step,) = of(core.grant(2.0), SubmitStep)
    assert step.joins == ()


def test_a_row_refused_for_memory_with_no_other_row_joined_goes_back_at_once() -> None:
    """With no other row joined the same: a MemoryShortAtStart refusal ends the row's stream
    with that error code (the engine API takes it back to admission, where relief can run),
    releases its lease and counts as taken back, not as a failure."""
    core = Core()
    core.handle(Admit(gen("b"), "c-b", 0.0))
    core.handle(LookupAnswered("b", SSD_HIT, 0.1))
    core.grant()
    out = StepOut(failed=(RowFailure("b", "MemoryShortAtStart", "not enough memory"),))
    effects = core.handle(StepFinished(1, out, 1.0))
    assert ReleaseLease("L1") in effects
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert end.final.error_code == "MemoryShortAtStart"
    assert core.state.rows == {}
    snap = core.state.snapshot()
    assert (snap["memory_taken_back"], snap["memory_refused"], snap["rows_failed_alone"]) \
        == (1, 0, 0)
