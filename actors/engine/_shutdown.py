"""The Engine's shutdown budget and the final flush it bounds.

``shutdown_timeout`` runs from :meth:`Engine.begin_shutdown` (or from
``aclose`` when nothing began it): the drain of in-flight requests and the
cold tier's final flush share it. What the flush gave, or why it gave
nothing, is kept for ``Engine.final_flush`` / ``final_flush_error``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog

from actors.runtime import RuntimeFailure
from messages.durability import FlushResult

__all__ = ["Shutdown"]

_log = structlog.get_logger("kvtier.engine")


@dataclass(slots=True)
class Shutdown:
    """When the shutdown began (loop time), and the outcome of the flush run within its budget."""

    timeout: float
    began: float | None = None
    flushed: FlushResult | None = None
    error: str | None = None

    def begin(self) -> None:
        """Start the budget now, unless it already runs."""
        if self.began is None:
            self.began = anyio.current_time()

    def left(self) -> float:
        """Seconds left of the budget (all of it before :meth:`begin`)."""
        if self.began is None:
            return self.timeout
        return max(0.0, self.began + self.timeout - anyio.current_time())

    async def final_flush(self, flush: Callable[[float], Awaitable[FlushResult | None]]) -> None:
        """Run ``flush(seconds left)`` within what is left of the budget; keep its outcome."""
        left = self.left()
        if left <= 0:
            self.error = "the shutdown timeout was spent before the flush could run"
            _log.warning("engine.flush_incomplete", error=self.error)
            return
        try:
            flushed = await flush(left)
        except RuntimeFailure as exc:
            self.error = (
                f"the flush did not finish within the shutdown timeout ({type(exc).__name__})"
            )
            _log.warning("engine.flush_incomplete", error=repr(exc))
            return
        self.flushed = flushed
        if flushed is not None and not flushed.durable:
            _log.warning(
                "engine.flush_not_durable",
                pending=flushed.pending,
                dropped=flushed.dropped,
                failed=flushed.failed,
                uncovered=flushed.uncovered,
            )
