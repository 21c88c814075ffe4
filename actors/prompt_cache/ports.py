"""Ports of the prompt cache: the alarm that wakes it, and where restored bytes wait.

- :class:`Alarm`: ONE timer that calls back at a clock time; the shell uses
  it for idle demotions and cold-lookup deadlines (time itself comes from
  the injected clock). :class:`LoopAlarm` runs on the event loop
  (``call_later``); a simulated run passes an alarm the scenario fires.
- :class:`StagedBytes`: the cold tier's host staging
  (``actors.ssd_writer.HostStaging``), seen from the cache: it only drops
  what a lease it ends no longer needs.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Protocol

from actors.runtime import Clock

__all__ = ["Alarm", "LoopAlarm", "StagedBytes"]


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


class StagedBytes(Protocol):
    """Restored entries waiting in host memory (thread-safe)."""

    def discard(self, staging_id: str) -> None:
        """Drop the entry if it is still waiting (no error if it was taken)."""
        ...
