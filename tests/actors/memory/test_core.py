"""The memory actor's rules, driven with plain calls: admission, relief rounds, refusal, deadlines."""

from __future__ import annotations

import itertools
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine_thread.memory_guard import Footprint
from actors.memory import AdmissionCheck, core
from actors.memory.core import Gauges, MemoryConfig, MemoryState
from messages import Body, Envelope, Failure
from messages.gateway import RunWhenIdle, TurnDone
from messages.memory import (
    AdmitMemory,
    MemoryAdmitted,
    MemoryStats,
    MemoryStatsRequest,
    MemoryWake,
    Refuse,
    Relieve,
    Relieved,
)
from messages.prompt_cache import Demote, DemoteResult, PromptCacheStats, PromptCacheStatsRequest
from messages.spill_queue import DrainSpills, SpillQueueStats, SpillQueueStatsRequest, SpillsDrained

BUDGET = 1_000_000
DEMAND = 512_000
"""AdmitMemory(prompt 100, max 28) under 1,000 KV bytes per token: 256 tokens' KV twice."""

_ids = itertools.count()


B = TypeVar("B", bound=Body)


def _filled(cls: type[B], **values: object) -> B:
    """``cls`` with ``values`` and every other required field 0."""
    zeros = {name: 0 for name, f in cls.model_fields.items() if f.is_required()}
    return cls.model_validate({**zeros, **values})


def _state(**overrides: object) -> MemoryState:
    values: dict[str, object] = {
        "budget": BUDGET, "footprint": Footprint(kv_bytes_at=lambda n: 1000 * n, chunk=512),
        "settle_step": "memory.settle", "release_step": "memory.release",
        "prompt_cache": True, "spill_queue": True, "reply_timeout_s": 5.0,
    }
    values.update(overrides)
    return MemoryState(config=MemoryConfig(**values))  # type: ignore[arg-type]


def _env(body: Body, correlation: str = "c") -> Envelope:
    return Envelope(msg_id=f"m{next(_ids)}", correlation_id=correlation, causation_id=None,
                    sender="x", receiver="memory", sent_at=0.0, body=body)


def _admit(rid: str = "r1") -> AdmitMemory:
    return AdmitMemory(request_id=rid, prompt_tokens=100, max_tokens=28)


def _feed(state: MemoryState, body: Body, now: float, active: int,
          correlation: str = "c") -> list[core.Effect]:
    _, effects = core.handle(state, core.Received(_env(body, correlation), now, Gauges(active)))
    return effects


def _asks(effects: list[core.Effect]) -> list[core.Ask]:
    return [e for e in effects if isinstance(e, core.Ask)]


def _answers(effects: list[core.Effect]) -> list[Body]:
    return [e.body for e in effects if isinstance(e, core.Answer)]


def test_a_request_that_fits_is_admitted_at_once_without_asking_anyone() -> None:
    """Active + demand within the budget: MemoryAdmitted in the same step, no ask, no job."""
    state = _state()
    effects = _feed(state, _admit(), 0.0, BUDGET - DEMAND)
    assert _answers(effects) == [MemoryAdmitted(request_id="r1")]
    assert _asks(effects) == []
    assert state.job is None


def test_admission_counts_the_running_requests_growth_beside_the_reading() -> None:
    """A request that fits the reading alone but not beside what the running requests may
    still add is not admitted at once: it goes to a relief whose need counts that growth
    (the check before its prefill would count it and could not relieve)."""
    state = _state()
    active, ahead = BUDGET - DEMAND - 50_000, (("batch", 100_000), ("serial", 50_000))
    gauges = Gauges(active, ahead=ahead)
    assert gauges.in_use == active + 150_000
    assert not core.fits_now(state.config, gauges, _admit())
    assert core.fits_now(state.config, Gauges(active), _admit())

    def feed(body: Body, now: float, correlation: str = "c") -> list[core.Effect]:
        _, effects = core.handle(state, core.Received(_env(body, correlation), now, gauges))
        return effects

    effects = feed(_admit(), 0.0)
    assert _answers(effects) == []
    (settle,) = _asks(effects)
    (measure,) = _asks(feed(TurnDone(step_id="memory.settle", ok=True), 0.1, settle.ref))
    stats = _filled(PromptCacheStats, entries=3, bytes=300_000)
    (demote,) = _asks(feed(stats, 0.2, measure.ref))
    assert demote.body == Demote(max_bytes=100_000, dispose_without_tier=True)


