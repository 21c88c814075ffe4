"""Batch step chains in the scheduler's sans-IO core: when a turn's steps run back to back and when they stop."""

from __future__ import annotations

from typing import Any

from actors.batch_scheduler.core import (
    Admit,
    Cancel,
    Effect,
    EmitToken,
    Event,
    ExitOut,
    JobEnded,
    JoinRow,
    LookupAnswered,
    ReportTurn,
    SchedulerState,
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


def test_a_row_ready_mid_chain_stops_it_and_joins_at_the_next_grant() -> None:
    """A lookup answered mid-chain sends StopChain once; the report says ready; the next grant joins it."""
    core = Core(lookups=True)
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.0))
    core.handle(TurnGranted(1, 0.1, 8))
    core.handle(StepFinished(1, tokens("a"), 0.2, last=False))
    assert of(core.handle(Admit(gen("b"), "c-b", 0.25)), StopChain) == []  # lookup pending
    assert of(core.handle(LookupAnswered("b", None, 0.3)), StopChain) == [StopChain(1)]
    # NOTE: told once: later events of the same turn do not repeat it.
    assert of(core.handle(StepFinished(1, tokens("a", index=1), 0.4, last=False)), StopChain) == []
    (report,) = of(core.handle(JobEnded(1, 0.5)), ReportTurn)
    assert report.report.ready
    assert report.report.steps == 2
    (submit,) = of(core.handle(TurnGranted(2, 0.6, 8)), SubmitStep)
    assert [j.request.request_id for j in submit.joins] == ["b"]
    assert of(core.handle(StepFinished(2, tokens("a", index=2), 0.7, last=False)), StopChain) == []


def test_a_cancel_mid_chain_stops_it_and_the_next_job_removes_the_row() -> None:
    """Cancelling a joined row stops the chain; the next grant's job cancels it first, and chains on."""
    core = Core()
    chain_running(core, "a", "b")
    core.handle(StepFinished(1, tokens("a", "b"), 0.2, last=False))
    assert of(core.handle(Cancel("a", 0.25)), StopChain) == [StopChain(1)]
    core.handle(StepFinished(1, tokens("a", "b", index=1), 0.3, last=True))
    (submit,) = of(core.handle(TurnGranted(2, 0.4, 8)), SubmitStep)
    assert submit.cancels == ("a",)
    assert submit.max_steps == 8
    # NOTE: the removal is in this job's first step: it does not stop the new chain.
    exit_a = StepOut(tokens=tokens("b", index=2).tokens, exits=(ExitOut("a", "cancelled", 2),))
    effects = core.handle(StepFinished(2, exit_a, 0.5, last=False))
    assert of(effects, StopChain) == []
    assert "a" not in core.state.rows


def test_a_slow_reader_reaching_the_backlog_stops_the_chain() -> None:
    """A row whose held tokens reach backlog_max must be removed by a new job: StopChain."""
    core = Core(backlog_max=2)
    chain_running(core, "a")
    first = TokenEvent(request_id="a", index=0, token_id=7, text="x")
    core.handle(StreamFull("a", "inbox.a", "c-a", first, 0.2))
    effects = core.handle(StepFinished(1, tokens("a", index=1), 0.3, last=False))
    assert of(effects, StopChain) == [StopChain(1)]
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
    assert of(core.handle(Cancel("a", 0.2)), StopChain) == []
    assert of(core.handle(Admit(gen("c"), "c-c", 0.25)), StopChain) == []
    (report,) = of(core.handle(StepFinished(1, tokens("a", "b"), 0.3)), ReportTurn)
    assert report.report.steps == 1
    assert report.report.ready
