"""The engine's admitted streams, counted, with a wake-up when one ends (on the loop only).

Admission waits here when the memory it needs is held by running requests
(``actors.errors.MemoryBusy``): a request that ends hands its KV to the
prompt cache, from where a relief can move it out.
"""

from __future__ import annotations

import anyio

__all__ = ["StreamEnds"]


class StreamEnds:
    """How many admitted streams are live, and an event set when one ends.

    NOTE: loop-only state (no lock): ``started`` / ``ended`` are called by
    ``GenerationStream`` on the loop, each stream's pair exactly once.
    """

    def __init__(self) -> None:
        self.live = 0
        self.waits = 0
        """Admissions that waited for a stream to end."""
        self.busy_failed = 0
        """Admissions that stayed busy (no stream left to wait for, or past the bound): 503s."""
        self._ended: anyio.Event | None = None

    def started(self) -> None:
        """A stream was admitted."""
        self.live += 1

    def ended(self) -> None:
        """A stream ended (finished, failed, cancelled or dropped): wake every waiter."""
        self.live = max(0, self.live - 1)
        if self._ended is not None:
            self._ended.set()
            self._ended = None

    async def wait(self, timeout: float) -> bool:
        """Wait until a stream ends, at most ``timeout`` seconds; whether one did."""
        if self._ended is None:
            self._ended = anyio.Event()
        event = self._ended
        self.waits += 1
        with anyio.move_on_after(timeout):
            await event.wait()
            return True
        return False