def test_a_request_refused_in_turn_is_never_admitted_at_once_on_the_reading() -> None:
    """An AdmitMemory marked refused_in_turn (the in-turn guard contradicted the reading it
    fitted) is not answered at once even where the reading fits: it settles first and is
    decided on the reading after that turn (admitted here); readmissions counts it."""
    state = _state()
    again = AdmitMemory(request_id="r1", prompt_tokens=100, max_tokens=28, refused_in_turn=True)
    effects = _feed(state, again, 0.0, BUDGET - DEMAND)
    assert _answers(effects) == []
    (settle,) = _asks(effects)
    assert isinstance(settle.body, RunWhenIdle)
    assert settle.body.step_id == "memory.settle"
    effects = _feed(state, TurnDone(step_id="memory.settle", ok=True), 0.1, BUDGET - DEMAND,
                    settle.ref)
    (measure,) = _asks(effects)
    stats = _filled(PromptCacheStats, entries=0, bytes=0)
    assert _answers(_feed(state, stats, 0.2, BUDGET - DEMAND, measure.ref)) == [
        MemoryAdmitted(request_id="r1")]
    (report,) = _answers(_feed(state, MemoryStatsRequest(), 0.3, 0))
    assert isinstance(report, MemoryStats)
    assert report.readmissions == 1


def test_an_over_budget_request_settles_measures_demotes_drains_releases_and_is_admitted() -> None:
    """The relief sequence in order; the need asked for is the bytes over the budget; the
    reading after the release turn decides; the counters count what the RAM tier handed back."""
    state = _state()
    active = BUDGET - DEMAND + 112_000
    effects = _feed(state, _admit(), 0.0, active)
    (settle,) = _asks(effects)
    assert settle.to == "gateway"
    assert isinstance(settle.body, RunWhenIdle)
    assert settle.body.step_id == "memory.settle"
    assert settle.body.deadline == 5.0
    effects = _feed(state, TurnDone(step_id="memory.settle", ok=True), 0.1, active, settle.ref)
    (measure,) = _asks(effects)
    assert (measure.to, measure.body) == ("prompt_cache", PromptCacheStatsRequest())
    stats = _filled(PromptCacheStats, entries=3, bytes=300_000)
    (demote,) = _asks(_feed(state, stats, 0.2, active, measure.ref))
    assert demote.body == Demote(max_bytes=112_000, dispose_without_tier=True)
    moved = DemoteResult(spilled=2, spilled_bytes=150_000)
    (drain,) = _asks(_feed(state, moved, 0.3, active, demote.ref))
    assert (drain.to, drain.body) == ("spill_queue", DrainSpills())
    drained = _filled(SpillsDrained, stored=2, dropped=0, failed=0)
    (release,) = _asks(_feed(state, drained, 0.4, active, drain.ref))
    assert isinstance(release.body, RunWhenIdle)
    assert release.body.step_id == "memory.release"
    freed = active - 150_000
    effects = _feed(state, TurnDone(step_id="memory.release", ok=True), 0.5, freed, release.ref)
    (measure2,) = _asks(effects)
    effects = _feed(state, _filled(PromptCacheStats, entries=1, bytes=150_000), 0.6,
                    freed, measure2.ref)
    assert _answers(effects) == [MemoryAdmitted(request_id="r1", relieved_bytes=150_000)]
    assert (state.relieved_entries, state.relieved_bytes, state.refused) == (2, 150_000, 0)
    assert state.job is None


