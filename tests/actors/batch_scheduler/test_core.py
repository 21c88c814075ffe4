"""The batch scheduler's sans-IO core by plain calls, plus a random-event property."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.batch_scheduler.core import (
    Admit,
    AnswerAdmission,
    BeginDrain,
    Cancel,
    Effect,
    EmitToken,
    EndStream,
    Event,
    ExitOut,
    JoinRow,
    LookupAnswered,
    PutEntry,
    ReleaseLease,
    ReportTurn,
    SchedulerState,
    StartLookup,
    Status,
    StepFailed,
    StepFinished,
    StepOut,
    StreamGone,
    SubmitStep,
    TokenOut,
    TurnGranted,
    handle,
)
from actors.engine_thread.ports import Registered
from messages.gateway import DoneEvent, ErrorEvent, Generate, GenerationParams
from messages.prompt_cache import EntryMeta, TakeResult


def gen(rid: str, n: int = 8, *, chat: bool = False) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(range(1, n + 1)),
        params=GenerationParams(max_tokens=4),
        stream_to=f"inbox.{rid}",
        chat=chat,
    )


def reg(handle: str, tokens: tuple[int, ...]) -> Registered:
    meta = EntryMeta(offset=len(tokens), nbytes=64, trimmable=True, min_reusable_offset=0)
    return Registered(handle, meta, tokens)


class Core:
    """The state plus ``handle`` as one object, so each test reads as a script of events."""

    def __init__(self, max_rows: int = 2, max_queue: int = 2, *, lookups: bool = False) -> None:
        self.state = SchedulerState(max_rows=max_rows, max_queue=max_queue, lookups=lookups)
        self.turn = 0

    def handle(self, event: Event) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects

    def grant(self, now: float = 1.0) -> list[Effect]:
        self.turn += 1
        return self.handle(TurnGranted(self.turn, now))


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def test_admission_places_rows_up_to_max_rows_then_queues_then_refuses() -> None:
    """max_rows rows are placed at once, max_queue more wait (position), the next is queue_full."""
    core = Core(max_rows=2, max_queue=1)
    first = core.handle(Admit(gen("a"), "c-a", 0.0))
    assert first[0] == AnswerAdmission("a", True, 0)
    assert of(first, Status) == [Status(busy=True, ready=True)]
    core.handle(Admit(gen("b"), "c-b", 0.0))
    waiting = core.handle(Admit(gen("c"), "c-c", 0.0))
    assert waiting == [AnswerAdmission("c", True, 1)]
    refused = core.handle(Admit(gen("d"), "c-d", 0.0))
    (answer,) = of(refused, AnswerAdmission)
    assert answer.error_code == "queue_full"
    assert not answer.accepted
    assert of(refused, Status) == [Status(True, True, left=("d",))], (
        "the gateway forgets a refused id"
    )
    assert core.state.placed() == 2
    assert list(core.state.waiting) == ["c"]


def test_rows_look_up_while_placed_and_join_only_when_answered() -> None:
    """With a prompt cache, a placed row starts its Take; the step joins it with the lookup, then releases the lease."""
    core = Core(lookups=True)
    effects = core.handle(Admit(gen("a"), "c-a", 0.0))
    assert of(effects, StartLookup)[0].request.request_id == "a"
    assert of(effects, Status) == [Status(busy=True, ready=False)], "busy while its lookup runs"
    hit = TakeResult(lease_id="L1", handle="h1", cached_tokens=5, entry_tokens=6)
    assert of(core.handle(LookupAnswered("a", hit, 0.5)), Status) == [Status(busy=True, ready=True)]
    step = core.grant()
    assert of(step, SubmitStep) == [SubmitStep(1, (JoinRow(gen("a"), "h1", 5),), ())]
    done = core.handle(StepFinished(1, StepOut(joined=(("a", 5),), prefill_tokens=2), 1.5))
    assert of(done, ReleaseLease) == [ReleaseLease("L1")]
    assert core.state.rows["a"].cached_tokens == 5


def test_a_step_streams_each_rows_token_and_ends_finished_rows_with_usage_and_put() -> None:
    """Tokens go to each row's stream in order; a finished row gets DoneEvent, its cache a Put, the report lists it."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Admit(gen("b", chat=True), "c-b", 0.0))
    core.grant(1.0)
    core.handle(StepFinished(1, StepOut(joined=(("a", 0), ("b", 0)), prefill_tokens=14), 2.0))
    core.grant(2.0)
    snap = reg("hs", (1, 2, 3))
    entry = reg("he", (1, 2, 3, 4, 5, 6, 7, 8, 9))
    out = StepOut(
        tokens=(TokenOut("a", 0, 9, "x"), TokenOut("b", 0, 7, "y", finish_reason="stop")),
        exits=(ExitOut("b", "stop", 1, entry),),
        snapshots=(("b", snap),),
        decode_rows=2,
    )
    effects = core.handle(StepFinished(2, out, 3.0))
    tokens = of(effects, EmitToken)
    assert [(t.stream_to, t.event.index, t.event.token_id) for t in tokens] == [
        ("inbox.a", 0, 9),
        ("inbox.b", 0, 7),
    ]
    puts = of(effects, PutEntry)
    assert [(p.put.handle, p.put.role) for p in puts] == [("hs", "snapshot"), ("he", "completion")]
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.finish_reason == "stop"
    assert end.final.usage.completion_tokens == 1
    assert end.final.timings.ttft_s == 3.0
    (report,) = of(effects, ReportTurn)
    assert report.report.left == ("b",)
    assert report.report.busy
    assert report.report.ready
    assert set(core.state.rows) == {"a"}


