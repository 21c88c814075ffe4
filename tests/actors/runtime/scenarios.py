"""Scenarios for the simulated-runtime tests (referenced as ``module:function``)."""

from __future__ import annotations

import pytest

from actors.runtime import AskCycle, SimulatedSystem

from ._actors import Echo, Forward, Fragile, Relay
from .demo_messages import Add, GetTotal, Ping, Pong, Total


async def fan_in(system: SimulatedSystem, *, senders: int = 3, each: int = 3) -> None:
    """Several forwarders race Adds into one counter; the order depends on the seed."""
    births: list[int] = []
    counter = system.spawn("counter", lambda: Fragile(births), capacity=4)
    refs = [system.spawn(f"fwd-{i}", lambda: Forward("counter"), capacity=2) for i in range(senders)]
    for round_ in range(each):
        for i, ref in enumerate(refs):
            await ref.tell(Add(amount=10 * i + round_))
    total = await counter.ask(GetTotal(), timeout=10.0, expect=Total)
    assert total.count <= senders * each


async def ask_chain(system: SimulatedSystem) -> None:
    """An ask relayed through two actors, plus a cycle that must fail (not hang)."""
    system.spawn("echo", Echo)
    system.spawn("relay-1", lambda: Relay("echo"))
    system.spawn("relay-2", lambda: Relay("relay-1"))
    pong = await system.ask("relay-2", Ping(n=5), timeout=10.0, expect=Pong)
    assert pong.n == 5
    system.spawn("loop-a", lambda: Relay("loop-b"))
    system.spawn("loop-b", lambda: Relay("loop-a"))
    with pytest.raises(AskCycle):
        await system.ask("loop-a", Ping(n=1), timeout=10.0)


async def stuck(system: SimulatedSystem) -> None:
    """Waits on an inbox nobody sends to: the simulation must report a stall."""
    async with system.open_inbox() as inbox:
        await inbox.receive()
