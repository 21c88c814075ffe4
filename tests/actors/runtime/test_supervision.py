"""One-for-one supervision, restart intensity, escalation and ordered stop."""

from __future__ import annotations

import functools

import anyio
import anyio.lowlevel
import pytest

from actors.runtime import (
    Actor,
    ActorStopped,
    ActorSystem,
    Context,
    ManualClock,
    RestartWindow,
    Supervision,
    SupervisionEscalated,
)
from messages import Envelope

from ._actors import Fragile, Gate
from .demo_messages import Add, GetTotal, Total

pytestmark = pytest.mark.anyio


def test_restart_window_allows_intensity_within_period_then_refuses() -> None:
    """The sans-IO window admits ``max_restarts`` per ``within`` seconds and forgets old ones."""
    window = RestartWindow(Supervision(max_restarts=2, within=10.0))
    assert window.allow(0.0)
    assert window.allow(1.0)
    assert not window.allow(2.0)
    assert window.allow(10.5)  # the restart at 0.0 left the window


async def test_crashing_actor_restarts_and_keeps_its_mailbox() -> None:
    """Within intensity a crash builds a fresh instance which handles the rest of the mailbox."""
    births: list[int] = []
    async with ActorSystem() as system:
        ref = system.spawn(
            "fragile", lambda: Fragile(births), supervision=Supervision("restart", 3, 60.0)
        )
        for amount in (1, -1, 2, 3, -1, 4):
            await ref.tell(Add(amount=amount))
        total = await ref.ask(GetTotal(), timeout=5.0, expect=Total)
        stats = ref.statistics()
    assert births == [1, 2, 3]
    assert total == Total(total=4, count=1)  # the third instance saw only Add(4)
    assert (stats.failed, stats.restarts, stats.handled) == (2, 2, 5)


async def test_resume_keeps_the_instance_state() -> None:
    """``resume`` skips the failing message but keeps the same instance and its state."""
    births: list[int] = []
    async with ActorSystem() as system:
        ref = system.spawn("fragile", lambda: Fragile(births), supervision=Supervision("resume"))
        for amount in (1, -1, 2):
            await ref.tell(Add(amount=amount))
        total = await ref.ask(GetTotal(), timeout=5.0, expect=Total)
    assert births == [1]
    assert total == Total(total=3, count=2)


async def test_failures_past_intensity_escalate_out_of_the_system() -> None:
    """More restarts than the intensity within the period stops the system with ``SupervisionEscalated``."""
    births: list[int] = []
    clock = ManualClock()

    async def run_system() -> None:
        async with ActorSystem(clock=clock) as system:
            ref = system.spawn(
                "fragile", lambda: Fragile(births), supervision=Supervision("restart", 2, 5.0)
            )
            for _ in range(3):
                await ref.tell(Add(amount=-1))
            await anyio.sleep_forever()

    with anyio.fail_after(5), pytest.raises(SupervisionEscalated) as info:
        await run_system()
    assert info.value.actor == "fragile"
    assert births == [1, 2, 3]  # two restarts allowed, the third failure escalated


async def test_failures_spread_over_time_do_not_escalate() -> None:
    """Failures further apart than the period never exceed the intensity."""
    births: list[int] = []
    clock = ManualClock()
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(
            "fragile", lambda: Fragile(births), supervision=Supervision("restart", 1, 5.0)
        )
        for _ in range(3):
            await ref.tell(Add(amount=-1))
            await ref.ask(GetTotal(), timeout=5.0)
            clock.advance(6.0)
        assert ref.statistics().restarts == 3


async def test_stop_policy_dead_letters_the_rest_and_fails_asks() -> None:
    """With ``stop`` the failed actor's accepted messages become dead letters; asks get ``ActorStopped``."""
    births: list[int] = []
    async with ActorSystem() as system:
        ref = system.spawn("fragile", lambda: Fragile(births), supervision=Supervision("stop"))
        ref.tell_nowait(Add(amount=-1))
        ref.tell_nowait(Add(amount=5))
        with pytest.raises(ActorStopped):
            await ref.ask(GetTotal(), timeout=5.0)
        assert ref.statistics().state == "failed"
        assert Add(amount=5) in [d.envelope.body for d in system.dead_letters()]
    assert births == [1]


class _Recorder(Actor):
    """Counts handled messages slowly and records when it stopped."""

    def __init__(self, name: str, stops: list[str], handled: list[str]) -> None:
        self.name = name
        self.stops = stops
        self.handled = handled

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        await anyio.lowlevel.checkpoint()
        self.handled.append(self.name)

    async def stopped(self, ctx: Context) -> None:
        self.stops.append(self.name)


async def test_stop_handles_every_accepted_message_in_reverse_spawn_order() -> None:
    """``stop`` lets each actor drain its mailbox, stopping actors in reverse spawn order."""
    stops: list[str] = []
    handled: list[str] = []
    async with ActorSystem() as system:
        for name in ("first", "second", "third"):
            ref = system.spawn(name, functools.partial(_Recorder, name, stops, handled), capacity=50)
            for i in range(50):
                ref.tell_nowait(Add(amount=i))
    assert stops == ["third", "second", "first"]
    assert sorted(handled) == ["first"] * 50 + ["second"] * 50 + ["third"] * 50
    assert system.statistics().handled == 150


async def test_stop_with_explicit_order() -> None:
    """Actors named in ``order`` stop first, the rest in reverse spawn order."""
    stops: list[str] = []
    async with ActorSystem() as system:
        for name in ("a", "b", "c"):
            system.spawn(name, functools.partial(_Recorder, name, stops, []))
        await system.stop(order=["a"])
    assert stops == ["a", "c", "b"]


async def test_stop_refuses_blocked_senders() -> None:
    """Senders still blocked on a full mailbox when it closes get ``ActorStopped`` (not accepted)."""
    gate = anyio.Event()
    seen: list[Envelope] = []
    outcome: list[str] = []
    async with ActorSystem() as system:
        ref = system.spawn("gate", lambda: Gate(gate, seen), capacity=1)
        await ref.tell(Add(amount=1))
        await anyio.wait_all_tasks_blocked()
        await ref.tell(Add(amount=2))

        async def blocked() -> None:
            try:
                await ref.tell(Add(amount=3))
                outcome.append("accepted")
            except ActorStopped:
                outcome.append("refused")

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(system.stop)
            await anyio.wait_all_tasks_blocked()
            gate.set()
    assert outcome == ["refused"]
    assert [e.body.amount for e in seen if isinstance(e.body, Add)] == [1, 2]