def test_nothing_reclaimable_refuses_with_the_budget_in_the_message() -> None:
    """Over budget and the RAM tier indexes nothing: Refuse (counted), no demotion asked."""
    state = _state(settle_step=None)
    effects = _feed(state, _admit(), 0.0, BUDGET)
    (measure,) = _asks(effects)
    effects = _feed(state, _filled(PromptCacheStats, entries=0, bytes=0), 0.1, BUDGET,
                    measure.ref)
    (refused,) = _answers(effects)
    assert isinstance(refused, Refuse)
    assert "memory budget" in refused.detail
    assert _asks(effects) == []
    assert state.refused == 1


@pytest.mark.parametrize(("at_start", "later"), [(BUDGET - DEMAND, True),
                                                 (BUDGET - DEMAND + 1, False)])
def test_a_refusal_says_whether_the_request_fits_beside_the_memory_at_rest(
    at_start: int, later: bool
) -> None:
    """Refused with nothing reclaimable, the answer says may_fit_later exactly when the demand
    fits beside the least reading seen (seeded by the engine's reading at start): memory that
    running requests hold may come back, the rest never will."""
    state = _state(settle_step=None)
    busy = Gauges(BUDGET, resident_at_start=at_start)
    _, effects = core.handle(state, core.Received(_env(_admit()), 0.0, busy))
    (measure,) = _asks(effects)
    stats = _env(_filled(PromptCacheStats, entries=0, bytes=0), measure.ref)
    _, effects = core.handle(state, core.Received(stats, 0.1, busy))
    (refused,) = _answers(effects)
    assert isinstance(refused, Refuse)
    assert refused.may_fit_later is later
    # NOTE: one that may fit later is not a failure: the asker waits.
    assert (state.busy, state.refused) == ((1, 0) if later else (0, 1))


def test_a_demotion_that_hands_nothing_back_refuses_after_one_round() -> None:
    """Entries indexed but all leased: the demotion hands 0 bytes, the next decision refuses."""
    state = _state(settle_step=None, spill_queue=False)
    (measure,) = _asks(_feed(state, _admit(), 0.0, BUDGET))
    stats = _filled(PromptCacheStats, entries=1, bytes=10**6)
    (demote,) = _asks(_feed(state, stats, 0.1, BUDGET, measure.ref))
    effects = _feed(state, DemoteResult(leased=1), 0.2, BUDGET, demote.ref)
    (refused,) = _answers(effects)
    assert isinstance(refused, Refuse)
    assert state.refused == 1


def test_relief_stops_after_the_configured_rounds() -> None:
    """Every round hands bytes back but memory never falls: refused after ``rounds`` demotions."""
    state = _state(settle_step=None, release_step=None, spill_queue=False, rounds=2)
    (ask,) = _asks(_feed(state, _admit(), 0.0, BUDGET))
    demotions = 0
    for step in range(10):
        body: Body
        if isinstance(ask.body, PromptCacheStatsRequest):
            body = _filled(PromptCacheStats, entries=5, bytes=10**6)
        else:
            demotions += 1
            body = DemoteResult(disposed=1, disposed_bytes=1000)
        effects = _feed(state, body, 0.1 * step, BUDGET, ask.ref)
        if _answers(effects):
            break
        (ask,) = _asks(effects)
    (refused,) = _answers(effects)
    assert isinstance(refused, Refuse)
    assert refused.detail == core.AFTER_RELIEF_MESSAGE
    assert demotions == 2


