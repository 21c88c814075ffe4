"""Batch step chains in the scheduler's sans-IO core: when a turn's steps run back to back and when they stop."""

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
    JobEnded,
    JoinRow,
    LookupAnswered,
    OfferRows,
    ReportTurn,
    RowsReturned,
    SchedulerState,
    StepFailed,
    StepFinished,
    StepOut,
    StopChain,
    Stopping,
    StreamFull,
    SubmitStep,
    TokenOut,
    TurnGranted,
    YieldTurn,
    handle,
)
from messages.gateway import Generate, GenerationParams, TokenEvent


def gen(rid: str, n: int = 8) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(range(1, n + 1)),
        params=GenerationParams(max_tokens=64),
        stream_to=f"inbox.{rid}",
    )


class Core:
    """The state plus ``handle`` as one object, so each test reads as a script of events."""

    def __init__(self, *, lookups: bool = False, backlog_max: int = 1024) -> None:
        self.state = SchedulerState(
            max_rows=4, max_queue=4, lookups=lookups, backlog_max=backlog_max
        )

    def handle(self, event: Event) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def tokens(*rids: str, index: int = 0) -> StepOut:
    """A decode step that gave one token to each of ``rids``."""
    return StepOut(tokens=tuple(TokenOut(r, index, 7, "x") for r in rids), decode_rows=len(rids))


def chain_running(core: Core, *rids: str, budget: int = 8) -> None:
    """Admit ``rids`` (no prompt cache: ready at once) and grant turn 1 as a chain of ``budget``."""
    for rid in rids:
        core.handle(Admit(gen(rid), f"c-{rid}", 0.0))
    submit = of(core.handle(TurnGranted(1, 0.1, budget)), SubmitStep)
    assert [s.max_steps for s in submit] == [budget]


def test_a_chain_streams_each_step_and_reports_the_turn_once_with_its_steps() -> None:
    """Steps handed back mid-chain stream their tokens unreported; the job's end reports steps=3."""
    core = Core()
    chain_running(core, "a", budget=3)
    for i in range(2):
        effects = core.handle(StepFinished(1, tokens("a", index=i), 0.2 + i, last=False))
        assert len(of(effects, EmitToken)) == 1
        assert of(effects, ReportTurn) == []
        assert of(effects, StopChain) == []
    effects = core.handle(StepFinished(1, tokens("a", index=2), 0.5, last=True))
    assert len(of(effects, EmitToken)) == 1
    (report,) = of(effects, ReportTurn)
    assert report.report.steps == 3
    assert core.state.in_flight is None
    assert core.state.stats.steps == 3


def test_a_row_ready_mid_chain_is_offered_to_it_without_stopping_it() -> None:
    """A row ready mid-chain is offered once (no StopChain, no report) and joins when the taking step began."""
    core = Core(lookups=True)
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.0))
    core.handle(TurnGranted(1, 0.1, 8))
    core.handle(StepFinished(1, tokens("a"), 0.2, last=False))
    assert of(core.handle(Admit(gen("b"), "c-b", 0.25)), OfferRows) == []  # lookup pending
    effects = core.handle(LookupAnswered("b", None, 0.3))
    assert of(effects, StopChain) == []
    (offer,) = of(effects, OfferRows)
    assert offer.turn == 1
    assert [j.request.request_id for j in offer.joins] == ["b"]
    # NOTE: offered once: later events of the same turn do not offer it again.
    effects = core.handle(StepFinished(1, tokens("a", index=1), 0.4, last=False))
    assert of(effects, OfferRows) == []
    assert of(effects, StopChain) == []
    joined = StepOut(tokens=tokens("a", "b", index=2).tokens, joined=(("b", 0),), decode_rows=1)
    core.handle(StepFinished(1, joined, 0.5, last=False))
    assert not core.state.rows["b"].offered
    assert core.state.in_flight == 1
    # NOTE: joined by the step that began when the one ending at 0.4 ended, not at the offer (0.3).
    assert core.state.rows["b"].joined_at == 0.4


def test_rows_the_chain_hands_back_join_a_new_job_of_the_same_turn() -> None:
    """An offer the chain did not take (RowsReturned): the row is ready again, and the job's end
    starts a new job of the same turn that joins it, without a report to the gateway."""
    core = Core(lookups=True)
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.0))
    core.handle(TurnGranted(1, 0.1, 8))
    core.handle(Admit(gen("b"), "c-b", 0.25))
    (_offer,) = of(core.handle(LookupAnswered("b", None, 0.3)), OfferRows)
    effects = core.handle(RowsReturned(1, ("b",), (), 0.35))
    assert core.state.rows["b"].phase == "ready"
    # NOTE: the job no longer takes rows: nothing is offered again to it.
    assert of(effects, OfferRows) == []
    effects = core.handle(StepFinished(1, tokens("a"), 0.4, last=True))
    assert of(effects, ReportTurn) == []
    (submit,) = of(effects, SubmitStep)
    assert (submit.turn, submit.max_steps) == (1, 7)
    assert [j.request.request_id for j in submit.joins] == ["b"]


