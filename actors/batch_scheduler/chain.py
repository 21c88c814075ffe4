"""A batch turn's step chain: the engine job in flight, shared by the scheduler (loop) and the engine thread.

A granted batch turn runs as ONE engine job (:func:`run_chain`): the next
batch step starts as soon as one ends, without a trip through the event
loop, the gateway and back, and each step's :class:`~.core.StepOut` is
handed to the loop as it exists (so tokens still stream per step). The
scheduler's core decides when the chain must end (a row ready to join, a
cancel, a slow reader's removal, the gateway asking for the turn back,
stopping) and the shell sets ``stop``; the engine thread reads it before
every step after the first. Mirrors the serial lane's ``actors/gateway/burst.py``.

Cross-thread rules (NOTE: each is a single attribute or deque operation,
atomic under the GIL):

- the engine thread appends to ``results`` and increments ``steps``; the
  loop pops ``results`` and increments ``consumed``;
- ``stop`` is set only on the loop (by the shell, on the core's
  ``StopChain``); the engine thread only reads it;
- ``wake_pending``: the engine thread (after appending) and the future's
  done callback (on the loop) post a wake only when none is pending; the
  shell clears it BEFORE draining ``results``, so no output is ever left
  without a wake on its way (at worst a wake finds nothing new);
- ``ended``/``error`` are written on the loop by the future's done
  callback, after the job has really finished (every output appended).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from .core import JoinRow, StepOut

__all__ = ["AHEAD", "Chain", "run_chain"]

AHEAD = 4
"""How many steps a chain may run ahead of the outputs the loop has taken.

NOTE: bounds what a slow loop makes the engine hold (and how stale the
scheduler's view may get): the chain ends there and the turn is reported;
the gateway grants the next one.
"""

_log = structlog.get_logger("kvtier.batch")


class Chain:
    """One batch turn's engine job and what it has produced so far (see the module's rules)."""

    __slots__ = (
        "budget",
        "consumed",
        "ended",
        "error",
        "loop",
        "post",
        "results",
        "steps",
        "stop",
        "turn",
        "wake_pending",
    )

    def __init__(
        self,
        turn: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[], bool],
        *,
        budget: int = 1,
    ) -> None:
        self.turn = turn
        self.loop = loop
        self.post = post
        self.budget = max(1, budget)
        self.steps = 0
        self.consumed = 0
        self.results: deque[StepOut] = deque()
        self.stop = False
        self.wake_pending = False
        self.ended = False
        self.error: BaseException | None = None

    def notify(self) -> None:
        """Engine thread: ask the loop to wake the scheduler, unless a wake is already on its way."""
        if self.wake_pending:
            return
        self.wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._post)
        except RuntimeError:
            pass  # NOTE: the loop is closed; nobody waits any more.

    def settled(self, future: asyncio.Future[Any]) -> None:
        """Loop (the future's done callback): the job has finished; record how and wake the scheduler."""
        if future.cancelled():
            self.error = asyncio.CancelledError()
        else:
            self.error = future.exception()
        self.ended = True
        if not self.wake_pending:
            self.wake_pending = True
            self._post()

    def _post(self) -> None:
        if not self.post():
            # NOTE: cannot happen while one wake at most is pending, within the
            # mailbox's reserve; a lost wake would stall the turn: say so loudly.
            _log.error("batch.wake_lost", turn=self.turn)


def run_chain(
    chain: Chain,
    step: Callable[[Sequence[JoinRow], Sequence[str]], StepOut],
    idle: Callable[[], bool],
    joins: Sequence[JoinRow],
    cancels: Sequence[str],
    after_step: Callable[[], object] | None = None,
) -> None:
    """ON the engine thread: run batch steps back to back while the chain may go on.

    The first step cancels ``cancels`` and joins ``joins``, and always runs;
    before each further one the chain ends when its budget is used up, the
    scheduler set ``stop``, the batch holds no row any more (``idle``), or
    the chain is ``AHEAD`` steps ahead of what the loop has taken. A step
    that raises ends the job with its exception (the outputs before it stay
    in ``results``). ``after_step`` runs after each step's output is handed
    over (the engine's C heap trim, ``actors/engine/memory.py``
    ``HeapTrim``: a chain of steps is one engine job, and the memory its
    steps free must not wait for the job's end).
    """
    first = True
    while True:
        out = step(joins, cancels) if first else step((), ())
        first = False
        chain.steps += 1
        chain.results.append(out)
        chain.notify()
        if after_step is not None:
            after_step()
        if chain.steps >= chain.budget or chain.stop or idle():
            return
        if chain.steps - chain.consumed >= AHEAD:
            return