def test_one_relief_at_a_time_and_a_request_that_fits_is_not_held_behind_it() -> None:
    """A second over-budget admission waits for the first job's answer; a fitting one passes."""
    state = _state(settle_step=None)
    (first,) = _asks(_feed(state, _admit("r1"), 0.0, BUDGET))
    assert _asks(_feed(state, _admit("r2"), 0.1, BUDGET)) == []
    small = AdmitMemory(request_id="r3", prompt_tokens=1, max_tokens=1)
    assert _answers(_feed(state, small, 0.2, 0)) == [MemoryAdmitted(request_id="r3")]
    effects = _feed(state, _filled(PromptCacheStats, entries=0, bytes=0), 0.3, BUDGET,
                    first.ref)
    assert [type(b) for b in _answers(effects)] == [Refuse]
    (second,) = _asks(effects)  # NOTE: r2's job starts right after r1's answer.
    assert second.body == PromptCacheStatsRequest()


def test_a_missed_deadline_or_a_refused_turn_counts_as_nothing_done() -> None:
    """The settle turn's answer never comes: at its deadline the job measures anyway; a late
    answer is ignored; a Failure from the RAM tier reads as nothing reclaimable (refuse)."""
    state = _state()
    (settle,) = _asks(_feed(state, _admit(), 0.0, BUDGET))
    assert state.alarm_at == 5.0
    (measure,) = _asks(_feed(state, MemoryWake(), 5.0, BUDGET))
    assert measure.body == PromptCacheStatsRequest()
    assert state.timeouts == 1
    assert _feed(state, TurnDone(step_id="memory.settle", ok=True), 5.1, BUDGET, settle.ref) == []
    failure = _filled(Failure, error="HandlerFailed: boom")
    effects = _feed(state, failure, 5.2, BUDGET, measure.ref)
    assert [type(b) for b in _answers(effects)] == [Refuse]


def test_relieve_reports_the_spill_queues_settled_counts_since_the_demotion() -> None:
    """Relieve(wait): stats before, the demotion as asked, the drain; the answer is the difference."""
    state = _state()
    relieve = Relieve(idle_s=2.0, max_bytes=500, wait=True, timeout_s=7.0)
    (before,) = _asks(_feed(state, relieve, 0.0, 0))
    assert before.body == SpillQueueStatsRequest()
    old = _filled(SpillQueueStats, stored=4, dropped=1, failed=0)
    (demote,) = _asks(_feed(state, old, 0.1, 0, before.ref))
    assert demote.body == Demote(idle_s=2.0, max_bytes=500)
    result = DemoteResult(spilled=3, spilled_bytes=300)
    (drain,) = _asks(_feed(state, result, 0.2, 0, demote.ref))
    effects = _feed(state, _filled(SpillsDrained, stored=6, dropped=2, failed=1), 0.3, 0, drain.ref)
    assert _answers(effects) == [Relieved(result=result, stored=2, dropped=1, failed=1)]
    assert state.relieved_bytes == 0  # NOTE: an embedder's demotion is not a relief.


def test_stopping_answers_every_waiting_asker() -> None:
    """The running and the queued admissions are refused, a queued Relieve gets its error."""
    state = _state()
    _feed(state, _admit("r1"), 0.0, BUDGET)
    _feed(state, _admit("r2"), 0.0, BUDGET)
    _feed(state, Relieve(), 0.0, BUDGET)
    _, effects = core.handle(state, core.Stopping(1.0, Gauges(BUDGET)))
    bodies = _answers(effects)
    assert [type(b) for b in bodies] == [Refuse, Refuse, Relieved]
    assert isinstance(bodies[2], Relieved)
    assert bodies[2].result is None
    assert bodies[2].error
    assert core.SetAlarm(None) in effects


