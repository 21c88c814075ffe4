"""The stream-write deadline in the two sans-IO cores: the turn runner's (a stalled stream
ends with ``stream_write_timeout`` and the turn ends after the step in flight) and the batch
scheduler's (a held stream that takes nothing for the deadline is ended and its row removed)."""

from __future__ import annotations

from actors.batch_scheduler.core import (
    STREAM_WRITE_TIMEOUT,
    Effect,
    Event,
    ExitOut,
    RetryDelivery,
    StepFinished,
    StepOut,
    StreamTimedOut,
    SubmitStep,
    TokenOut,
)
from actors.gateway import runner_core as rc
from messages.gateway import ErrorEvent, RequestTurnReport
from tests.actors.batch_scheduler.test_core_streams import Core as StreamsCore
from tests.actors.batch_scheduler.test_core_streams import of
from tests.actors.test_runner_core import Core as RunnerCore
from tests.actors.test_runner_core import _decode, _grant, _kinds

# --- the turn runner ----------------------------------------------------------------


def test_a_stalled_stream_ends_with_the_timeout_and_the_turn_ends_after_the_running_step() -> None:
    """StreamGone(stalled) stops the running job, ends the stream with
    ErrorEvent(stream_write_timeout) (a reader that comes back learns why), and once the
    running job ends the turn reports cancelled and the request's cache is kept."""
    core = RunnerCore()
    submit = core.handle(_grant(max_steps=100))[0]
    assert isinstance(submit, rc.Submit)
    core.handle(rc.StepDone(_decode(1), 0.1))
    effects = core.handle(rc.StreamGone(30.1, stalled=True))
    assert _kinds(effects) == ["StopSteps", "EndStream"]
    stop, end = effects
    assert stop == rc.StopSteps(submit.job_id)
    assert isinstance(end, rc.EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert (end.final.request_id, end.final.error_code) == ("r1", rc.STREAM_WRITE_TIMEOUT)
    # NOTE: a step the chain ran ahead streams nothing more.
    assert core.handle(rc.StepDone(_decode(2), 30.2)) == []
    effects = core.handle(rc.JobEnded(30.2))
    assert _kinds(effects) == ["Report", "Submit"]
    report, keep = effects
    assert isinstance(report, rc.Report)
    assert isinstance(report.body, RequestTurnReport)
    assert report.body.outcome == "cancelled"
    assert isinstance(keep, rc.Submit)
    assert keep.job == rc.DropJob("r1", True, "", "c-1")


def test_a_closed_stream_is_not_ended_again() -> None:
    """A StreamGone that is not a stall (the reader closed its stream) ends nothing: the
    reader is gone and its stream closed."""
    core = RunnerCore()
    core.handle(_grant(max_steps=10))
    core.handle(rc.StepDone(_decode(1), 0.1))
    assert _kinds(core.handle(rc.StreamGone(0.2))) == ["StopSteps"]


# --- the batch scheduler --------------------------------------------------------------


class Core(StreamsCore):
    """The streams harness with a 2 s write deadline; ``StreamTimedOut`` ends a stream the way
    the shell does (``end_stream``: the final arrives whatever the room)."""

    def __init__(self) -> None:
        super().__init__()
        self.state.write_timeout_s = 2.0

    def _perform(self, effect: Effect, refused: set[str]) -> Event | None:
        if isinstance(effect, StreamTimedOut):
            self.received[effect.stream_to].append(effect.final)
            self.closed.add(effect.stream_to)
            return None
        return super()._perform(effect, refused)


def test_a_held_stream_that_takes_nothing_for_the_deadline_is_ended_and_its_row_removed() -> None:
    """a's reader takes nothing: at the first event 2 s after a's stream refused, a's held
    tokens are dropped, its stream ends with ErrorEvent(stream_write_timeout), and the next
    step removes a (a cancel: cache kept); b goes on, and nothing more reaches a."""
    core = Core()
    core.room["inbox.a"] = 0
    core.step("a", "b")  # NOTE: now = 2.0: a's stream refuses token 0.
    core.step("a", "b")
    assert core.state.outboxes["a"].since == 2.0
    assert not any(isinstance(e, StreamTimedOut) for e in core.effects)
    effects = core.step("a", "b")  # NOTE: now = 4.0: the deadline.
    (timed_out,) = of(effects, StreamTimedOut)
    assert (timed_out.request_id, timed_out.final.error_code) == ("a", STREAM_WRITE_TIMEOUT)
    assert core.got("inbox.a") == ["ErrorEvent"]
    assert "a" not in core.state.outboxes
    assert core.state.rows["a"].cancelled
    (submit,) = of(core.grant(), SubmitStep)
    assert submit.cancels == ("a",)
    out = StepOut(
        tokens=(TokenOut("b", 3, 13, "t3"), TokenOut("a", 3, 13, "t3")),
        exits=(ExitOut("a", "cancelled", 3),),
        decode_rows=1,
    )
    core.handle(StepFinished(core.turn, out, core.now))
    assert core.got("inbox.a") == ["ErrorEvent"]
    assert core.got("inbox.b") == [0, 1, 2, 3]
    assert set(core.state.rows) == {"b"}
    streams = core.state.snapshot()["streams"]
    assert isinstance(streams, dict)
    assert (streams["write_timeouts"], streams["held"]) == (1, 0)


def test_a_reader_that_takes_something_starts_the_deadline_again() -> None:
    """A delivery that got events through restarts the deadline: a reader slower than the
    generation but not stopped keeps its stream."""
    core = Core()
    core.room["inbox.a"] = 0
    core.step("a", "b")  # NOTE: refused at 2.0.
    core.step("a", "b")  # NOTE: 3.0: two tokens held.
    core.room["inbox.a"] = 1
    core.now = 3.5
    core.handle(RetryDelivery(core.now))
    assert core.got("inbox.a") == [0]
    assert core.state.outboxes["a"].since == 3.5
    core.now = 5.0
    core.handle(RetryDelivery(core.now))
    assert "a" in core.state.outboxes
    assert not of(core.effects, StreamTimedOut)
    core.now = 5.5
    core.handle(RetryDelivery(core.now))
    assert of(core.effects, StreamTimedOut)
    assert core.got("inbox.a") == [0, "ErrorEvent"]


def test_the_retry_alarm_alone_ends_a_finished_rows_held_stream() -> None:
    """A row that already left the batch (its DoneEvent held behind its tokens) with no more
    steps coming: the retry alarm past the deadline ends its stream with the timeout instead
    of holding its events forever."""
    core = Core()
    core.room["inbox.a"] = 0
    core.step("a", "b", exits=(ExitOut("a", "length", 1),))
    assert set(core.state.rows) == {"b"}
    assert core.state.outboxes["a"].final is not None
    core.handle(RetryDelivery(core.now + 1.0))
    assert "a" in core.state.outboxes
    effects = core.handle(RetryDelivery(core.now + 2.0))
    assert of(effects, StreamTimedOut)
    assert core.got("inbox.a") == ["ErrorEvent"]
    assert core.state.outboxes == {}
    assert not core.state.retry_armed
