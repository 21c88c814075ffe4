"""The alarm port: ONE timer that wakes an actor at a clock time.

Shells whose core asks for a single wake-up (idle demotion, flush
deadlines, scrub rounds) take an :class:`Alarm`; :class:`LoopAlarm` is the
real one, on the running event loop. A simulated run passes an alarm the
scenario fires itself, so time stays the injected clock's.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Protocol

from ._ports import Clock

__all__ = ["Alarm", "LoopAlarm"]


class Alarm(Protocol):
    """One timer: ``set(at, wake)`` replaces any earlier setting."""

    def set(self, at: float | None, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once at clock time ``at`` (``None``: cancel)."""
        ...


class LoopAlarm:
    """:class:`Alarm` on the running asyncio loop (``call_later``), times on ``clock``.

    NOTE: the callback runs in a fresh context, so the message it sends is
    not stamped with whatever envelope was being handled when it was set.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None

    def set(self, at: float | None, wake: Callable[[], None]) -> None:
        """See :meth:`Alarm.set`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if at is None:
            return
        delay = max(0.0, at - self._clock.now())
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(delay, wake, context=contextvars.Context())