def test_a_cancel_mid_chain_is_offered_to_it_without_stopping_it() -> None:
    """Cancelling a joined row offers its removal to the running chain; no StopChain."""
    core = Core()
    chain_running(core, "a", "b")
    core.handle(StepFinished(1, tokens("a", "b"), 0.2, last=False))
    effects = core.handle(Cancel("a", 0.25))
    assert of(effects, StopChain) == []
    assert [o.cancels for o in of(effects, OfferRows)] == [("a",)]
    exit_a = StepOut(tokens=tokens("b", index=2).tokens, exits=(ExitOut("a", "cancelled", 2),))
    effects = core.handle(StepFinished(1, exit_a, 0.5, last=False))
    assert of(effects, StopChain) == []
    assert "a" not in core.state.rows


def test_a_cancel_of_a_row_whose_offered_join_is_unconfirmed_waits_for_the_join() -> None:
    """A row offered to the chain and cancelled before a step confirmed its join: its removal is
    offered only after the step that joined it (a removal taken first would find nothing)."""
    core = Core()
    chain_running(core, "a")
    core.handle(Admit(gen("b"), "c-b", 0.2))
    assert core.state.rows["b"].offered
    assert of(core.handle(Cancel("b", 0.25)), OfferRows) == []
    joined = StepOut(tokens=tokens("a", "b").tokens, joined=(("b", 0),), decode_rows=1)
    effects = core.handle(StepFinished(1, joined, 0.3, last=False))
    assert [o.cancels for o in of(effects, OfferRows)] == [("b",)]


def test_a_slow_reader_reaching_the_backlog_is_removed_by_the_chain() -> None:
    """A row whose held tokens reach backlog_max: its removal is offered to the running chain."""
    core = Core(backlog_max=2)
    chain_running(core, "a")
    first = TokenEvent(request_id="a", index=0, token_id=7, text="x")
    core.handle(StreamFull("a", "inbox.a", "c-a", first, 0.2))
    effects = core.handle(StepFinished(1, tokens("a", index=1), 0.3, last=False))
    assert [o.cancels for o in of(effects, OfferRows)] == [("a",)]
    assert of(effects, StopChain) == []
    assert core.state.rows["a"].slow


def test_the_gateway_asking_for_the_turn_back_stops_the_chain() -> None:
    """YieldTurn for the turn in flight sends StopChain; one for another turn changes nothing."""
    core = Core()
    chain_running(core, "a")
    assert core.handle(YieldTurn(7, 0.2)) == []
    assert of(core.handle(YieldTurn(1, 0.3)), StopChain) == [StopChain(1)]
    (report,) = of(core.handle(StepFinished(1, tokens("a"), 0.4, last=True)), ReportTurn)
    assert report.report.steps == 1
    # NOTE: the next turn chains again.
    assert of(core.handle(TurnGranted(2, 0.5, 8)), SubmitStep)[0].max_steps == 8
    assert of(core.handle(StepFinished(2, tokens("a", index=1), 0.6, last=False)), StopChain) == []


def test_stopping_the_scheduler_stops_the_chain() -> None:
    """Stopping with a chain in flight sends StopChain."""
    core = Core()
    chain_running(core, "a")
    assert of(core.handle(Stopping(0.2)), StopChain) == [StopChain(1)]


def test_a_job_that_ended_ahead_of_the_loop_goes_on_within_the_grant() -> None:
    """A job ending before the budget with rows decoding and nothing pending: the turn goes on with a new job."""
    core = Core()
    chain_running(core, "a", budget=8)
    for i in range(4):
        core.handle(StepFinished(1, tokens("a", index=i), 0.2 + i / 10, last=False))
    effects = core.handle(JobEnded(1, 0.7))
    assert of(effects, ReportTurn) == []
    assert of(effects, SubmitStep) == [SubmitStep(1, (), (), 4)]
    assert core.state.in_flight == 1
    for i in range(4, 8):
        effects = core.handle(StepFinished(1, tokens("a", index=i), 0.8 + i / 10, last=i == 7))
    (report,) = of(effects, ReportTurn)
    assert report.report.steps == 8
    assert core.state.stats.steps == 8


def test_a_single_step_grant_never_sends_stop_chain() -> None:
    """With max_steps=1 (the serial lane has work) a join or cancel needs no StopChain: the job is one step."""
    core = Core()
    for rid in ("a", "b"):
        core.handle(Admit(gen(rid), f"c-{rid}", 0.0))
    (submit,) = of(core.handle(TurnGranted(1, 0.1)), SubmitStep)
    assert submit.max_steps == 1
    assert submit.joins == (JoinRow(gen("a")), JoinRow(gen("b")))
    for effects in (core.handle(Cancel("a", 0.2)), core.handle(Admit(gen("c"), "c-c", 0.25))):
        assert of(effects, StopChain) == []
        assert of(effects, OfferRows) == []
    (report,) = of(core.handle(StepFinished(1, tokens("a", "b"), 0.3)), ReportTurn)
    assert report.report.steps == 1
    assert report.report.ready


def test_rows_handed_back_after_their_turn_failed_do_not_raise() -> None:
    """A refused offer whose turn ended first (its job could not start: StepFailed, which fails
    every joined row, the offered one too) is ignored: no exception, no row comes back."""
    core = Core()
    chain_running(core, "a")
    core.handle(Admit(gen("b"), "c-b", 0.2))
    effects = core.handle(StepFailed(1, "engine_unavailable", "gone", 0.25))
    ended = {e.final.request_id for e in of(effects, EndStream)}
    assert ended == {"a", "b"}
    assert of(core.handle(RowsReturned(1, ("b",), (), 0.3)), SubmitStep) == []
    assert core.state.rows == {}