def test_stats_combine_the_gauges_with_the_actors_counters() -> None:
    """MemoryStats carries the reading's figures as read and the admission counters."""
    state = _state(settle_step=None)
    state.refused, state.relieved_entries = 2, 5
    gauges = Gauges(active=123, samples=9, checks=4, refused=1, settled=1,
                    mlx_parts=(10, 20, 30), device_used=40, heap_trims=3, heap_trim_s=0.123456)
    _, effects = core.handle(state, core.Received(_env(MemoryStatsRequest()), 0.0, gauges))
    (stats,) = _answers(effects)
    assert isinstance(stats, MemoryStats)
    assert (stats.budget_bytes, stats.active_bytes, stats.samples) == (BUDGET, 123, 9)
    assert (stats.refused_at_admission, stats.relieved_entries) == (2, 5)
    assert (stats.mlx_active_bytes, stats.mlx_cache_bytes, stats.mlx_peak_bytes) == (10, 20, 30)
    assert stats.device_used_bytes == 40
    assert (stats.heap_trims, stats.heap_trim_s) == (3, 0.1235)
    assert (stats.growth_ahead_bytes, stats.growth_ahead_by_lane) == (0, {})
    gauges = Gauges(active=123, ahead=(("batch", 7), ("serial", 5)))
    _, effects = core.handle(state, core.Received(_env(MemoryStatsRequest()), 0.1, gauges))
    (stats,) = _answers(effects)
    assert isinstance(stats, MemoryStats)
    assert (stats.growth_ahead_bytes, stats.growth_ahead_by_lane) == (12, {"batch": 7,
                                                                           "serial": 5})


def _answer_to(ask: core.Ask, size: int, ok: bool) -> Body:
    """A plausible answer to ``ask`` (``ok`` False: a Failure)."""
    if not ok:
        return _filled(Failure, error="HandlerFailed: scripted")
    body = ask.body
    if isinstance(body, RunWhenIdle):
        return TurnDone(step_id=body.step_id, ok=True)
    if isinstance(body, PromptCacheStatsRequest):
        return _filled(PromptCacheStats, bytes=size)
    if isinstance(body, Demote):
        return DemoteResult(disposed=1 if size else 0, disposed_bytes=size)
    if isinstance(body, SpillQueueStatsRequest):
        return _filled(SpillQueueStats, stored=size)
    assert isinstance(body, DrainSpills)
    return _filled(SpillsDrained, stored=size)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "small", "relieve", "answer", "fail",
                                           "late", "wake", "stats"]),
                          st.integers(0, 2 * BUDGET)), max_size=40))
def test_every_asker_gets_exactly_one_answer_and_one_ask_is_out_at_a_time(
    steps: list[tuple[str, int]],
) -> None:
    """Random admissions, reliefs, answers, failures, late replies and deadlines: at most one
    job runs with at most one ask out; after a stop every AdmitMemory and Relieve was answered
    exactly once (admitted or refused / relieved)."""
    state = _state()
    asked: dict[str, int] = {}
    answered: dict[str, int] = {}
    out: core.Ask | None = None
    now = 0.0
    for kind, size in steps:
        now += 0.01
        effects: list[core.Effect] = []
        if kind in ("admit", "small", "relieve", "stats"):
            body: Body = {
                "admit": _admit(f"r{len(asked)}"),
                "small": AdmitMemory(request_id=f"r{len(asked)}", prompt_tokens=1, max_tokens=0),
                "relieve": Relieve(max_bytes=size),
                "stats": MemoryStatsRequest(),
            }[kind]
            envelope = _env(body)
            if kind != "stats":
                asked[envelope.msg_id] = 0
            _, effects = core.handle(state, core.Received(envelope, now, Gauges(size)))
        elif kind in ("answer", "fail") and out is not None:
            reply = _answer_to(out, size % BUDGET, kind == "answer")
            effects = _feed(state, reply, now, size, out.ref)
        elif kind == "late":
            effects = _feed(state, TurnDone(step_id="old", ok=True), now, size, "mem-old")
        elif kind == "wake":
            now += 10.0
            effects = _feed(state, MemoryWake(), now, size)
        for effect in effects:
            if isinstance(effect, core.Answer) and effect.request.msg_id in asked:
                answered[effect.request.msg_id] = answered.get(effect.request.msg_id, 0) + 1
        asks = _asks(effects)
        assert len(asks) <= 1
        if asks:
            out = asks[0]
        # NOTE: a queued job starts as soon as none runs.
        assert state.job is not None or not state.queue
    _, effects = core.handle(state, core.Stopping(now + 1, Gauges(0)))
    for effect in effects:
        if isinstance(effect, core.Answer) and effect.request.msg_id in asked:
            answered[effect.request.msg_id] = answered.get(effect.request.msg_id, 0) + 1
    assert answered == dict.fromkeys(asked, 1)


