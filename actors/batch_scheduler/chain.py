"""A batch turn's step chain: the engine job in flight, shared by the scheduler (loop) and the engine thread.

A granted batch turn runs as ONE engine job (:func:`run_chain`): the next
batch step starts as soon as one ends, without a trip through the event
loop, the gateway and back, and each step's :class:`~.core.StepOut` is
handed to the loop as it exists (so tokens still stream per step). The
scheduler's core decides when the chain must end (a row ready to join, a
cancel, a slow reader's removal, the gateway asking for the turn back,
stopping) and the shell sets ``stop``; the engine thread reads it before
every step after the first. The record and its cross-thread rules are the
serial lane's too: :class:`actors.runtime.EngineJob`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from actors.runtime import AHEAD, EngineJob

from .core import JoinRow, StepOut

__all__ = ["AHEAD", "Chain", "run_chain"]


class Chain(EngineJob[StepOut]):
    """One batch turn's engine job and what it has produced so far (``ident`` is the turn)."""

    __slots__ = ()

    def __init__(
        self,
        turn: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[], bool],
        *,
        budget: int = 1,
    ) -> None:
        super().__init__(turn, loop, post, budget=max(1, budget), wake_lost="batch.wake_lost")

    @property
    def turn(self) -> int:
        """The batch turn this chain runs."""
        return self.ident


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
        chain.hand_over(out)
        if after_step is not None:
            after_step()
        if not chain.may_go_on() or idle():
            return
