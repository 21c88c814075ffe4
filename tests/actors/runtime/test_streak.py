"""An actor takes waiting messages in a row, and a send with room inside a handler does not yield."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from actors.runtime import MAX_STREAK, ActorSystem

from ._actors import Logger
from .demo_messages import Add

pytestmark = pytest.mark.anyio


def _runs(log: list[tuple[str, int]], name: str) -> list[int]:
    """Lengths of the runs of ``name``'s entries with no other task's entry between them."""
    runs: list[int] = []
    current = 0
    for who, _ in log:
        if who == name:
            current += 1
        elif who == "tick" and current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


async def test_a_forwarder_takes_max_streak_waiting_messages_between_two_yields() -> None:
    """40 waiting messages: a task that is always ready runs only after each streak of MAX_STREAK forwards, and every message arrives in order."""
    log: list[tuple[str, int]] = []
    total = 40
    async with ActorSystem() as system:
        system.spawn("sink", lambda: Logger("sink", log), capacity=2 * total)
        forwarder = system.spawn("fwd", lambda: Logger("fwd", log, forward_to="sink"),
                                 capacity=2 * total)
        await anyio.wait_all_tasks_blocked()
        done = anyio.Event()

        async def ticker() -> None:
            while not done.is_set():
                log.append(("tick", 0))
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for n in range(total):
                assert forwarder.try_tell(Add(amount=n))
            with anyio.fail_after(5):
                while sum(1 for who, _ in log if who == "sink") < total:
                    await anyio.lowlevel.checkpoint()
            done.set()
    assert [n for who, n in log if who == "sink"] == list(range(total))
    forwards = _runs(log, "fwd")
    assert max(forwards) == MAX_STREAK
    assert sum(forwards) == total
    assert max(_runs(log, "sink")) <= MAX_STREAK
