"""The batch scheduler's core with a slow reader: a full stream holds only its own row's events."""

from __future__ import annotations

from typing import Any

from actors.batch_scheduler.core import (
    Admit,
    ArmRetry,
    Cancel,
    Deliver,
    Delivered,
    Effect,
    EmitToken,
    EndStream,
    Event,
    ExitOut,
    RetryDelivery,
    SchedulerState,
    StepFinished,
    StepOut,
    Stopping,
    StreamFull,
    SubmitStep,
    TokenOut,
    TurnGranted,
    handle,
)
from messages.gateway import DoneEvent, ErrorEvent, Generate, GenerationParams, TokenEvent


def gen(rid: str) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=(1, 2, 3, 4),
        params=GenerationParams(max_tokens=64),
        stream_to=f"inbox.{rid}",
    )


def token(rid: str, index: int) -> TokenEvent:
    return TokenEvent(request_id=rid, index=index, token_id=10 + index, text=f"t{index}")


class Core:
    """Two joined rows ``a`` and ``b`` behind a scripted shell whose streams hold ``room`` events.

    The shell performs effects like ``actor.py``: an event its stream has no room for (or any
    later one to that stream in the same effects) goes back as ``StreamFull``; a ``Deliver``
    sends until the stream refuses; follow-ups are handled in order. ``received`` is what each
    stream's reader got, in order; ``room[s]`` ``None`` means unbounded.
    """

    def __init__(self, backlog_max: int = 100) -> None:
        self.state = SchedulerState(max_rows=2, max_queue=0, backlog_max=backlog_max)
        self.turn = 0
        self.now = 0.0
        self.room: dict[str, int | None] = {"inbox.a": None, "inbox.b": None}
        self.closed: set[str] = set()
        self.received: dict[str, list[TokenEvent | DoneEvent | ErrorEvent]] = {
            "inbox.a": [],
            "inbox.b": [],
        }
        self.effects: list[Effect] = []
        self.handle(Admit(gen("a"), "c-a", 0.0))
        self.handle(Admit(gen("b"), "c-b", 0.0))
        self.grant()
        self.handle(StepFinished(self.turn, StepOut(joined=(("a", 0), ("b", 0))), 0.0))

    def handle(self, event: Event) -> list[Effect]:
        """Feed ``event``; perform its effects and their follow-ups; every effect, in order."""
        todo = [event]
        seen: list[Effect] = []
        while todo:
            self.state, effects = handle(self.state, todo.pop(0))
            seen.extend(effects)
            refused: set[str] = set()
            for effect in effects:
                follow = self._perform(effect, refused)
                if follow is not None:
                    todo.append(follow)
        self.effects.extend(seen)
        return seen

    def _take(self, stream: str) -> bool:
        room = self.room[stream]
        if room is None:
            return True
        if room == 0:
            return False
        self.room[stream] = room - 1
        return True

    def _perform(self, effect: Effect, refused: set[str]) -> Event | None:
        if isinstance(effect, EmitToken):
            if effect.stream_to not in refused and self._take(effect.stream_to):
                self.received[effect.stream_to].append(effect.event)
                return None
            refused.add(effect.stream_to)
            rid = effect.event.request_id
            return StreamFull(rid, effect.stream_to, effect.correlation_id, effect.event, self.now)
        if isinstance(effect, EndStream):
            if effect.stream_to in refused:
                rid = effect.final.request_id
                return StreamFull(
                    rid, effect.stream_to, effect.correlation_id, effect.final, self.now
                )
            self.received[effect.stream_to].append(effect.final)
            return None
        if isinstance(effect, Deliver):
            if effect.stream_to in self.closed:
                return Delivered(effect.request_id, 0, False, True, self.now)
            sent = 0
            for event in effect.events:
                if not self._take(effect.stream_to):
                    return Delivered(effect.request_id, sent, False, False, self.now)
                self.received[effect.stream_to].append(event)
                sent += 1
            if effect.final is None:
                return Delivered(effect.request_id, sent, False, False, self.now)
            self.received[effect.stream_to].append(effect.final)
            return Delivered(effect.request_id, sent, True, False, self.now)
        return None

    def grant(self) -> list[Effect]:
        self.turn += 1
        self.now += 1.0
        return self.handle(TurnGranted(self.turn, self.now))

    def step(self, *rows: str, exits: tuple[ExitOut, ...] = ()) -> list[Effect]:
        """One granted step producing the next token of each of ``rows``; every effect."""
        effects = self.grant()
        index = {r: self.state.rows[r].tokens for r in rows}
        tokens = tuple(TokenOut(r, index[r], 10 + index[r], f"t{index[r]}") for r in rows)
        out = StepOut(tokens=tokens, exits=exits, decode_rows=len(rows))
        return effects + self.handle(StepFinished(self.turn, out, self.now))

    def got(self, stream: str) -> list[Any]:
        """What ``stream``'s reader received: token indexes, or the final event's kind."""
        return [
            e.index if isinstance(e, TokenEvent) else type(e).__name__
            for e in self.received[stream]
        ]


