"""Rows arriving together start together: an idle batch's ready rows wait (bounded) for the other lookups."""

from __future__ import annotations

from typing import Any

from actors.batch_scheduler.core import (
    Admit,
    ArmGather,
    Arriving,
    Effect,
    Event,
    ExitOut,
    GatherDue,
    LookupAnswered,
    OfferRows,
    SchedulerState,
    Status,
    StepFinished,
    StepOut,
    SubmitStep,
    TokenOut,
    TurnGranted,
    handle,
)
from messages.gateway import Generate, GenerationParams


def gen(rid: str, n: int = 8) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(range(1, n + 1)),
        params=GenerationParams(max_tokens=8),
        stream_to=f"inbox.{rid}",
    )


class Core:
    """The state plus ``handle`` as one object, so each test reads as a script of events."""

    def __init__(self) -> None:
        self.state = SchedulerState(max_rows=4, max_queue=4, lookups=True, gather_s=0.02)

    def handle(self, event: Event) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def joined(effects: list[Effect]) -> list[str]:
    (submit,) = of(effects, SubmitStep)
    return [j.request.request_id for j in submit.joins]


def test_the_first_answer_waits_for_the_other_lookups_then_all_start_in_one_step() -> None:
    """With b's lookup pending, a's answer arms the gather alarm and says not ready; b's answer
    ends the wait (alarm cancelled, ready) and one grant joins both."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Admit(gen("b"), "c-b", 0.001))
    effects = core.handle(LookupAnswered("a", None, 0.002))
    assert of(effects, ArmGather) == [ArmGather(0.022)]
    assert not core.state.ready
    assert (
        of(effects, Status) == []
    )  # NOTE: nothing changed for the gateway: still busy, not ready.
    effects = core.handle(LookupAnswered("b", None, 0.004))
    assert of(effects, ArmGather) == [ArmGather(None)]
    assert of(effects, Status) == [Status(busy=True, ready=True)]
    assert joined(core.handle(TurnGranted(1, 0.005))) == ["a", "b"]


def test_a_slow_lookup_holds_the_others_back_only_until_the_alarm() -> None:
    """At GatherDue the ready row starts alone; a stale alarm changes nothing; the late row then
    joins a running batch without waiting."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(Admit(gen("b"), "c-b", 0.0))
    core.handle(LookupAnswered("a", None, 0.001))
    assert core.handle(GatherDue(0.01)) == []  # NOTE: before its time (a stale setting): ignored.
    effects = core.handle(GatherDue(0.021))
    assert of(effects, Status) == [Status(busy=True, ready=True)]
    assert joined(core.handle(TurnGranted(1, 0.022))) == ["a"]
    step = StepOut(prefill_tokens=8, prefilled=("a",))
    core.handle(StepFinished(1, step, 0.03))
    effects = core.handle(LookupAnswered("b", None, 0.04))
    assert of(effects, ArmGather) == []
    assert core.state.ready
    assert joined(core.handle(TurnGranted(2, 0.05))) == ["b"]


def test_a_ready_row_never_waits_while_rows_are_joined() -> None:
    """Once a row is joined, a new row's answer makes the batch ready at once, whatever lookups pend."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.001))
    core.handle(TurnGranted(1, 0.002))
    decode = StepOut(tokens=(TokenOut("a", 0, 7, "x"),), decode_rows=1)
    core.handle(StepFinished(1, decode, 0.01))
    core.handle(Admit(gen("b"), "c-b", 0.02))
    core.handle(Admit(gen("c"), "c-c", 0.02))
    effects = core.handle(LookupAnswered("b", None, 0.03))
    assert of(effects, ArmGather) == []
    assert joined(core.handle(TurnGranted(2, 0.04))) == ["b"]


def test_a_lone_request_starts_without_waiting() -> None:
    """With no other lookup pending, the answer makes the batch ready at once (no alarm)."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    effects = core.handle(LookupAnswered("a", None, 0.001))
    assert of(effects, ArmGather) == []
    assert of(effects, Status) == [Status(busy=True, ready=True)]


def test_a_ready_row_waits_for_an_announced_request_then_both_start_in_one_step() -> None:
    """b announced (still rendering) holds a's start; b's admission and lookup end the wait and
    one grant joins both; a's own announcement never holds a."""
    core = Core()
    core.handle(Arriving("a", 0.0))
    core.handle(Arriving("b", 0.001))
    core.handle(Admit(gen("a"), "c-a", 0.002))
    effects = core.handle(LookupAnswered("a", None, 0.003))
    assert of(effects, ArmGather) == [ArmGather(0.023)]
    assert not core.state.ready
    core.handle(Admit(gen("b"), "c-b", 0.01))
    effects = core.handle(LookupAnswered("b", None, 0.012))
    assert of(effects, ArmGather) == [ArmGather(None)]
    assert of(effects, Status) == [Status(busy=True, ready=True)]
    assert joined(core.handle(TurnGranted(1, 0.013))) == ["a", "b"]


def test_an_announcement_never_admitted_holds_only_until_the_alarm() -> None:
    """b announced but never admitted here (refused, or the serial lane's): a starts at the alarm."""
    core = Core()
    core.handle(Arriving("b", 0.0))
    core.handle(Admit(gen("a"), "c-a", 0.001))
    core.handle(LookupAnswered("a", None, 0.002))
    assert not core.state.ready
    effects = core.handle(GatherDue(0.022))
    assert of(effects, Status) == [Status(busy=True, ready=True)]
    assert joined(core.handle(TurnGranted(1, 0.023))) == ["a"]


def test_a_stale_announcement_holds_nobody() -> None:
    """An announcement older than the gather window is forgotten: a row ready after it starts at once."""
    core = Core()
    core.handle(Arriving("b", 0.0))
    core.handle(Admit(gen("a"), "c-a", 0.03))
    effects = core.handle(LookupAnswered("a", None, 0.031))
    assert of(effects, ArmGather) == []
    assert of(effects, Status) == [Status(busy=True, ready=True)]
    assert core.state.arriving == {}


def test_rows_arriving_as_a_chain_ends_with_no_row_left_start_together() -> None:
    """A chain still in flight whose last row just left (its answer delivered, the job not yet
    ended) holds no joined row: the next requests, sent together, wait for each other's lookups
    as in an idle batch, then are offered to it together, not the first alone a step ahead."""
    core = Core()
    core.handle(Admit(gen("a"), "c-a", 0.0))
    core.handle(LookupAnswered("a", None, 0.001))
    core.handle(TurnGranted(1, 0.002, max_steps=8))
    core.handle(StepFinished(1, StepOut(prefill_tokens=8, prefilled=("a",)), 0.01, last=False))
    done = StepOut(tokens=(TokenOut("a", 0, 7, "x", finish_reason="stop"),),
                   exits=(ExitOut("a", "stop", 1),), decode_rows=1)
    core.handle(StepFinished(1, done, 0.02, last=False))
    assert "a" not in core.state.rows
    assert core.state.in_flight == 1
    core.handle(Arriving("b", 0.021))
    core.handle(Arriving("c", 0.021))
    core.handle(Admit(gen("b"), "c-b", 0.022))
    core.handle(Admit(gen("c"), "c-c", 0.022))
    effects = core.handle(LookupAnswered("b", None, 0.023))
    assert of(effects, OfferRows) == []
    assert of(effects, ArmGather) == [ArmGather(0.043)]
    effects = core.handle(LookupAnswered("c", None, 0.024))
    (offer,) = of(effects, OfferRows)
    assert [j.request.request_id for j in offer.joins] == ["b", "c"]
