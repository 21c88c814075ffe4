"""The engine job in flight, shared by the turn runner (event loop) and the engine thread.

A request turn's steps run as ONE engine job (:func:`run_chain`): the next
step starts as soon as one ends, without a trip through the event loop, and
each step's output is handed to the loop as it exists. Every other engine
job (keep or drop a request's cache, a background step) runs through the
same record, so the runner learns of every job's end the same way: a
:class:`~messages.gateway.EngineWake` in its own mailbox. The record and
its cross-thread rules are the batch lane's too:
:class:`actors.runtime.EngineJob` (``stop`` is set by the runner when it
handles ``StopBurst`` or finds the stream gone; ``value`` is what a
non-step job returned).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.engine_thread import AHEAD, EngineJob
from actors.engine_thread.ports import Registered, StepResult
from messages.prompt_cache import EntryRole

__all__ = ["AHEAD", "Burst", "StepOutput", "run_chain"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result, the cache entries registered during it, and (on an opening step) the reuse."""

    result: StepResult
    entries: tuple[tuple[EntryRole, Registered], ...] = ()
    cached_tokens: int | None = None
    open_s: float = 0.0
    """Seconds the opening spent before the step (an SSD landing, a RAM entry's copy): not prefill."""
    checkpoint: Any = None
    """An owned snapshot taken after this step (``actors.checkpoints.Captured``), for the spill queue."""
    resumed: int | None = None
    """On an opening step that found a checkpoint: tokens it replays (-1: unusable, ran fresh)."""


class Burst(EngineJob[StepOutput]):
    """One engine job of the serial lane and what it has produced so far (``ident`` is the job id)."""

    __slots__ = ()

    def __init__(
        self,
        job_id: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[], bool],
        *,
        budget: int = 1,
    ) -> None:
        super().__init__(job_id, loop, post, budget=budget, wake_lost="gateway.wake_lost")

    @property
    def job_id(self) -> int:
        """The runner's id of this job."""
        return self.ident


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
        burst.hand_over(output)
        result = output.result
        if result.phase != "decode" or result.finish_reason is not None:
            return
        if not burst.may_go_on():
            return
