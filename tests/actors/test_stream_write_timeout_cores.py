"""Full streams and the stream-write deadline in the two sans-IO cores: the turn runner's (a
full stream's tokens are held and the turn ends ``blocked``; held past the deadline, the stream
ends with ``stream_write_timeout``) and the batch scheduler's (a held stream that takes nothing for the deadline is ended and its row removed)."""

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
from messages.gateway import DoneEvent, ErrorEvent, LaneUnblocked, RequestTurnReport
from tests.actors.batch_scheduler.test_core_streams import Core as StreamsCore
from tests.actors.batch_scheduler.test_core_streams import of
from tests.actors.test_runner_core import Core as RunnerCore
from tests.actors.test_runner_core import _decode, _grant, _kinds

# --- the turn runner ----------------------------------------------------------------


def _blocked_core() -> tuple[RunnerCore, rc.Submit]:
    """A turn whose first token met a full stream (held) and whose chain ran one step ahead."""
    core = RunnerCore()
    submit = core.handle(_grant(max_steps=100))[0]
    assert isinstance(submit, rc.Submit)
    core.handle(rc.StepDone(_decode(1), 0.1))
    return core, submit


def test_a_full_stream_holds_the_tokens_and_ends_the_turn_blocked() -> None:
    """StreamFull holds the token, stops the running job and arms the retry; a step the chain
    ran ahead is held behind it (none dropped, none sent past a full stream); once the job
    ends the turn reports ``blocked`` (the engine is free for the other lane), nothing dropped."""
    core, submit = _blocked_core()
    effects = core.handle(rc.StreamFull(0.1))
    assert effects == [rc.StopSteps(submit.job_id), rc.ArmRetry(0.1 + core.state.retry_s)]
    assert core.handle(rc.StepDone(_decode(2), 0.15)) == []
    (report,) = core.handle(rc.JobEnded(0.2))
    assert isinstance(report, rc.Report)
    assert isinstance(report.body, RequestTurnReport)
    assert report.body.outcome == "blocked"
    assert [e.token_id for e, _ in core.state.live["r1"].held] == [1, 2]


def test_held_tokens_go_out_in_order_and_the_lane_is_unblocked_once_all_did() -> None:
    """A retry sends every held token; the stream takes one (the rest stays held, the deadline
    restarts), then the other: the gateway hears ``LaneUnblocked(continue)`` once, after all."""
    core, _ = _blocked_core()
    core.handle(rc.StreamFull(0.1))
    core.handle(rc.StepDone(_decode(2), 0.15))
    core.handle(rc.JobEnded(0.2))
    (deliver, arm) = core.handle(rc.RetryHeld(0.3))
    assert isinstance(deliver, rc.DeliverHeld)
    assert [e.token_id for e in deliver.events] == [1, 2]
    assert arm == rc.ArmRetry(0.3 + core.state.retry_s)
    assert _kinds(core.handle(rc.HeldDelivered("r1", 1, False, 0.4))) == ["ArmRetry"]
    assert core.state.live["r1"].held_since == 0.4
    (deliver, _) = core.handle(rc.RetryHeld(0.5))
    assert isinstance(deliver, rc.DeliverHeld)
    assert [e.token_id for e in deliver.events] == [2]
    (report, disarm) = core.handle(rc.HeldDelivered("r1", 1, False, 0.6))
    assert isinstance(report, rc.Report)
    assert report.body == LaneUnblocked(request_id="r1", outcome="continue")
    assert disarm == rc.ArmRetry(None)


def test_a_held_last_token_finishes_the_request_once_it_went_out() -> None:
    """When the held token is the answer's last, its delivery ends the stream (DoneEvent with
    every token counted) and tells the gateway ``finished``."""
    core = RunnerCore()
    core.handle(_grant(max_steps=100))
    core.handle(rc.StepDone(_decode(1, finish=True), 0.1))
    core.handle(rc.StreamFull(0.1))
    core.handle(rc.JobEnded(0.2))
    core.handle(rc.RetryHeld(0.3))
    effects = core.handle(rc.HeldDelivered("r1", 1, False, 0.4))
    assert _kinds(effects) == ["EndStream", "Report", "ArmRetry"]
    end, report, _ = effects
    assert isinstance(end, rc.EndStream)
    assert isinstance(end.final, DoneEvent)
    assert (end.final.finish_reason, end.final.usage.completion_tokens) == ("length", 1)
    assert isinstance(report, rc.Report)
    assert report.body == LaneUnblocked(request_id="r1", outcome="finished")
    assert "r1" not in core.state.live


def test_a_held_stream_that_takes_nothing_for_the_deadline_ends_with_the_timeout() -> None:
    """A held stream that took nothing for ``write_timeout_s``: the retry ends it with
    ErrorEvent(stream_write_timeout) (a reader that comes back learns why), keeps the
    request's cache (a DropJob that keeps) and tells the gateway ``cancelled``."""
    core, _ = _blocked_core()
    core.handle(rc.StreamFull(0.1))
    core.handle(rc.JobEnded(0.2))
    core.handle(rc.RetryHeld(0.3))
    core.handle(rc.HeldDelivered("r1", 0, False, 0.3))
    effects = core.handle(rc.RetryHeld(0.1 + core.state.write_timeout_s))
    assert _kinds(effects) == ["EndStream", "Report", "ArmRetry", "Submit"]
    end, report, disarm, keep = effects
    assert isinstance(end, rc.EndStream)
    assert isinstance(end.final, ErrorEvent)
    assert (end.final.request_id, end.final.error_code) == ("r1", rc.STREAM_WRITE_TIMEOUT)
    assert isinstance(report, rc.Report)
    assert report.body == LaneUnblocked(request_id="r1", outcome="cancelled")
    assert disarm == rc.ArmRetry(None)
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
