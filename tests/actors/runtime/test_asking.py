"""The shared shape of shells that ask without waiting: ``perform_all``, ``try_request``, ``WakeAlarm``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import anyio
import pytest
import structlog

from actors.runtime import (
    Actor,
    ActorSystem,
    Context,
    NotSent,
    WakeAlarm,
    perform_all,
    try_request,
)
from messages import Envelope

from .demo_messages import Add, Ping, Pong

pytestmark = pytest.mark.anyio


async def test_perform_all_runs_an_outcomes_effects_after_those_already_queued() -> None:
    """Effects run in the core's order; the effects of the core's answer to an outcome come after the queue."""
    done: list[str] = []
    answers = {"b": ["c", "d"], "c": ["f"]}

    async def perform(effect: str) -> Sequence[str]:
        done.append(effect)
        return answers.get(effect, [])

    await perform_all(["a", "b", "e"], perform)
    assert done == ["a", "b", "e", "c", "d", "f"]


class _Blocker(Actor):
    """Records each envelope when it starts handling it, then waits on ``gate``."""

    def __init__(self, entered: anyio.Event, gate: anyio.Event, seen: list[Envelope]) -> None:
        self.entered, self.gate, self.seen = entered, gate, seen

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        self.seen.append(envelope)
        self.entered.set()
        await self.gate.wait()


class _Asker(Actor):
    """On ``Ping(n)``: ``try_request`` a ``Ping(n)`` to ``targets[n]``, record the outcome, answer."""

    def __init__(self, targets: list[str], outcomes: list[NotSent | None]) -> None:
        self.targets, self.outcomes = targets, outcomes

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, Ping)
        self.outcomes.append(
            try_request(ctx, self.targets[body.n], Ping(n=body.n), f"ref-{body.n}", log_as="asker")
        )
        await ctx.reply(envelope, Pong(n=body.n))


async def test_try_request_sends_with_this_actor_as_reply_slot_and_reports_full_and_gone() -> None:
    """Sent: reply_to is the asker, the correlation id the core's ref; then a full mailbox; then a target gone (logged)."""
    entered, gate = anyio.Event(), anyio.Event()
    seen: list[Envelope] = []
    outcomes: list[NotSent | None] = []
    targets = ["target", "target", "target", "nowhere"]
    async with ActorSystem() as system:
        system.spawn("target", lambda: _Blocker(entered, gate, seen), capacity=1)
        asker = system.spawn("asker", lambda: _Asker(targets, outcomes))
        await asker.ask(Ping(n=0), timeout=5.0, expect=Pong)
        await entered.wait()  # the target holds request 0; its mailbox (1) is empty
        await asker.ask(Ping(n=1), timeout=5.0, expect=Pong)
        await asker.ask(Ping(n=2), timeout=5.0, expect=Pong)
        with structlog.testing.capture_logs() as logs:
            await asker.ask(Ping(n=3), timeout=5.0, expect=Pong)
        gate.set()
    assert outcomes == [None, None, "full", "gone"]
    first = seen[0]
    assert isinstance(first.body, Ping)
    assert (first.body.reply_to, first.correlation_id) == ("asker", "ref-0")
    assert [(e["event"], e["to"], e["error"]) for e in logs] == [
        ("asker.target_gone", "nowhere", "UnknownAddress")
    ]


class _ScriptedAlarm:
    """An ``Alarm`` the test fires itself."""

    def __init__(self) -> None:
        self.settings: list[float | None] = []
        self.wake: Callable[[], None] = lambda: None

    def set(self, at: float | None, wake: Callable[[], None]) -> None:
        self.settings.append(at)
        self.wake = wake


class _Sleeper(Actor):
    """On ``Ping(n)`` sets its alarm at ``n`` (``n < 0``: cancels); records every ``Add`` (its wake-up)."""

    def __init__(self, alarm: WakeAlarm, woken: list[int], event: anyio.Event) -> None:
        self.alarm, self.woken, self.event = alarm, woken, event

    async def started(self, ctx: Context) -> None:
        self.alarm.bind(ctx)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Ping):
            self.alarm.set(None if body.n < 0 else ctx.clock.now() + body.n / 1000)
            await ctx.reply(envelope, Pong(n=body.n))
        elif isinstance(body, Add):
            self.woken.append(body.amount)
            self.event.set()


async def test_wake_alarm_wakes_its_actor_with_the_message_and_cancels() -> None:
    """An injected alarm gets the time; firing it sends the actor its wake message; ``None`` cancels."""
    scripted = _ScriptedAlarm()
    woken: list[int] = []
    event = anyio.Event()
    async with ActorSystem() as system:
        ref = system.spawn("sleeper", lambda: _Sleeper(WakeAlarm(lambda: Add(amount=7), scripted),
                                                       woken, event))
        await ref.ask(Ping(n=5), timeout=5.0, expect=Pong)
        assert len(scripted.settings) == 1
        assert scripted.settings[0] is not None
        scripted.wake()
        with anyio.fail_after(5):
            await event.wait()
        await ref.ask(Ping(n=-1), timeout=5.0, expect=Pong)
        assert scripted.settings[1:] == [None]
    assert woken == [7]


async def test_wake_alarm_without_an_injected_alarm_runs_on_the_loop() -> None:
    """Bound in ``started`` without an alarm, it wakes the actor on the system's clock."""
    woken: list[int] = []
    event = anyio.Event()
    async with ActorSystem() as system:
        ref = system.spawn("sleeper", lambda: _Sleeper(WakeAlarm(lambda: Add(amount=3)), woken,
                                                       event))
        await ref.ask(Ping(n=10), timeout=5.0, expect=Pong)
        with anyio.fail_after(5):
            await event.wait()
    assert woken == [3]


async def test_wake_alarm_with_again_fires_again_when_the_mailbox_is_full() -> None:
    """``again_s``: a wake-up the actor's full mailbox refused sets the alarm ``again_s`` later
    (held tokens have no other message to move them on); once sent, nothing more is set.
    Without ``again_s`` a refused wake-up sets nothing."""

    class _Ref:
        def __init__(self) -> None:
            self.room = False
            self.sent: list[object] = []

        def try_tell(self, body: object) -> bool:
            if self.room:
                self.sent.append(body)
            return self.room

    class _Clock:
        def now(self) -> float:
            return 100.0

    class _Ctx:
        def __init__(self) -> None:
            self.self_ref, self.clock = _Ref(), _Clock()

    for again in (0.02, None):
        scripted, ctx = _ScriptedAlarm(), _Ctx()
        alarm = WakeAlarm(lambda: Add(amount=1), scripted, again_s=again)
        alarm.bind(cast("Context", ctx))
        alarm.set(5.0)
        scripted.wake()
        if again is None:
            assert scripted.settings == [5.0]
            continue
        assert scripted.settings == [5.0, 100.02]
        ctx.self_ref.room = True
        scripted.wake()
        assert scripted.settings == [5.0, 100.02]
        assert ctx.self_ref.sent == [Add(amount=1)]
