"""The engine job in flight, shared by the turn runner (event loop) and the engine thread.

A request turn's steps run as ONE engine job (:func:`run_chain`): the next
step starts as soon as one ends, without a trip through the event loop, and
each step's output is handed to the loop as it exists. Every other engine
job (keep or drop a request's cache, a background step) runs through the
same record, so the runner learns of every job's end the same way: a
:class:`~messages.gateway.EngineWake` in its own mailbox.

Cross-thread rules (NOTE: each is a single attribute or deque operation,
atomic under the GIL):

- the engine thread appends to ``results`` and increments ``steps``; the
  loop pops ``results`` and increments ``consumed``;
- ``stop`` is the runner's flag, set only by the runner (on the loop) when
  it handles ``StopBurst`` or finds the stream gone; the engine thread only
  reads it, before every step after the first;
- ``wake_pending``: the engine thread (after appending) and the future's
  done callback (on the loop) post a wake only when none is pending; the
  runner clears it BEFORE draining ``results``, so no output is ever left
  without a wake on its way (at worst a wake finds nothing new);
- ``ended``/``error``/``value`` are written on the loop by the future's
  done callback, after the job has really finished.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from messages.prompt_cache import EntryRole

from .ports import Registered, StepResult

__all__ = ["AHEAD", "Burst", "StepOutput", "run_chain"]

AHEAD = 4
"""How many steps a chain may run ahead of the outputs the loop has taken.

NOTE: bounds what a slow consumer makes the engine hold: the chain job ends
there and the runner queues the next one once it has streamed.
"""

_log = structlog.get_logger("kvtier.gateway")


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result, the cache entries registered during it, and (on an opening step) the reuse."""

    result: StepResult
    entries: tuple[tuple[EntryRole, Registered], ...] = ()
    cached_tokens: int | None = None
    open_s: float = 0.0
    """Seconds the opening spent before the step (an SSD landing, a RAM entry's copy): not prefill."""


class Burst:
    """One engine job in flight and what it has produced so far (see the module's rules)."""

    __slots__ = (
        "budget",
        "consumed",
        "ended",
        "error",
        "job_id",
        "loop",
        "post",
        "results",
        "steps",
        "stop",
        "value",
        "wake_pending",
    )

    def __init__(
        self,
        job_id: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[int], bool],
        *,
        budget: int = 1,
    ) -> None:
        self.job_id = job_id
        self.loop = loop
        self.post = post
        self.budget = budget
        self.steps = 0
        self.consumed = 0
        self.results: deque[StepOutput] = deque()
        self.stop = False
        self.wake_pending = False
        self.ended = False
        self.error: BaseException | None = None
        self.value: Any = None

    def notify(self) -> None:
        """Engine thread: ask the loop to wake the runner, unless a wake is already on its way."""
        if self.wake_pending:
            return
        self.wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._post)
        except RuntimeError:
            pass  # NOTE: the loop is closed; nobody waits any more.

    def settled(self, future: asyncio.Future[Any]) -> None:
        """Loop (the future's done callback): the job has finished; record how and wake the runner."""
        if future.cancelled():
            self.error = asyncio.CancelledError()
        else:
            self.error = future.exception()
            if self.error is None:
                self.value = future.result()
        self.ended = True
        self.wake()

    def wake(self) -> None:
        """Loop: post a wake now unless one is pending (to resume draining later)."""
        if not self.wake_pending:
            self.wake_pending = True
            self._post()

    def _post(self) -> None:
        if not self.post(self.job_id):
            # NOTE: cannot happen while the runner keeps one job in flight
            # (one pending wake) within its mailbox's reserve; a lost wake
            # would stall the turn, so say so loudly.
            _log.error("gateway.wake_lost", job=self.job_id)


def run_chain(burst: Burst, step: Callable[[bool], StepOutput]) -> None:
    """ON the engine thread: run ``step`` back to back while the burst may go on.

    ``step(first)`` runs one step (``first`` opens the request's generation
    if needed). The first step always runs; before each further one the
    chain stops when the budget is used up, the runner set ``stop``, the
    request finished or is prefilling (a prefill chunk is a turn of its
    own), or the chain is ``AHEAD`` steps ahead of what the loop has taken.
    """
    first = True
    while True:
        output = step(first)
        first = False
        burst.steps += 1
        burst.results.append(output)
        burst.notify()
        result = output.result
        if result.phase != "decode" or result.finish_reason is not None:
            return
        if burst.steps >= burst.budget or burst.stop or burst.steps - burst.consumed >= AHEAD:
            return
