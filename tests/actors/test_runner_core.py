"""The turn runner's sans-IO core by plain calls: jobs one at a time, streaming, reports, leases, entries."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine_thread import Registered, StepResult, StepToken
from actors.gateway import runner_core as rc
from actors.gateway.burst import StepOutput
from messages import EntryMeta, TakeResult
from messages.gateway import (
    BackgroundTurnReport,
    DoneEvent,
    ErrorEvent,
    Generate,
    GenerationParams,
    RequestTurnReport,
    RunTurn,
)

REQUEST = Generate(
    request_id="r1", prompt_tokens=(1, 2, 3, 4), params=GenerationParams(max_tokens=8), stream_to="s1"
)
ENTRY = Registered("h-1", EntryMeta(offset=4, nbytes=10, trimmable=True, min_reusable_offset=0), (1, 2, 3, 4))


class Core:
    """The runner state plus ``handle``, so each test reads as a script."""

    def __init__(self, *, keep_entries: bool = True) -> None:
        self.state = rc.RunnerState(keep_entries=keep_entries)

    def handle(self, event: rc.Event) -> list[rc.Effect]:
        self.state, effects = rc.handle(self.state, event)
        return effects


def _grant(max_steps: int = 1, lookup: TakeResult | None = None, first: bool = True) -> rc.TurnGranted:
    turn = RunTurn(
        owner="request",
        ident="r1",
        start=REQUEST if first else None,
        max_steps=max_steps,
        reply_to="gateway",
        lookup=lookup,
    )
    return rc.TurnGranted(turn, "c-1", 0.0)


def _decode(n: int, finish: bool = False) -> StepOutput:
    return StepOutput(
        StepResult(phase="decode", token=StepToken(n, f"<{n}>"), finish_reason="length" if finish else None)
    )


def _kinds(effects: list[rc.Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def test_first_turn_materializes_the_lookup_and_releases_its_lease_after_opening() -> None:
    """The first StepJob carries the lookup to materialize; the lease is released once the opening step reports what it reused."""
    core = Core()
    effects = core.handle(_grant(lookup=TakeResult(lease_id="L1", handle="h", cached_tokens=3)))
    assert len(effects) == 1
    submit = effects[0]
    assert isinstance(submit, rc.Submit)
    assert isinstance(submit.job, rc.StepJob)
    opening = submit.job.opening
    assert opening is not None
    assert (opening.handle, opening.cached_tokens) == ("h", 3)
    prefill = StepOutput(StepResult(phase="prefill", prefill_complete=True), (), cached_tokens=3)
    assert core.handle(rc.StepDone(prefill, 0.1)) == [rc.ReleaseLease("L1")]
    effects = core.handle(rc.JobEnded(0.1))
    assert effects == [
        rc.Report("c-1", RequestTurnReport(request_id="r1", phase="prefill", outcome="continue", steps=1))
    ]
    assert core.state.live["r1"].cached_tokens == 3


def test_tokens_stream_one_at_a_time_and_the_finish_ends_the_stream_then_reports() -> None:
    """Each token is the last effect of its batch; the finishing step's entry is put first, its token next, then the final DoneEvent and the report."""
    core = Core()
    core.handle(_grant(max_steps=4))
    core.state.live["r1"].opened = True
    first = core.handle(rc.StepDone(_decode(1), 0.1))
    assert _kinds(first) == ["EmitToken"]
    assert core.handle(rc.TokenDelivered(0.1)) == []
    last = StepOutput(_decode(2, finish=True).result, (("completion", ENTRY),))
    effects = core.handle(rc.StepDone(last, 0.2))
    assert _kinds(effects) == ["PutEntry", "EmitToken"]
    effects = core.handle(rc.TokenDelivered(0.2))
    assert _kinds(effects) == ["EndStream"]
    end = effects[0]
    assert isinstance(end, rc.EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.usage.completion_tokens == 2
    effects = core.handle(rc.JobEnded(0.2))
    assert effects == [
        rc.Report("c-1", RequestTurnReport(request_id="r1", phase="decode", outcome="finished", steps=2))
    ]
    assert core.state.live == {}


def test_a_chain_stopped_ahead_of_the_stream_is_requeued_with_the_rest_of_the_grant() -> None:
    """When a job ends with the grant not used up (it ran ahead of the stream), the next StepJob gets the remaining budget; the turn reports all steps."""
    core = Core()
    core.handle(_grant(max_steps=5))
    for n in (1, 2):
        core.handle(rc.StepDone(_decode(n), 0.1))
        core.handle(rc.TokenDelivered(0.1))
    effects = core.handle(rc.JobEnded(0.1))
    assert len(effects) == 1
    submit = effects[0]
    assert isinstance(submit, rc.Submit)
    assert submit.job == rc.StepJob("r1", 3, "c-1", "")
    for n in (3, 4, 5):
        core.handle(rc.StepDone(_decode(n), 0.2))
        core.handle(rc.TokenDelivered(0.2))
    report = core.handle(rc.JobEnded(0.2))
    assert report == [
        rc.Report("c-1", RequestTurnReport(request_id="r1", phase="decode", outcome="continue", steps=5))
    ]


def test_preempt_stops_the_running_job_and_no_further_job_starts() -> None:
    """StopBurst sets the running job's stop flag once; outputs already made still stream; the turn then reports without re-chaining."""
    core = Core()
    submit = core.handle(_grant(max_steps=10))[0]
    assert isinstance(submit, rc.Submit)
    assert core.handle(rc.Preempt("r1", 0.1)) == [rc.StopSteps(submit.job_id)]
    core.handle(rc.StepDone(_decode(1), 0.2))
    core.handle(rc.TokenDelivered(0.2))
    assert core.handle(rc.JobEnded(0.3)) == [
        rc.Report("c-1", RequestTurnReport(request_id="r1", phase="decode", outcome="continue", steps=1))
    ]
    assert core.handle(rc.Preempt("r1", 0.4)) == []


def test_a_gone_stream_keeps_the_cache_after_the_running_job_and_reports_cancelled() -> None:
    """StreamGone stops the job; the keep job is submitted only once the running job ended (one job at a time), and the turn reports cancelled."""
    core = Core()
    submit = core.handle(_grant(max_steps=10))[0]
    assert isinstance(submit, rc.Submit)
    core.handle(rc.StepDone(_decode(1), 0.1))
    effects = core.handle(rc.StreamGone(0.1))
    assert effects == [rc.StopSteps(submit.job_id)]
    assert core.handle(rc.StepDone(_decode(2), 0.2)) == []
    effects = core.handle(rc.JobEnded(0.3))
    assert _kinds(effects) == ["Report", "Submit"]
    report, keep = effects
    assert isinstance(report, rc.Report)
    assert isinstance(report.body, RequestTurnReport)
    assert (report.body.outcome, report.body.steps) == ("cancelled", 2)
    assert isinstance(keep, rc.Submit)
    assert keep.job == rc.DropJob("r1", True, "", "c-1")
    assert core.handle(rc.JobEnded(0.4, kept=ENTRY)) == [
        rc.PutEntry("c-1", rc._put("c-1", "", "completion", ENTRY).put)
    ]


def test_a_failing_job_ends_the_stream_with_the_error_and_reports_the_failing_step() -> None:
    """An engine error fails the request: ErrorEvent as the stream's final message, its generation dropped, a failed report counting the failing step."""
    core = Core()
    core.handle(_grant(max_steps=4))
    core.handle(rc.StepDone(_decode(1), 0.1))
    core.handle(rc.TokenDelivered(0.1))
    effects = core.handle(rc.JobEnded(0.2, error=rc.JobError("RuntimeError", "boom")))
    assert _kinds(effects) == ["EndStream", "Report", "Submit"]
    end, report, drop = effects
    assert isinstance(end, rc.EndStream)
    assert end.final == ErrorEvent(
        request_id="r1", error_code="RuntimeError", detail="boom"
    )
    assert isinstance(report, rc.Report)
    assert isinstance(report.body, RequestTurnReport)
    assert (report.body.outcome, report.body.steps, report.body.phase) == ("failed", 2, "decode")
    assert isinstance(drop, rc.Submit)
    assert drop.job == rc.DropJob("r1", False, "", "c-1")


def test_a_bug_while_streaming_fails_the_turn_now_and_the_next_turn_waits_for_the_cleanup() -> None:
    """Crash fails the request and reports at once; the next turn's job queues behind the running job and the cleanup."""
    core = Core()
    core.handle(_grant(max_steps=4))
    effects = core.handle(rc.Crash(rc.JobError("ValidationError", "bad token"), 0.1))
    assert _kinds(effects) == ["StopSteps", "EndStream", "Report"]
    other = Generate(request_id="r2", prompt_tokens=(5, 6), stream_to="s2")
    grant = RunTurn(owner="request", ident="r2", start=other, reply_to="gateway")
    assert core.handle(rc.TurnGranted(grant, "c-2", 0.2)) == []
    effects = core.handle(rc.JobEnded(0.3))
    assert _kinds(effects) == ["Submit"]
    drop = effects[0]
    assert isinstance(drop, rc.Submit)
    assert isinstance(drop.job, rc.DropJob)
    effects = core.handle(rc.JobEnded(0.4))
    assert _kinds(effects) == ["Submit"]
    step = effects[0]
    assert isinstance(step, rc.Submit)
    assert isinstance(step.job, rc.StepJob)
    assert step.job.request_id == "r2"


def test_end_request_cancelled_keeps_the_cache_and_ends_the_stream_cancelled() -> None:
    """EndRequest(cancelled) after a reported turn queues the keep job, ends the stream with DoneEvent(cancelled) and releases a lease still held."""
    core = Core()
    core.handle(_grant(lookup=TakeResult(lease_id="L1", handle="h", cached_tokens=2)))
    core.handle(rc.JobEnded(0.1, error=None))  # NOTE: a job that produced nothing: report only
    effects = core.handle(rc.EndRequested("r1", "cancelled", 0.2))
    assert _kinds(effects) == ["ReleaseLease", "EndStream", "Submit"]
    end = effects[1]
    assert isinstance(end, rc.EndStream)
    assert isinstance(end.final, DoneEvent)
    assert end.final.finish_reason == "cancelled"


def test_background_turn_reports_the_step_outcome() -> None:
    """A background grant submits the step; its end reports ok or the error code."""
    core = Core()
    grant = RunTurn(owner="background", ident="bg", reply_to="gateway")
    effects = core.handle(rc.TurnGranted(grant, "c-b", 0.0))
    assert effects == [rc.Submit(1, rc.BackgroundJob("bg"), "c-b")]
    effects = core.handle(rc.JobEnded(0.1, error=rc.JobError("unknown_step", "step not registered")))
    assert effects == [
        rc.Report(
            "c-b",
            BackgroundTurnReport(step_id="bg", ok=False, error_code="unknown_step", detail="step not registered"),
        )
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_jobs_run_one_at_a_time_and_every_turn_reports_once(seed: int, max_steps: int) -> None:
    """Driven by a random fake engine, random cancels and stream losses (granting like the gateway): one job at a time, each turn reported exactly once, never more steps than granted."""
    rng = random.Random(seed)
    core = Core()
    reports: list[RequestTurnReport] = []
    running: list[rc.Submit] = []
    outputs: list[StepOutput] = []
    delivering: list[rc.EmitToken] = []
    granted = 0
    preempted = ended = False

    def apply(effects: list[rc.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, rc.Submit):
                assert not running, "a second job while one runs"
                running.append(effect)
                if isinstance(effect.job, rc.StepJob):
                    for _ in range(rng.randint(1, effect.job.budget)):
                        outputs.append(_decode(0, finish=rng.random() < 0.1))
                        if outputs[-1].result.finish_reason:
                            break
            elif isinstance(effect, rc.Report) and isinstance(effect.body, RequestTurnReport):
                assert 1 <= effect.body.steps <= max_steps
                reports.append(effect.body)
            elif isinstance(effect, rc.EmitToken):
                delivering.append(effect)

    for _ in range(200):
        state = core.state
        if state.turn is None and not running and not ended:
            if "r1" not in state.live and granted:
                ended = True  # NOTE: finished, failed or stream gone: no more turns
            elif preempted:
                ended = True
                apply(core.handle(rc.EndRequested("r1", "cancelled", 0.0)))
            else:
                granted += 1
                apply(core.handle(_grant(max_steps=max_steps, first=granted == 1)))
            continue
        if delivering:
            delivering.clear()
            gone = rng.random() < 0.05
            apply(core.handle(rc.StreamGone(0.0) if gone else rc.TokenDelivered(0.0)))
        elif state.turn is not None and not preempted and rng.random() < 0.05:
            preempted = True
            apply(core.handle(rc.Preempt("r1", 0.0)))
        elif outputs and running and isinstance(running[0].job, rc.StepJob):
            apply(core.handle(rc.StepDone(outputs.pop(0), 0.0)))
        elif running:
            running.clear()
            outputs.clear()
            apply(core.handle(rc.JobEnded(0.0)))
        elif ended:
            break
    assert ended
    assert core.state.turn is None
    assert not running
    assert len(reports) == granted


def _finish_long_prompt(lookup: TakeResult | None) -> list[rc.Effect]:
    """A 40-token request: one prefill turn (0.0 -> 0.5 s), one finishing decode step; every effect."""
    core = Core()
    prompt = tuple(range(40))
    request = REQUEST.model_copy(update={"prompt_tokens": prompt})
    turn = RunTurn(owner="request", ident="r1", start=request, max_steps=1, reply_to="gateway", lookup=lookup)
    effects = core.handle(rc.TurnGranted(turn, "c-1", 0.0))
    cached = 0 if lookup is None else lookup.cached_tokens
    prefill = StepOutput(StepResult(phase="prefill", prefill_complete=True), (), cached_tokens=cached)
    effects += core.handle(rc.StepDone(prefill, 0.5))
    effects += core.handle(rc.JobEnded(0.5))
    effects += core.handle(rc.TurnGranted(RunTurn(owner="request", ident="r1", max_steps=1, reply_to="gateway"), "c-1", 0.6))
    effects += core.handle(rc.StepDone(_decode(7, finish=True), 0.7))
    effects += core.handle(rc.TokenDelivered(0.7))
    return effects


def test_a_finished_request_reports_its_prefill_speed() -> None:
    """A request that computed at least 32 prompt tokens reports them with its prefill time to
    the cold tier's estimator (RAM and SSD hits included: only the computed tokens count)."""
    observed = [e for e in _finish_long_prompt(None) if isinstance(e, rc.Observe)]
    assert [(o.body.tokens, o.body.seconds) for o in observed] == [(40, 0.5)]
    ram = TakeResult(lease_id="L", handle="h", cached_tokens=4, tier="ram")
    observed = [e for e in _finish_long_prompt(ram) if isinstance(e, rc.Observe)]
    assert [o.body.tokens for o in observed] == [36]
    ssd = TakeResult(lease_id="L", staging_id="s", cached_tokens=4, tier="ssd")
    observed = [e for e in _finish_long_prompt(ssd) if isinstance(e, rc.Observe)]
    assert [o.body.tokens for o in observed] == [36]
    short = TakeResult(lease_id="L", handle="h", cached_tokens=20, tier="ram")
    assert not any(isinstance(e, rc.Observe) for e in _finish_long_prompt(short))


def test_an_ssd_lookup_opens_the_generation_from_its_staged_bytes() -> None:
    """The first StepJob of a request served by the SSD tier carries the staging id (no RAM
    handle), and the lease is released once the opening step reported what it reused."""
    core = Core()
    lookup = TakeResult(lease_id="L2", staging_id="st-1", cached_tokens=3, entry_tokens=4, tier="ssd")
    (submit,) = core.handle(_grant(lookup=lookup))
    assert isinstance(submit, rc.Submit)
    assert isinstance(submit.job, rc.StepJob)
    opening = submit.job.opening
    assert opening is not None
    assert (opening.handle, opening.staging_id, opening.cached_tokens) == (None, "st-1", 3)
    prefill = StepOutput(StepResult(phase="prefill", prefill_complete=True), (), cached_tokens=3)
    assert core.handle(rc.StepDone(prefill, 0.1)) == [rc.ReleaseLease("L2")]
