"""Messages of the batch scheduler (``actors.batch_scheduler``): the batch lane.

Requests that pass the batching gates reach the scheduler as the gateway's
own ``Generate`` (forwarded with its reply slot, so the scheduler answers the
admission and streams ``TokenEvent`` ... ``DoneEvent`` to ``stream_to``
exactly like the serial lane). ``CancelGeneration`` is forwarded the same way.

The engine-turn token stays with the gateway: the scheduler tells it whether
rows exist (``busy``: the token treats the engine as in use, so no background
step runs) and whether a step has work (``ready``); the gateway grants one
batch step at a time (``RunBatchStep``) and the scheduler reports it
(``BatchTurnReport``). See docs/batching.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request

__all__ = [
    "BatchRetry",
    "BatchStats",
    "BatchStatsRequest",
    "BatchTurnReport",
    "BatchWake",
    "BatchWants",
    "RunBatchStep",
]


class BatchWants(Body):
    """Scheduler -> gateway: the batch lane's state changed.

    ``busy``: rows are admitted (waiting, looking up, pending or decoding);
    ``ready``: a batch step has work now (a row to join, cancel or decode);
    ``left``: request ids that ended (or were refused) since the last report.
    """

    kind: Literal["batch.wants"] = "batch.wants"
    busy: bool
    ready: bool
    left: tuple[str, ...] = ()


class RunBatchStep(Request):
    """Gateway -> scheduler: the engine turn is the batch's for ONE step.

    ``reply_to`` is the gateway: should the scheduler's handler raise, the
    runtime's ``Failure`` reaches the gateway, which ends the turn instead
    of waiting for a report.
    """

    kind: Literal["batch.run_step"] = "batch.run_step"
    turn: int = Field(ge=0)


class BatchTurnReport(Body):
    """Scheduler -> gateway: batch step ``turn`` ended.

    ``busy``/``ready`` as in :class:`BatchWants`, after the step; ``left``:
    request ids that ended in this step (finished, cancelled or failed);
    ``decode_rows``/``tokens``/``prefill_tokens``/``joined``: what it did.
    """

    kind: Literal["batch.turn_report"] = "batch.turn_report"
    turn: int = Field(ge=0)
    busy: bool
    ready: bool
    ok: bool = True
    error_code: str = ""
    left: tuple[str, ...] = ()
    decode_rows: int = Field(default=0, ge=0)
    tokens: int = Field(default=0, ge=0)
    prefill_tokens: int = Field(default=0, ge=0)
    joined: int = Field(default=0, ge=0)


class BatchWake(Request):
    """Scheduler -> itself: the engine job of ``turn`` ended (posted from the loop).

    ``reply_to`` is the gateway, for the same reason as :class:`RunBatchStep`.
    """

    kind: Literal["batch.wake"] = "batch.wake"
    turn: int = Field(ge=0)


class BatchRetry(Body):
    """Scheduler -> itself: its retry alarm went off; try the streams whose reader was slow again."""

    kind: Literal["batch.retry"] = "batch.retry"


class BatchStatsRequest(Request):
    """Ask the scheduler for :class:`BatchStats` (``Engine.stats()``, ``/stats``)."""

    kind: Literal["batch.stats_request"] = "batch.stats_request"


class BatchStats(Body):
    """The batch lane: rows by state, limits, steps and what they did, exits by reason."""

    kind: Literal["batch.stats"] = "batch.stats"
    batch: dict[str, int | bool | dict[str, int]]
