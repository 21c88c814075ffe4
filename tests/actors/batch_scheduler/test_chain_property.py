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
    OfferRows,
    ReportTurn,
    RowsReturned,
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
    """The scripted engine's job in flight: what its next step takes, and what it did."""

    turn: int
    left: int
    joins: list[str]
    cancels: list[str]
    stopped: bool = False
    closed: bool = False
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
                ["admit", "lookup", "cancel", "grant", "step", "close", "end", "yield", "alarm"]
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
    for the running job and once, no new job for a turn the gateway asked back, and every row the
    core counts joined is in the engine's batch or waits in the job for its next step (none lost,
    none joined twice), with rows offered to running chains and handed back by closed ones."""
    state = SchedulerState(max_rows=3, max_queue=2, lookups=True, gather_s=0.5)
    turn = 0
    budgets: dict[int, int] = {}
    steps: dict[int, int] = {}
    reports: dict[int, int] = {}
    stops = 0
    yielded: set[int] = set()
    job: Job | None = None
    in_batch: set[str] = set()
    now = 0.0
    for n, (what, rid, k) in enumerate(script):
        now += 0.1
        events: list[Event] = []
        if what == "admit":
            events.append(Admit(gen(rid), f"c-{rid}", now))
        elif what == "lookup":
            row = state.rows.get(rid)
            if row is not None and row.phase == "lookup":
                events.append(LookupAnswered(rid, TakeResult(lease_id=f"L{n}"), now))
        elif what == "cancel":
            events.append(Cancel(rid, now))
        elif what == "grant":
            if state.in_flight is None and state.ready:
                turn += 1
                budgets[turn] = k
                events.append(TurnGranted(turn, now, k))
        elif what == "yield":
            if state.in_flight is not None:
                yielded.add(state.in_flight)
            events.append(YieldTurn(turn, now))
        elif what == "alarm":
            events.append(GatherDue(now))
        elif job is not None and what == "step" and job.left > 0 and not job.closed:
            # NOTE: the scripted engine: a step cancels, then joins what it was given; rows
            # finish when their id matches; a job closes by itself at its budget, a stop or an
            # empty batch (and on "close", like a chain AHEAD of the loop).
            cancels, joins = job.cancels, job.joins
            job.cancels, job.joins = [], []
            exits = [ExitOut(r, "cancelled", 1) for r in cancels if r in in_batch]
            in_batch.difference_update(cancels)
            assert not in_batch & set(joins), "a row joined twice"
            in_batch.update(joins)
            tokens = tuple(TokenOut(r, 0, 1, "x") for r in sorted(in_batch))
            if rid in in_batch:
                exits.append(ExitOut(rid, "length", 1))
                in_batch.discard(rid)
            job.steps += 1
            job.left -= 1
            last = job.left == 0 or job.stopped or not in_batch
            out = StepOut(
                tokens=tokens,
                exits=tuple(exits),
                joined=tuple((r, 0) for r in joins),
                decode_rows=len(tokens),
            )
            events.append(StepFinished(job.turn, out, now, last))
            steps[job.turn] = steps.get(job.turn, 0) + 1
            if last:
                job = None
        elif job is not None and what == "close" and job.steps > 0:
            job.closed = True
        elif job is not None and what == "end" and job.closed:
            if job.joins or job.cancels:
                events.append(RowsReturned(job.turn, tuple(job.joins), tuple(job.cancels), now))
            events.append(JobEnded(job.turn, now))
            job = None
        while events:
            event = events.pop(0)
            state, effects = handle(state, event)
            for effect in effects:
                if isinstance(effect, SubmitStep):
                    assert job is None, "a second job while one runs"
                    assert effect.turn not in yielded, "a new job for a turn the gateway asked back"
                    job = Job(
                        effect.turn,
                        effect.max_steps,
                        [j.request.request_id for j in effect.joins],
                        list(effect.cancels),
                    )
                    stops = 0
                elif isinstance(effect, OfferRows):
                    rids = tuple(j.request.request_id for j in effect.joins)
                    if job is None or job.closed or job.turn != effect.turn:
                        events.append(RowsReturned(effect.turn, rids, effect.cancels, now))
                    else:
                        assert not (set(rids) & (in_batch | set(job.joins))), "offered twice"
                        job.joins.extend(rids)
                        job.cancels.extend(effect.cancels)
                elif isinstance(effect, StopChain):
                    assert effect.turn == state.in_flight, "StopChain for a turn not in flight"
                    stops += 1
                    assert stops == 1, "StopChain twice for one job"
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
        joined = {r for r, row in state.rows.items() if row.phase == "joined"}
        waiting = set(job.joins) if job is not None else set()
        assert joined == in_batch | waiting, "a joined row is neither in the batch nor waiting"
    if state.in_flight is None:
        assert set(reports) == set(budgets), "a granted turn was never reported"
