"""Messages of the batch scheduler (``actors.batch_scheduler``): the batch lane.

Requests that pass the batching gates reach the scheduler as the gateway's
own ``Generate`` (forwarded with its reply slot, so the scheduler answers the
admission and streams ``TokenEvent`` ... ``DoneEvent`` to ``stream_to``
exactly like the serial lane). ``CancelGeneration`` is forwarded the same way.

The engine-turn token stays with the gateway: the scheduler tells it whether
rows exist (``busy``: the token treats the engine as in use, so no background
step runs) and whether a step has work (``ready``); the gateway grants one
batch turn at a time (``RunBatchStep``: up to ``max_steps`` steps run back to
back as one engine job, a *step chain*) and the scheduler reports it
(``BatchTurnReport``). The gateway asks for a chain's turn back with
``StopBatchChain`` (the serial lane has work). A background step due under
load is lent to the running chain (``LendBackgroundStep``) instead of
cutting it; the scheduler reports it (``LentStepReport``) before the
turn's own report. See docs/batching.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request

__all__ = [
    "BatchCheckpointsLoaded",
    "BatchGather",
    "BatchRetry",
    "BatchStats",
    "BatchStatsRequest",
    "BatchTurnReport",
    "BatchWake",
    "BatchWants",
    "LendBackgroundStep",
    "LentStepReport",
    "RunBatchStep",
    "StopBatchChain",
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
    """Gateway -> scheduler: the engine turn is the batch's for up to ``max_steps`` steps.

    The steps run back to back as one engine job (a step chain) while
    nothing needs the scheduler's decision; the chain ends early when a row
    is ready to join, a row is cancelled, or the gateway sends
    :class:`StopBatchChain`. ``reply_to`` is the gateway: should the
    scheduler's handler raise, the runtime's ``Failure`` reaches the
    gateway, which ends the turn instead of waiting for a report.
    """

    kind: Literal["batch.run_step"] = "batch.run_step"
    turn: int = Field(ge=0)
    max_steps: int = Field(default=1, ge=1)


class StopBatchChain(Body):
    """Gateway -> scheduler: end batch turn ``turn``'s step chain after the step in flight.

    Sent when the serial lane gets work while a chain runs, so the two
    lanes alternate; a turn already ended ignores it.
    """

    kind: Literal["batch.stop_chain"] = "batch.stop_chain"
    turn: int = Field(ge=0)


class LendBackgroundStep(Body):
    """Gateway -> scheduler: run background step ``step_id`` between two steps of turn ``turn``'s chain.

    The scheduler takes the step's callable from the background-step
    registry and the chain's engine thread runs it after its step in
    flight; a chain that ended (or ends first) hands it back. Exactly one
    :class:`LentStepReport` answers it, before the turn's own report.
    """

    kind: Literal["batch.lend_step"] = "batch.lend_step"
    turn: int = Field(ge=0)
    step_id: str


class LentStepReport(Body):
    """Scheduler -> gateway: a lent background step ran (``ran``: ``ok`` or failed, ``held_s``) or came back unrun."""

    kind: Literal["batch.lent_step_report"] = "batch.lent_step_report"
    step_id: str
    ran: bool
    ok: bool = True
    error_code: str = ""
    detail: str = ""
    held_s: float = Field(default=0.0, ge=0.0)


class BatchTurnReport(Body):
    """Scheduler -> gateway: batch step ``turn`` ended.

    ``busy``/``ready`` as in :class:`BatchWants`, after the step; ``left``:
    request ids that ended in this turn (finished, cancelled or failed);
    ``steps``: batch steps the turn ran (its chain; 0 when its work had
    vanished); ``decode_rows``/``tokens``/``prefill_tokens``/``joined``:
    what its last step did.
    """

    kind: Literal["batch.turn_report"] = "batch.turn_report"
    turn: int = Field(ge=0)
    busy: bool
    ready: bool
    ok: bool = True
    error_code: str = ""
    left: tuple[str, ...] = ()
    steps: int = Field(default=1, ge=0)
    decode_rows: int = Field(default=0, ge=0)
    tokens: int = Field(default=0, ge=0)
    prefill_tokens: int = Field(default=0, ge=0)
    joined: int = Field(default=0, ge=0)


class BatchWake(Request):
    """Scheduler -> itself: the engine job of ``turn`` produced a step or ended (posted from the loop).

    ``reply_to`` is the gateway, for the same reason as :class:`RunBatchStep`.
    """

    kind: Literal["batch.wake"] = "batch.wake"
    turn: int = Field(ge=0)


class BatchRetry(Body):
    """Scheduler -> itself: its retry alarm went off; try the streams whose reader was slow again."""

    kind: Literal["batch.retry"] = "batch.retry"


class BatchGather(Body):
    """Scheduler -> itself: its gather alarm went off; rows ready to start an idle batch
    stop waiting for the other arrivals' lookups."""

    kind: Literal["batch.gather"] = "batch.gather"


class BatchCheckpointsLoaded(Body):
    """Scheduler -> itself: generation-checkpoint lookups (worker threads) finished; the
    shell holds their results and feeds them to the core."""

    kind: Literal["batch.checkpoints_loaded"] = "batch.checkpoints_loaded"


class BatchStatsRequest(Request):
    """Ask the scheduler for :class:`BatchStats` (``Engine.stats()``, ``/stats``)."""

    kind: Literal["batch.stats_request"] = "batch.stats_request"


class BatchStats(Body):
    """The batch lane: rows by state, limits, steps and what they did, exits by reason."""

    kind: Literal["batch.stats"] = "batch.stats"
    batch: dict[str, int | bool | dict[str, int]]