def test_the_admission_check_uses_the_actors_rule_on_the_latest_reading() -> None:
    """AdmissionCheck.fits agrees with the core: fits at the budget's edge, not one byte over;
    without a guard everything fits."""

    class Port:
        def __init__(self, active: int) -> None:
            self.active = active

        def read(self) -> Gauges:
            return Gauges(active=self.active)

    config = _state().config
    edge = Port(BUDGET - DEMAND)
    check = AdmissionCheck(config, edge)
    assert check.fits(_admit())
    edge.active += 1
    assert not check.fits(_admit())
    assert not core.fits_now(config, Gauges(BUDGET - DEMAND + 1), _admit())
    assert AdmissionCheck(MemoryConfig(), Port(10 * BUDGET)).fits(_admit())


def test_the_gauges_read_rss_now_when_it_is_above_the_latest_reading() -> None:
    """A job in flight has grown memory the latest reading (taken at a job's end) does not show:
    the gauges' ``active`` is RSS now where that is higher, so neither the fast path nor the
    actor admits at once on the stale figure; a lower RSS (or none) leaves the reading."""
    from actors.engine_thread.memory_guard import Footprint, MemoryGauge, MemoryGuard
    from actors.memory.ports import GuardGauges

    class Reading:
        resident: int | None = None
        mlx = 0
        resident_at_start: int | None = None
        mlx_parts: tuple[int, int, int] | None = None
        device_used: int | None = None
        now: int | None = BUDGET - DEMAND + 1

        def resident_now(self) -> int | None:
            return self.now

    gauge = MemoryGauge(lambda: BUDGET - DEMAND)
    gauge.sample()
    guard = MemoryGuard(budget=BUDGET, footprint=Footprint(kv_bytes_at=lambda n: 1000 * n,
                                                           chunk=512), gauge=gauge)
    reading = Reading()
    gauges = GuardGauges(guard, reading)
    check = AdmissionCheck(_state().config, gauges)
    assert gauges.read().active == BUDGET - DEMAND + 1
    assert not check.fits(_admit())
    reading.now = 0
    assert gauges.read().active == BUDGET - DEMAND
    assert check.fits(_admit())
    reading.now = None
    assert check.fits(_admit())


def test_the_gauges_carry_the_guards_growth_ledger_to_the_admission_check() -> None:
    """What a lane publishes into the guard's growth ledger reaches ``Gauges.ahead`` by lane,
    and a request that fits the reading stops fitting at once once the running requests'
    growth leaves it no room; a lane's figure back to 0 makes it fit again."""
    from actors.engine_thread.memory_guard import Footprint, MemoryGauge, MemoryGuard
    from actors.memory.ports import GuardGauges

    gauge = MemoryGauge(lambda: BUDGET - DEMAND - 10)
    gauge.sample()
    guard = MemoryGuard(budget=BUDGET, footprint=Footprint(kv_bytes_at=lambda n: 1000 * n,
                                                           chunk=512), gauge=gauge)
    gauges = GuardGauges(guard)
    check = AdmissionCheck(_state().config, gauges)
    assert check.fits(_admit())
    guard.ahead.publish("batch", 11)
    guard.ahead.publish("serial", 0)
    assert gauges.read().ahead == (("batch", 11), ("serial", 0))
    assert not check.fits(_admit())
    guard.ahead.publish("batch", 0)
    assert check.fits(_admit())
