"""Ports of the prompt cache: the alarm that wakes it, and where restored bytes wait.

- :class:`Alarm`: ONE timer that calls back at a clock time; the shell uses
  it for idle demotions and cold-lookup deadlines (time itself comes from
  the injected clock). :class:`LoopAlarm` runs on the event loop
  (``call_later``); a simulated run passes an alarm the scenario fires.
  Both are the runtime's (``actors.runtime``), re-exported here.
- :class:`StagedBytes`: the cold tier's host staging
  (``actors.ssd_writer.HostStaging``), seen from the cache: it only drops
  what a lease it ends no longer needs.
"""

from __future__ import annotations

from typing import Protocol

from actors.runtime import Alarm, LoopAlarm

__all__ = ["Alarm", "LoopAlarm", "StagedBytes"]


class StagedBytes(Protocol):
    """Restored entries waiting in host memory (thread-safe)."""

    def discard(self, staging_id: str) -> None:
        """Drop the entry if it is still waiting (no error if it was taken)."""
        ...