def test_cancel_before_joining_ends_at_once_and_releases_the_lease() -> None:
    """A waiting or looked-up row that is cancelled ends with DoneEvent(cancelled) now; its lease is released."""
    core = Core(max_rows=1, lookups=True)
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Admit(gen("b"), "c-b", 0.0))
    core.handle(LookupAnswered("a", TakeResult(lease_id="L1", handle="h", cached_tokens=3), 0.1))
    gone = core.handle(Cancel("a", 0.2))
    assert ReleaseLease("L1") in gone
    (end,) = of(gone, EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.finish_reason == "cancelled"
    assert of(gone, StartLookup)[0].request.request_id == "b", (
        "the freed room goes to the waiting row"
    )
    waiting = core.handle(Cancel("b", 0.3))
    assert of(waiting, EndStream)
    assert of(waiting, Status) == [Status(busy=False, ready=False, left=("b",))]
    late = core.handle(
        LookupAnswered("b", TakeResult(lease_id="L2", handle="h", cached_tokens=3), 0.4)
    )
    assert late == [ReleaseLease("L2"), *of(late, Status)], (
        "a lookup answered after its row left is released"
    )
    assert not core.state.busy


def test_cancel_of_a_joined_row_is_removed_by_the_next_step() -> None:
    """A joined row's cancel waits for the next step, which cancels it before decoding; it ends as cancelled."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.grant()
    core.handle(StepFinished(1, StepOut(joined=(("a", 0),)), 1.0))
    assert core.handle(Cancel("a", 1.1)) == []
    step = core.grant(1.2)
    assert of(step, SubmitStep) == [SubmitStep(2, (), ("a",))]
    out = StepOut(exits=(ExitOut("a", "cancelled", 3, reg("h", (1, 2))),))
    effects = core.handle(StepFinished(2, out, 1.5))
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.finish_reason == "cancelled"
    assert of(effects, PutEntry), "a cancelled row's cache is kept"
    (report,) = of(effects, ReportTurn)
    assert not report.report.busy


def test_stream_gone_is_a_cancel() -> None:
    """A row whose stream is gone is removed by the next step like a cancel."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.grant()
    core.handle(StepFinished(1, StepOut(joined=(("a", 0),)), 1.0))
    core.handle(StreamGone("a", 1.1))
    assert of(core.grant(), SubmitStep)[0].cancels == ("a",)


def test_failed_step_fails_joined_rows_only() -> None:
    """A step that raises ends every joined row with ErrorEvent; a row still looking up is untouched."""
    core = Core(lookups=True)
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.1))
    core.grant()
    core.handle(Admit(gen("b"), "c-b", 0.5))
    effects = core.handle(StepFailed(1, "batch_step_failed", "boom", 1.0))
    (end,) = of(effects, EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert end.final.request_id == "a"
    (report,) = of(effects, ReportTurn)
    assert not report.report.ok
    assert report.report.left == ("a",)
    assert set(core.state.rows) == {"b"}


def test_turn_protocol_violations_raise() -> None:
    """A second grant while a step runs, or a report for another turn, is a protocol error."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.grant()
    with pytest.raises(ValueError, match="granted while"):
        core.handle(TurnGranted(5, 1.0))
    with pytest.raises(ValueError, match="report of batch turn 9"):
        core.handle(StepFinished(9, StepOut(), 1.0))


def test_grant_with_nothing_left_reports_at_once() -> None:
    """A grant that arrives after every row left runs no job and is reported."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Cancel("a", 0.1))
    effects = core.grant()
    assert not of(effects, SubmitStep)
    assert len(of(effects, ReportTurn)) == 1
    assert core.state.in_flight is None


def test_drain_refuses_new_rows() -> None:
    """After BeginDrain new requests are refused as shutting_down; rows already admitted continue."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(BeginDrain(0.1))
    (answer,) = of(core.handle(Admit(gen("b"), "c-b", 0.2)), AnswerAdmission)
    assert answer.error_code == "shutting_down"
    assert "a" in core.state.rows


# --- property ----------------------------------------------------------------------


_IDS = ["a", "b", "c", "d", "e"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "lookup", "cancel", "grant", "finish", "fail"]),
            st.sampled_from(_IDS),
        ),
        max_size=60,
    )
)
def test_random_events_keep_the_invariants(script: list[tuple[str, str]]) -> None:
    """Any event order: rows within limits, every lease released once, busy told truthfully, no row stuck.

    Rows are chat requests sharing an 80-token prefix, so later rows defer to a prefilling one.
    """
    core = Core(max_rows=3, max_queue=2, lookups=True)
    leases_out: set[str] = set()
    released: list[str] = []
    busy_told = False
    submitted: tuple[str, ...] = ()
    now = 0.0
    for n, (what, rid) in enumerate(script):
        now += 1.0
        effects: list[Effect] = []
        if what == "admit":
            effects = core.handle(Admit(gen(rid, 80, chat=True), f"c-{rid}", now))
        elif what == "lookup":
            row = core.state.rows.get(rid)
            if row is not None and row.phase == "lookup":
                lease = f"L{n}"
                leases_out.add(lease)
                hit = TakeResult(lease_id=lease, handle="h", cached_tokens=2)
                effects = core.handle(LookupAnswered(rid, hit, now))
        elif what == "cancel":
            effects = core.handle(Cancel(rid, now))
        elif what == "grant":
            if core.state.in_flight is None and core.state.ready:
                effects = core.grant(now)
                for submit in of(effects, SubmitStep):
                    submitted = tuple(j.request.request_id for j in submit.joins)
        elif core.state.in_flight is not None:
            joined = tuple((r, 2) for r in submitted)
            if what == "finish":
                exits = tuple(
                    ExitOut(r, "cancelled" if row.cancelled else "length", 1)
                    for r, row in core.state.rows.items()
                    if row.phase == "joined" and (row.cancelled or r == rid)
                )
                step = StepOut(joined=joined, exits=exits, prefilled=submitted)
                effects = core.handle(StepFinished(core.turn, step, now))
            else:
                effects = core.handle(StepFailed(core.turn, "x", "y", now))
        released += [e.lease_id for e in of(effects, ReleaseLease)]
        for e in of(effects, Status):
            busy_told = e.busy
        for e in of(effects, ReportTurn):
            busy_told = e.report.busy
        assert core.state.placed() <= 3
        assert len(core.state.waiting) <= 2
        for row in core.state.rows.values():
            if row.phase == "deferred":
                awaited = core.state.rows.get(row.wait_for or "")
                assert awaited is not None, "a deferred row waits for a row that left"
                assert awaited.phase == "joined", (
                    "a deferred row waits for a row that cannot progress"
                )
                assert not awaited.prefilled
        assert busy_told == core.state.busy
        assert len(released) == len(set(released)), "a lease released twice"
    # Every lease not held by a live row was released.
    held = {
        r.lookup.lease_id
        for r in core.state.rows.values()
        if r.lookup is not None and r.lookup.lease_id
    }
    assert leases_out == set(released) | held


def _chat(rid: str, prompt: tuple[int, ...], *, chat: bool = True,
          shared_prompt: bool = False) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=prompt,
        params=GenerationParams(max_tokens=4),
        stream_to=f"inbox.{rid}",
        chat=chat,
        shared_prompt=shared_prompt,
    )


@pytest.mark.parametrize("kind", ["chat", "shared completion"])
def test_a_row_sharing_a_long_prefix_waits_for_the_first_rows_snapshot(kind: str) -> None:
    """Two chat rows (or two completion rows of one request's choices) with a 100-token common prefix: the second waits, then looks up after the first's snapshot Put."""
    shared = tuple(range(100, 200))
    chat = kind == "chat"
    core = Core(max_rows=4, lookups=True)
    core.handle(Admit(_chat("a", (*shared, 1, 2, 3), chat=chat, shared_prompt=not chat), "c-a", 0.0))
    core.handle(Admit(_chat("b", (*shared, 4, 5, 6), chat=chat, shared_prompt=not chat), "c-b", 0.0))
    core.handle(LookupAnswered("a", TakeResult(), 0.1))
    core.handle(LookupAnswered("b", TakeResult(lease_id="Lb", handle="h0", cached_tokens=3), 0.1))
    first = core.grant(1.0)
    assert [j.request.request_id for j in of(first, SubmitStep)[0].joins] == ["a"]
    assert ReleaseLease("Lb") in first, "the deferred row's short lookup is given back"
    assert core.state.rows["b"].phase == "deferred"
    snap = reg("snap-a", (*shared, 1, 2))
    out = StepOut(
        joined=(("a", 0),), prefilled=("a",), snapshots=(("a", snap),), prefill_tokens=102
    )
    effects = core.handle(StepFinished(1, out, 2.0))
    put = next(i for i, e in enumerate(effects) if isinstance(e, PutEntry))
    look, lookup = next((i, e) for i, e in enumerate(effects) if isinstance(e, StartLookup))
    assert put < look, "the new lookup must follow the snapshot's Put"
    assert lookup.request.request_id == "b"
    assert core.state.stats.deferred == 1


def test_rows_sharing_little_or_completion_rows_do_not_wait() -> None:
    """A common prefix shorter than share_min beyond the lookup, or non-chat rows, join together."""
    core = Core(max_rows=4, lookups=True)
    core.handle(Admit(_chat("a", (*range(100, 130), 1)), "c-a", 0.0))
    core.handle(Admit(_chat("b", (*range(100, 130), 2)), "c-b", 0.0))
    core.handle(Admit(gen("c", 150), "c-c", 0.0))
    core.handle(Admit(gen("d", 150), "c-d", 0.0))
    for rid in "abcd":
        core.handle(LookupAnswered(rid, None, 0.1))
    joins = of(core.grant(), SubmitStep)[0].joins
    assert [j.request.request_id for j in joins] == ["a", "b", "c", "d"]
