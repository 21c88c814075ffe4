"""The batch scheduler's core with two held streams: handing out held events always comes to rest.

Regression: with two rows' streams both full, each ``Delivered`` (nothing sent) made the core
try the other row's stream again, whose ``Delivered`` tried the first again, and so on: the
shell's follow-up loop never ended and starved the event loop (``test_slow_reader`` hung).
"""

from __future__ import annotations

from actors.batch_scheduler.core import (
    Deliver,
    Effect,
    Event,
    RetryDelivery,
    StepFinished,
    StepOut,
    TokenOut,
    handle,
)
from tests.actors.batch_scheduler.test_core_streams import Core

LIMIT = 200
"""Core events one outside event may lead to here before the test calls it a livelock."""


class BoundedCore(Core):
    """:class:`Core` whose follow-up loop gives up after ``LIMIT`` core events."""

    def handle(self, event: Event) -> list[Effect]:
        """Feed ``event`` and its follow-ups like the shell does; fail past ``LIMIT`` of them."""
        todo = [event]
        seen: list[Effect] = []
        handled = 0
        while todo:
            handled += 1
            assert handled <= LIMIT, f"no rest after {LIMIT} core events: {seen[-4:]}"
            self.state, effects = handle(self.state, todo.pop(0))
            seen.extend(effects)
            refused: set[str] = set()
            for effect in effects:
                follow = self._perform(effect, refused)
                if follow is not None:
                    todo.append(follow)
        self.effects.extend(seen)
        return seen


def delivers(effects: list[Effect]) -> list[str]:
    """The rows whose held events ``effects`` tried to hand out, in order."""
    return [e.request_id for e in effects if isinstance(e, Deliver)]


def test_two_full_streams_are_each_tried_once_per_event() -> None:
    """With both rows' streams full and holding events, a step's end, and the retry alarm, try
    each held stream once (no Deliver ping-pong between them) and leave both rows' events held,
    in order; once the readers make room everything arrives in order."""
    core = BoundedCore()
    core.step("a", "b")
    core.room["inbox.a"] = 0
    core.room["inbox.b"] = 0
    core.step("a", "b")
    assert delivers(core.grant()) == ["a", "b"]
    step = StepOut(tokens=(TokenOut("a", 2, 12, "t2"), TokenOut("b", 2, 12, "t2")), decode_rows=2)
    assert delivers(core.handle(StepFinished(core.turn, step, core.now))) == ["a", "b"]
    assert delivers(core.handle(RetryDelivery(core.now))) == ["a", "b"]
    assert [e.index for e in core.state.outboxes["a"].events] == [1, 2]
    assert [e.index for e in core.state.outboxes["b"].events] == [1, 2]
    core.room["inbox.a"] = None
    core.room["inbox.b"] = None
    core.handle(RetryDelivery(core.now))
    assert (core.got("inbox.a"), core.got("inbox.b")) == ([0, 1, 2], [0, 1, 2])
    assert core.state.outboxes == {}
