"""Step chains under random event orders: the core against a scripted engine that runs chains as told."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.batch_scheduler.core import (
    Admit,
    Cancel,
    Effect,
    Event,
    ExitOut,
    GatherDue,
    JobEnded,
    LookupAnswered,
    ReportTurn,
    SchedulerState,
    StepFinished,
    StepOut,
    StopChain,
    SubmitStep,
    TokenOut,
    TurnGranted,
    YieldTurn,
    handle,
)
from messages.gateway import Generate, GenerationParams
from messages.prompt_cache import TakeResult

_IDS = ["a", "b", "c", "d"]


@dataclass
class Job:
    """The scripted engine's job in flight: what it was told and what it did."""

    turn: int
    left: int
    joins: tuple[str, ...]
    cancels: tuple[str, ...]
    stopped: bool = False
    steps: int = 0


def gen(rid: str) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(range(1, 9)),
        params=GenerationParams(max_tokens=64),
        stream_to=f"inbox.{rid}",
    )


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["admit", "lookup", "cancel", "grant", "step", "ahead", "end", "yield", "alarm"]
            ),
            st.sampled_from(_IDS),
            st.integers(min_value=1, max_value=5),
        ),
        min_size=30,
        max_size=80,
    )
)
def test_random_events_keep_the_chain_invariants(script: list[tuple[str, str, int]]) -> None:
    """Any order: one job at a time, at most max_steps steps and one report per turn, StopChain only
    for the running turn and once, no new job for a turn told to stop, joins only at a grant."""
    state = SchedulerState(max_rows=3, max_queue=2, lookups=True, gather_s=0.5)
    turn = 0
    budgets: dict[int, int] = {}
    steps: dict[int, int] = {}
    reports: dict[int, int] = {}
    stops: dict[int, int] = {}
    job: Job | None = None
    in_batch: set[str] = set()
    now = 0.0
    for n, (what, rid, k) in enumerate(script):
        now += 0.1
        event: Event | None = None
        if what == "admit":
            event = Admit(gen(rid), f"c-{rid}", now)
        elif what == "lookup":
            row = state.rows.get(rid)
            if row is not None and row.phase == "lookup":
                event = LookupAnswered(rid, TakeResult(lease_id=f"L{n}"), now)
        elif what == "cancel":
            event = Cancel(rid, now)
        elif what == "grant":
            if state.in_flight is None and state.ready:
                turn += 1
                budgets[turn] = k
                event = TurnGranted(turn, now, k)
        elif what == "yield":
            event = YieldTurn(turn, now)
        elif what == "alarm":
            event = GatherDue(now)
        elif job is not None and what in ("step", "ahead") and job.left > 0:
            # NOTE: the scripted engine: the first step cancels, then joins; rows finish
            # when their id matches (by length), and a step may end the job early ("ahead").
            first = job.steps == 0
            exits = [ExitOut(r, "cancelled", 1) for r in job.cancels if first and r in in_batch]
            in_batch.difference_update(job.cancels if first else ())
            if first:
                in_batch.update(job.joins)
            tokens = tuple(TokenOut(r, 0, 1, "x") for r in sorted(in_batch))
            if rid in in_batch:
                exits.append(ExitOut(rid, "length", 1))
                in_batch.discard(rid)
            job.steps += 1
            job.left -= 1
            last = job.left == 0 or job.stopped or not in_batch or what == "ahead"
            joined = tuple((r, 0) for r in job.joins) if first else ()
            out = StepOut(tokens=tokens, exits=tuple(exits), joined=joined, decode_rows=len(tokens))
            event = StepFinished(job.turn, out, now, last)
            steps[job.turn] = steps.get(job.turn, 0) + 1
            if last:
                job = None
        elif job is not None and what == "end" and job.steps > 0:
            event = JobEnded(job.turn, now)
            job = None
        if event is None:
            continue
        state, effects = handle(state, event)
        for effect in effects:
            if isinstance(effect, SubmitStep):
                assert job is None, "a second job while one runs"
                assert stops.get(effect.turn, 0) == 0, "a new job for a turn told to stop"
                if effect.joins or effect.cancels:
                    assert isinstance(event, TurnGranted), "joins or cancels outside a grant"
                job = Job(
                    effect.turn,
                    effect.max_steps,
                    tuple(j.request.request_id for j in effect.joins),
                    effect.cancels,
                )
            elif isinstance(effect, StopChain):
                assert effect.turn == state.in_flight, "StopChain for a turn not in flight"
                stops[effect.turn] = stops.get(effect.turn, 0) + 1
                assert stops[effect.turn] == 1, "StopChain twice for one turn"
                if job is not None and job.turn == effect.turn:
                    job.stopped = True
            elif isinstance(effect, ReportTurn):
                t = effect.report.turn
                reports[t] = reports.get(t, 0) + 1
                assert reports[t] == 1, "a turn reported twice"
                assert effect.report.steps == steps.get(t, 0)
        for t, n_steps in steps.items():
            assert n_steps <= budgets[t], "more steps than granted"
        if state.in_flight is None:
            assert job is None
    if state.in_flight is None:
        assert set(reports) == set(budgets), "a granted turn was never reported"
