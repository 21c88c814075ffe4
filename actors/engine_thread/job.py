"""An engine job in flight, shared by the actor that started it (event loop) and the engine thread.

Both lanes run a turn's steps as ONE engine job: the serial lane's turn
runner (``actors/gateway/runner.py``, ``Burst``) and the batch scheduler
(``actors/batch_scheduler/actor.py``, ``Chain``). The next step starts as
soon as one ends, without a trip through the event loop, and each step's
output is handed to the loop as it exists. :class:`EngineJob` is the record
they share; each lane's module adds its own step loop.

Cross-thread rules (NOTE: each is a single attribute or deque operation,
atomic under the GIL):

- the engine thread appends to ``results`` and increments ``steps``; the
  loop pops ``results`` and increments ``consumed``;
- ``stop`` is set only on the loop (by the actor that owns the job); the
  engine thread only reads it, before every step after the first;
- ``wake_pending``: the engine thread (after appending) and the future's
  done callback (on the loop) post a wake only when none is pending; the
  owner clears it BEFORE draining ``results``, so no output is ever left
  without a wake on its way (at worst a wake finds nothing new);
- ``ended``/``error``/``value`` are written on the loop by the future's
  done callback, after the job has really finished (every output appended).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog

from actors.errors import MemoryPressure
from kernels import device_out_of_memory

__all__ = ["AHEAD", "EngineJob", "job_failure"]

AHEAD = 4
"""How many steps a job may run ahead of the outputs the loop has taken.

NOTE: bounds what a slow loop makes the engine hold (and how stale the
owner's view may get): the job ends there, and the owner starts the next
one once it has taken the outputs.
"""

T = TypeVar("T")


class EngineJob(Generic[T]):
    """One engine job and what it has produced so far (see the module's rules).

    ``post`` puts a wake into the owner's mailbox and returns whether it
    did; ``wake_lost`` names the log event if it could not (``job`` is the
    job's id in that event).
    """

    __slots__ = (
        "_log",
        "_wake_lost",
        "budget",
        "consumed",
        "ended",
        "error",
        "ident",
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
        ident: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[], bool],
        *,
        budget: int = 1,
        wake_lost: str = "engine.wake_lost",
    ) -> None:
        self.ident = ident
        self.loop = loop
        self.post = post
        self.budget = budget
        self.steps = 0
        self.consumed = 0
        self.results: deque[T] = deque()
        self.stop = False
        self.wake_pending = False
        self.ended = False
        self.error: BaseException | None = None
        self.value: Any = None
        self._wake_lost = wake_lost
        self._log = structlog.get_logger("kvtier.engine")

    def hand_over(self, output: T) -> None:
        """Engine thread: publish one step's output and wake the owner."""
        self.steps += 1
        self.results.append(output)
        self.notify()

    def may_go_on(self) -> bool:
        """Engine thread: whether another step may run (budget left, no stop, not ``AHEAD`` ahead)."""
        return not (
            self.steps >= self.budget or self.stop or self.steps - self.consumed >= AHEAD
        )

    def notify(self) -> None:
        """Engine thread: ask the loop to wake the owner, unless a wake is already on its way."""
        if self.wake_pending:
            return
        self.wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._post)
        except RuntimeError:
            pass  # NOTE: the loop is closed; nobody waits any more.

    def settled(self, future: asyncio.Future[Any]) -> None:
        """Loop (the future's done callback): the job has finished; record how and wake the owner."""
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
        if not self.post():
            # NOTE: cannot happen while one wake at most is pending, within the
            # mailbox's reserve; a lost wake would stall the turn: say so loudly.
            self._log.error(self._wake_lost, job=self.ident)


def job_failure(error: BaseException, code: str, detail: str) -> tuple[str, str]:
    """The ``ErrorEvent`` code and detail of the requests an engine job failed with ``error``.

    The lane's own ``code`` and ``detail``, unless the device ran out of
    memory (:func:`kernels.device_out_of_memory`): then ``MemoryPressure``,
    which the engine API raises and HTTP answers 503 ``memory_pressure``
    (retryable) instead of 500. NOTE: an allocation that
    fails is the device's state, not a fault of the request or of kvtier; a
    client that retries meets admission again, whose guard reads the device.
    """
    if device_out_of_memory(error):
        said = f"{type(error).__name__}: {error}"
        return MemoryPressure.__name__, f"the device ran out of memory during a step ({said})"
    return code, detail