def of(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def to(effects: list[Effect], stream: str) -> list[Any]:
    return [e for e in effects if isinstance(e, EmitToken | EndStream) and e.stream_to == stream]


def test_a_full_stream_holds_only_its_rows_tokens_and_delivers_them_in_order() -> None:
    """While a's stream has no room, a's tokens are held and b's keep going out every step;
    the retry alarm is set while anything is held; once a's reader makes room, a's held
    tokens arrive in order, before any later token, and the alarm is cancelled."""
    core = Core()
    core.step("a", "b")
    core.room["inbox.a"] = 0
    for _ in range(3):
        effects = core.step("a", "b")
        assert ArmRetry(core.now + core.state.retry_s) in effects
    assert (core.got("inbox.a"), core.got("inbox.b")) == ([0], [0, 1, 2, 3])
    assert [e.index for e in core.state.outboxes["a"].events] == [1, 2, 3]
    core.room["inbox.a"] = 2
    core.handle(RetryDelivery(core.now))
    assert core.got("inbox.a") == [0, 1, 2]
    core.room["inbox.a"] = None
    effects = core.step("a", "b")
    assert core.got("inbox.a") == [0, 1, 2, 3, 4]
    assert ArmRetry(None) in effects
    assert core.state.outboxes == {}
    assert core.state.snapshot()["streams"] == {
        "held": 0,
        "held_events": 0,
        "full": 1,
        "slow_readers": 0,
        "write_timeouts": 0,
    }


def test_a_held_rows_final_event_waits_behind_its_tokens() -> None:
    """A row that finishes while its tokens are held gets its DoneEvent only after them, even
    when its last token and its end come out of the same step."""
    core = Core()
    core.room["inbox.a"] = 1
    core.step("a", "b")
    core.step("a", "b", exits=(ExitOut("a", "length", 2),))
    assert core.got("inbox.a") == [0]
    assert set(core.state.rows) == {"b"}
    core.room["inbox.a"] = None
    core.step("b")
    assert core.got("inbox.a") == [0, 1, "DoneEvent"]
    assert core.state.outboxes == {}


def test_a_reader_past_the_backlog_bound_stops_only_its_row() -> None:
    """When a's held tokens reach backlog_max, the next step removes a (a cancel: its cache is
    kept) and its stream ends after the held tokens with ErrorEvent(slow_reader); b goes on."""
    core = Core(backlog_max=3)
    core.room["inbox.a"] = 0
    for _ in range(3):
        core.step("a", "b")
    assert core.state.rows["a"].slow
    (submit,) = of(core.grant(), SubmitStep)
    assert submit.cancels == ("a",)
    out = StepOut(
        tokens=(TokenOut("b", 3, 13, "t3"),),
        exits=(ExitOut("a", "cancelled", 3),),
        decode_rows=1,
    )
    core.handle(StepFinished(core.turn, out, core.now))
    assert core.got("inbox.b") == [0, 1, 2, 3]
    assert set(core.state.rows) == {"b"}
    core.room["inbox.a"] = None
    core.handle(RetryDelivery(core.now))
    assert core.got("inbox.a") == [0, 1, 2, "ErrorEvent"]
    final = core.received["inbox.a"][-1]
    assert isinstance(final, ErrorEvent)
    assert final.error_code == "slow_reader"
    streams = core.state.snapshot()["streams"]
    assert isinstance(streams, dict)
    assert (streams["slow_readers"], streams["held"]) == (1, 0)


def test_a_reader_that_left_while_held_cancels_its_row() -> None:
    """A Deliver that finds the stream closed drops the held events and the row leaves the
    batch at the next step like any cancel."""
    core = Core()
    core.room["inbox.a"] = 0
    core.step("a", "b")
    core.closed.add("inbox.a")
    core.handle(RetryDelivery(core.now))
    assert core.state.outboxes == {}
    assert core.state.rows["a"].cancelled
    (submit,) = of(core.grant(), SubmitStep)
    assert submit.cancels == ("a",)


def test_a_cancel_and_a_stop_with_held_streams() -> None:
    """A requester's cancel of a held row ends it (after its held tokens) as cancelled; the
    scheduler stopping ends every held stream at once with ErrorEvent(shutting_down)."""
    core = Core()
    core.room["inbox.a"] = 0
    core.step("a", "b")
    core.handle(Cancel("a", core.now))
    core.grant()
    out = StepOut(exits=(ExitOut("a", "cancelled", 1),))
    core.handle(StepFinished(core.turn, out, core.now))
    box = core.state.outboxes["a"]
    assert isinstance(box.final, DoneEvent)
    assert box.final.finish_reason == "cancelled"
    stop = core.handle(Stopping(core.now))
    (end,) = of(stop, EndStream)
    assert end.stream_to == "inbox.a"
    assert isinstance(end.final, ErrorEvent)
    assert end.final.error_code == "shutting_down"
    assert ArmRetry(None) in stop
    assert core.state.outboxes == {}
