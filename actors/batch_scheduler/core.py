"""Sans-IO core of the batch scheduler: rows, lookups, one batch step per engine turn.

``handle(state, event) -> (state, effects)`` decides; the shell
(``actor.py``) performs the effects, matched exhaustively. The core never
awaits, never reads a clock and never touches the engine: a step leaves as
``SubmitStep`` and comes back as ``StepFinished`` / ``StepFailed`` carrying
plain data (tokens, exits, registered cache handles).

A request's life here: admitted (``Admit``) -> waiting for room (more than
``max_rows`` rows) -> its prompt-cache lookup (``StartLookup`` ...
``LookupAnswered``, made while it waits, never inside a step) -> ready ->
joined by the next step (the lookup's handle is materialized on the engine
thread, then its lease released) -> one token per step -> it leaves with its
``DoneEvent``, its cache ``Put`` into the prompt cache.

Invariants (checked by the tests):

- at most one engine job in flight; steps run only in a turn the gateway
  granted (``TurnGranted``), at most its ``max_steps``, and every granted
  turn is reported exactly once (``ReportTurn``);
- a turn's steps run back to back as a *step chain* (one engine job, its
  steps handed back one by one as ``StepFinished``); a row ready to join
  and a joined row to remove (cancel, slow reader) are handed to the
  running chain (``OfferRows``), whose next step takes them, so rows
  arriving and leaving all the time never end it. A chain that no longer
  takes rows hands the offered ones back (``RowsReturned``: they are
  ready, or to be removed, again) and ends; the turn then goes on with a
  new job within its grant. Once the gateway asks for the turn back
  (``YieldTurn``) or the scheduler stops, the chain is told to end after
  the step in flight (``StopChain``) and the turn is reported;
- ``busy`` (told to the gateway with ``Status`` whenever it changes) is
  true while any row exists, waiting ones included, so the gateway grants
  no background step between the steps of active rows;
- rows arriving together start together: while no row is joined (a
  chain still in flight after its last row left included: nothing is
  offered to it meanwhile), a ready row waits (``ready`` stays false) for
  the lookups of the other placed
  rows and for requests announced as arriving (``Arriving``: rendered and
  tokenized before their ``Admit``), at most ``gather_s`` (``ArmGather`` ...
  ``GatherDue``), so their prompts prefill in shared steps instead of one
  step per arrival; an announced request that is never admitted here stops
  counting ``gather_s`` after its announcement;
- at most ``max_rows`` rows hold a lookup, wait to join or are joined; at
  most ``max_queue`` more wait for room, later ones are refused
  (``queue_full``);
- a cancel of a row not yet joined ends its stream at once (its lease
  released); a joined row is removed by the next step, before it decodes
  (so within one step), and its cache is kept;
- every lease is released exactly once; every registered entry is ``Put``;
- a row whose stream is full never holds up the others: once a delivery to
  it is refused (``StreamFull``), its events wait in its *outbox* (at most
  ``backlog_max`` tokens, then its final event) and go out in order through
  ``Deliver`` as its reader makes room (tried once after every event that
  is not an answer to this core's own effects, and by a retry alarm,
  ``ArmRetry``), so handling one event always comes to rest; a row that
  reaches ``backlog_max`` held tokens is removed by the next step (its
  cache kept) and its stream ends, after the held tokens, with
  ``ErrorEvent(slow_reader)``;
- a held stream that takes nothing for ``write_timeout_s`` (the
  stream-write deadline) is gone: its held events are dropped, it ends at
  once with ``ErrorEvent(stream_write_timeout)`` (``StreamTimedOut``), and
  its row, if still in the batch, is removed by the next step (its cache
  kept); nothing more is sent to it;
- generation checkpoints (docs/cold-tier.md): a row admitted with a
  checkpoint key looks its checkpoint up beside its prompt-cache lookup
  (``LoadCheckpoint`` ... ``CheckpointLoaded``, a worker thread, while it
  waits, never inside a step) and is ready once both answered; a found
  checkpoint makes it join resumed and gives the prompt cache's lease
  back (``ReleaseLease``), none found joins with what the lookup found. Every
  snapshot a step hands back goes out as ``SendCheckpoint`` (its row gone:
  with no key, so the shell frees it); an answer that finishes (stop or
  length) with checkpoints sent or found voids them (``VoidCheckpoints``);
  a cancel or a failure keeps them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal, assert_never

from actors.checkpoints import Captured
from actors.engine_thread.ports import Registered
from actors.errors import MemoryPressure, MemoryShortAtStart
from actors.prompt_cache.core import common_prefix_len
from messages.batch_scheduler import BatchTurnReport
from messages.gateway import (
    DoneEvent,
    ErrorEvent,
    FinishReason,
    Generate,
    Timings,
    TokenEvent,
    Usage,
)
from messages.prompt_cache import EntryRole, Put, TakeResult

__all__ = [
    "MIN_OBSERVED_PREFILL",
    "STREAM_WRITE_TIMEOUT",
    "Admit",
    "AnswerAdmission",
    "ArmGather",
    "ArmRetry",
    "BeginDrain",
    "Cancel",
    "CheckpointLoaded",
    "Deliver",
    "Delivered",
    "Effect",
    "EmitToken",
    "EndStream",
    "Event",
    "ExitOut",
    "GatherDue",
    "JobEnded",
    "JoinRow",
    "LoadCheckpoint",
    "LookupAnswered",
    "ObservePrefill",
    "OfferRows",
    "Outbox",
    "PutEntry",
    "ReleaseLease",
    "ReportTurn",
    "Resumed",
    "RetryDelivery",
    "RowFailure",
    "RowsReturned",
    "SchedulerState",
    "SendCheckpoint",
    "StartLookup",
    "Status",
    "StepFailed",
    "StepFinished",
    "StepOut",
    "StopChain",
    "Stopping",
    "StreamFull",
    "StreamGone",
    "StreamTimedOut",
    "SubmitStep",
    "TokenOut",
    "TurnGranted",
    "VoidCheckpoints",
    "YieldTurn",
    "handle",
]

RowPhase = Literal["waiting", "lookup", "ready", "deferred", "joined"]

STREAM_WRITE_TIMEOUT = "stream_write_timeout"
"""``ErrorEvent.error_code`` of a stream that took nothing for the stream-write deadline."""


# --- what an engine step hands back (plain data) ---------------------------------


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One row's token of a step (``finish_reason`` on its last)."""

    request_id: str
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    finish_reason: Literal["stop", "length"] | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ExitOut:
    """A row that left in a step, with its cache registered (``None``: nothing kept)."""

    request_id: str
    reason: FinishReason
    completion_tokens: int
    entry: Registered | None = None


@dataclass(frozen=True, slots=True)
class RowFailure:
    """A row that left the batch alone with an error (its stream ends with an ``ErrorEvent``)."""

    request_id: str
    error_code: str
    detail: str


@dataclass(frozen=True, slots=True)
class StepOut:
    """What one batch step did on the engine thread.

    ``joined``: (request id, prompt tokens really reused) of rows that
    entered the batch this step (a lookup that could not be materialized
    joins cold: 0); ``prefilled``: rows whose prompt is now in the batch's
    cache (they decode from the next step on). ``restored``: joined rows
    whose prefix was copied from a cold-tier (SSD) hit's host buffers;
    ``restore_failed``: joined rows whose SSD hit could not be restored
    (they joined cold). ``failed``: rows that left alone with an error
    (:class:`RowFailure`; the memory guard's refusal), the others going on.
    ``join_s``: seconds the step spent joining rows before its forward
    (landing SSD hits, copying RAM prefixes): not prefill. ``checkpoints``:
    rows' checkpoint snapshots (registered, owned by whoever holds them);
    ``resumed``: rows joined from a checkpoint and the tokens each replays
    (-1: the checkpoint did not fit, the row joined cold). ``step_s``: the
    step's seconds on the engine thread, joins included (0: not measured).
    ``since_clear``, ``cleared``, ``cleared_bytes``, ``clear_s``: the kernel's
    :class:`~kernels.engine.BatchStep` fields (MLX's buffer cache emptied).
    """

    tokens: tuple[TokenOut, ...] = ()
    exits: tuple[ExitOut, ...] = ()
    snapshots: tuple[tuple[str, Registered], ...] = ()
    joined: tuple[tuple[str, int], ...] = ()
    prefilled: tuple[str, ...] = ()
    decode_rows: int = 0
    prefill_tokens: int = 0
    restored: tuple[str, ...] = ()
    restore_failed: tuple[str, ...] = ()
    failed: tuple[RowFailure, ...] = ()
    join_s: float = 0.0
    checkpoints: tuple[tuple[str, Captured], ...] = ()
    resumed: tuple[tuple[str, int], ...] = ()
    step_s: float = 0.0
    since_clear: int = 0
    cleared: bool = False
    cleared_bytes: int = 0
    clear_s: float = 0.0


@dataclass(frozen=True, slots=True)
class JoinRow:
    """A row for the next step to join: the request and the lookup to materialize.

    ``handle``: a RAM entry; ``staging_id``: a cold-tier (SSD) hit whose file
    bytes wait in host buffers; either way its first ``cached_tokens`` are reused.
    ``checkpoint``: take generation checkpoints of this row; ``resume``: a
    found checkpoint to join from (the core sets ``True``; the shell, which
    holds the host bytes, puts the ``actors.checkpoints.ResumeFrom`` there).
    """

    request: Generate
    handle: str | None = None
    cached_tokens: int = 0
    staging_id: str | None = None
    checkpoint: bool = False
    resume: Any = None


# --- events (shell -> core) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """A request the gateway routed to the batch lane (``checkpoint_key``: its key, ``None``: not checkpointed)."""

    request: Generate
    correlation_id: str
    now: float
    checkpoint_key: str | None = None


@dataclass(frozen=True, slots=True)
class Arriving:
    """A request is being prepared; its ``Admit`` may follow (a hint for the gather)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class CheckpointLoaded:
    """``request_id``'s checkpoint lookup ended: ``found`` one (the shell holds its host bytes) or not."""

    request_id: str
    found: bool
    now: float


@dataclass(frozen=True, slots=True)
class LookupAnswered:
    """The prompt cache answered ``request_id``'s ``Take`` (``None``: it could not: a miss)."""

    request_id: str
    result: TakeResult | None
    now: float


@dataclass(frozen=True, slots=True)
class Cancel:
    """The requester left."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class StreamGone:
    """Delivering to ``request_id``'s stream failed: its reader is gone (a cancel)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class TurnGranted:
    """The gateway granted batch turn ``turn``: up to ``max_steps`` steps."""

    turn: int
    now: float
    max_steps: int = 1


@dataclass(frozen=True, slots=True)
class StepFinished:
    """A step of turn ``turn`` ended with ``out``; ``last``: its engine job ended with it."""

    turn: int
    out: StepOut
    now: float
    last: bool = True


@dataclass(frozen=True, slots=True)
class JobEnded:
    """The engine job of turn ``turn`` ended after the steps already handed in (``StepFinished``)."""

    turn: int
    now: float


@dataclass(frozen=True, slots=True)
class RowsReturned:
    """Turn ``turn``'s job did not take these offered rows (``OfferRows``): it had closed."""

    turn: int
    joins: tuple[str, ...]
    cancels: tuple[str, ...]
    now: float


@dataclass(frozen=True, slots=True)
class YieldTurn:
    """The gateway asks for turn ``turn`` back: its chain ends after the step in flight."""

    turn: int
    now: float


@dataclass(frozen=True, slots=True)
class StepFailed:
    """The engine job of step ``turn`` raised (or could not start); every joined row fails."""

    turn: int
    error_code: str
    detail: str
    now: float


@dataclass(frozen=True, slots=True)
class BeginDrain:
    """Stop admitting; rows already admitted finish."""

    now: float


@dataclass(frozen=True, slots=True)
class StreamFull:
    """An ``EmitToken`` / ``EndStream`` was not performed: the stream was full (or refused
    an earlier event of the same effects). ``event`` is what was not delivered."""

    request_id: str
    stream_to: str
    correlation_id: str
    event: TokenEvent | DoneEvent | ErrorEvent
    now: float


@dataclass(frozen=True, slots=True)
class Delivered:
    """What a ``Deliver`` did: the first ``sent`` events went out; ``ended``: the final too;
    ``gone``: the stream is closed (its reader left)."""

    request_id: str
    sent: int
    ended: bool
    gone: bool
    now: float


@dataclass(frozen=True, slots=True)
class RetryDelivery:
    """The retry alarm went off: try the held streams again."""

    now: float


@dataclass(frozen=True, slots=True)
class GatherDue:
    """The gather alarm went off: rows ready to start stop waiting for the other lookups."""

    now: float


@dataclass(frozen=True, slots=True)
class Stopping:
    """The scheduler stops: every lease still held is given back (the rows are dropped)."""

    now: float


Event = (
    Admit
    | Arriving
    | CheckpointLoaded
    | LookupAnswered
    | Cancel
    | StreamGone
    | TurnGranted
    | StepFinished
    | JobEnded
    | RowsReturned
    | YieldTurn
    | StepFailed
    | BeginDrain
    | Stopping
    | StreamFull
    | Delivered
    | RetryDelivery
    | GatherDue
)


# --- effects (core -> shell) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnswerAdmission:
    """Answer the forwarded ``Generate`` (accepted with its position, or refused)."""

    request_id: str
    accepted: bool
    position: int = 0
    error_code: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StartLookup:
    """Send ``request_id``'s ``Take`` to the prompt cache; answer with ``LookupAnswered``."""

    request: Generate
    correlation_id: str


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    """Look ``request``'s checkpoint ``key`` up on a worker thread; answer with ``CheckpointLoaded``."""

    request: Generate
    key: str


@dataclass(frozen=True, slots=True)
class SendCheckpoint:
    """Hand a checkpoint snapshot to the spill queue without waiting (``key`` ``None``: free it)."""

    key: str | None
    namespace: str
    captured: Captured


@dataclass(frozen=True, slots=True)
class VoidCheckpoints:
    """A finished answer: its checkpoints go (queued ones dropped, files removed)."""

    key: str


@dataclass(frozen=True, slots=True)
class Resumed:
    """A row joined from a checkpoint (``replayed`` tokens; -1: it did not fit) with its prompt's length."""

    request_id: str
    replayed: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """Give a lookup's lease back to the prompt cache."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class SubmitStep:
    """Run turn ``turn``'s engine job: cancel ``cancels``, join ``joins``, then up to
    ``max_steps`` steps back to back (ended early by ``StopChain``, an idle batch or the
    chain's lead over the steps handed back)."""

    turn: int
    joins: tuple[JoinRow, ...]
    cancels: tuple[str, ...]
    max_steps: int = 1


@dataclass(frozen=True, slots=True)
class OfferRows:
    """Hand turn ``turn``'s running chain rows to join and joined rows to remove, for its next step.

    NOTE: the shell answers a chain that no longer takes rows with ``RowsReturned``.
    """

    turn: int
    joins: tuple[JoinRow, ...]
    cancels: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopChain:
    """End turn ``turn``'s step chain after the step in flight (its steps so far still come back)."""

    turn: int


@dataclass(frozen=True, slots=True)
class EmitToken:
    """Send one token event to a row's stream."""

    stream_to: str
    event: TokenEvent
    correlation_id: str


@dataclass(frozen=True, slots=True)
class EndStream:
    """End a row's stream with its final event."""

    stream_to: str
    final: DoneEvent | ErrorEvent
    correlation_id: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Send a held row's ``events`` to its stream in order without waiting, stopping at the
    first the stream refuses; then, if every one went out, end it with ``final``.
    Answer with ``Delivered``."""

    request_id: str
    stream_to: str
    events: tuple[TokenEvent, ...]
    final: DoneEvent | ErrorEvent | None
    correlation_id: str


@dataclass(frozen=True, slots=True)
class StreamTimedOut:
    """A held stream took nothing for the stream-write deadline: end it now with ``final``
    (its held events are dropped) and say so once (the shell logs it)."""

    request_id: str
    stream_to: str
    final: ErrorEvent
    correlation_id: str


@dataclass(frozen=True, slots=True)
class ArmRetry:
    """Set the one retry alarm for clock time ``at`` (``None``: cancel it); it answers ``RetryDelivery``."""

    at: float | None


@dataclass(frozen=True, slots=True)
class ArmGather:
    """Set the gather alarm for clock time ``at`` (``None``: cancel it); it answers ``GatherDue``."""

    at: float | None


@dataclass(frozen=True, slots=True)
class ObservePrefill:
    """Report a measured prefill (``tokens`` forwarded in ``seconds``) to the cold tier's
    restore-or-recompute estimator; dropped when it cannot take it."""

    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PutEntry:
    """Hand a registered cache to the prompt cache."""

    put: Put
    correlation_id: str


@dataclass(frozen=True, slots=True)
class ReportTurn:
    """Tell the gateway the granted step ended."""

    report: BatchTurnReport


@dataclass(frozen=True, slots=True)
class Status:
    """Tell the gateway whether rows exist (``busy``), a step has work (``ready``), who ended (``left``)."""

    busy: bool
    ready: bool
    left: tuple[str, ...] = ()


Effect = (
    AnswerAdmission
    | StartLookup
    | LoadCheckpoint
    | SendCheckpoint
    | VoidCheckpoints
    | Resumed
    | ReleaseLease
    | SubmitStep
    | OfferRows
    | StopChain
    | EmitToken
    | EndStream
    | Deliver
    | StreamTimedOut
    | ArmRetry
    | ArmGather
    | ObservePrefill
    | PutEntry
    | ReportTurn
    | Status
)


# --- state -----------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One admitted request."""

    request: Generate
    correlation_id: str
    admitted_at: float
    phase: RowPhase = "waiting"
    lookup: TakeResult | None = None
    cancelled: bool = False
    joined_at: float = 0.0
    first_token_at: float = 0.0
    lookup_started_at: float | None = None
    lookup_done_at: float | None = None
    """When its first lookup was sent and its last one answered (``Timings``)."""
    tokens: int = 0
    cached_tokens: int = 0
    prefilled: bool = False
    relooked: bool = False
    wait_for: str | None = None
    """The row whose prompt-boundary snapshot this deferred row waits for."""
    slow: bool = False
    """Its reader fell ``backlog_max`` tokens behind: the next step removes it."""
    removing: bool = False
    """A submitted job's step removes it (its cancel was sent)."""
    offered: bool = False
    """Its join was offered to the running chain and no step has confirmed it yet."""
    timed_out: bool = False
    """Its stream was ended at the stream-write deadline: nothing more is sent to it."""
    checkpoint_key: str | None = None
    """Its generation-checkpoint key (``None``: not checkpointed)."""
    checkpoint_looked: bool = False
    checkpoint_pending: bool = False
    """Its checkpoint lookup was sent and not yet answered."""
    take_pending: bool = False
    """Its prompt-cache lookup (``StartLookup``) was sent and not yet answered."""
    resume: bool = False
    """A checkpoint was found: the row joins from it (the shell holds its bytes)."""
    checkpoint_files: bool = False
    """Checkpoints of its key may exist (found, or one was sent)."""


@dataclass(slots=True)
class Outbox:
    """A row's events its full stream has not taken yet, in order (its final event last)."""

    stream_to: str
    correlation_id: str
    events: deque[TokenEvent] = field(default_factory=deque)
    final: DoneEvent | ErrorEvent | None = None
    attempting: bool = False
    """A ``Deliver`` of it is being performed (its ``Delivered`` has not come back)."""
    since: float = 0.0
    """When its stream last refused an event with nothing taken since (the deadline's start)."""


@dataclass(slots=True)
class Counters:
    """What the batch lane did so far."""

    admitted: int = 0
    rejected_queue_full: int = 0
    rejected_shutting_down: int = 0
    steps: int = 0
    failed_steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    joined: int = 0
    cached_tokens: int = 0
    max_rows_decoded: int = 0
    deferred: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    cancelled: int = 0
    failed: int = 0
    entries_put: int = 0
    restored: int = 0
    restored_tokens: int = 0
    restore_failed: int = 0
    failed_alone: int = 0
    memory_refused: int = 0
    memory_taken_back: int = 0
    streams_full: int = 0
    slow_readers: int = 0
    stream_timeouts: int = 0
    checkpoint_lookups: int = 0
    checkpoints_found: int = 0
    checkpoints_sent: int = 0
    checkpoints_resumed: int = 0
    checkpoint_resume_failed: int = 0


@dataclass(slots=True)
class SchedulerState:
    """The scheduler's decision state; :func:`handle` is the only thing that changes it.

    ``lookups``: a prompt cache is attached (every row looks up before it joins).
    """

    max_rows: int
    max_queue: int
    lookups: bool = False
    share_min: int = 64
    """A ready row waits for a prefilling row's snapshot when their prompts share
    at least this many tokens more than its own lookup found."""
    rows: dict[str, Row] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)
    in_flight: int | None = None
    """The turn whose engine job runs (``None``: none)."""
    draining: bool = False
    told: tuple[bool, bool] = (False, False)
    """The last (busy, ready) told to the gateway."""
    ended: list[str] = field(default_factory=list)
    """Requests that ended (or were refused) since the gateway was last told."""
    stats: Counters = field(default_factory=Counters)
    backlog_max: int = 1024
    """Tokens held for a row whose stream is full before the row is stopped (``slow_reader``)."""
    deliver_chunk: int = 64
    """Held events one ``Deliver`` carries at most."""
    retry_s: float = 0.02
    """How long after the last event the held streams are tried again."""
    write_timeout_s: float = 30.0
    """How long a held stream may take nothing before it is gone (``stream_write_timeout``)."""
    gather_s: float = 0.05
    """How long, at most, rows ready to start an idle batch wait for the other placed rows'
    lookups and for announced arrivals (and how long an announcement counts)."""
    arriving: dict[str, float] = field(default_factory=dict)
    """Requests announced (``Arriving``) and not admitted yet: when each was announced."""
    gather_until: float | None = None
    """While set, ready rows of an idle batch wait for lookups until this clock time (alarm armed)."""
    gathered: bool = False
    """The wait of this idle spell ended (every lookup answered, or ``gather_s`` passed)."""
    outboxes: dict[str, Outbox] = field(default_factory=dict)
    """Rows (joined or already gone) whose stream refused an event, by request id."""
    retry_armed: bool = False
    observe_prefill: bool = False
    """Report pure-prefill steps' speed (``ObservePrefill``): a cold tier's estimator listens."""
    step_from: float = 0.0
    """When the step in flight began, as the loop saw it (the grant, then the previous step's end)."""
    chain_budget: int = 1
    """Steps the turn in flight may run."""
    chain_steps: int = 0
    """Steps of the turn in flight handed back so far."""
    chain_stop: bool = False
    """The turn in flight must end after its step in flight (``StopChain`` sent)."""
    offerable: bool = False
    """The job in flight may take rows (``OfferRows``): its grant allows more than one step
    and it has handed back no offered row."""
    yield_asked: bool = False
    """The gateway asked for the turn in flight back."""
    stopping: bool = False
    """The scheduler stops: no step chain goes on."""
    last_step: StepOut | None = None
    """The turn in flight's latest step (what its report describes)."""

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.backlog_max < 1 or self.deliver_chunk < 1 or self.retry_s <= 0:
            raise ValueError("backlog_max and deliver_chunk must be >= 1, retry_s > 0")
        if not self.write_timeout_s > 0:
            raise ValueError("write_timeout_s must be > 0")

    # --- queries -------------------------------------------------------------------

    def placed(self) -> int:
        """Rows that hold a lookup, wait to join or are joined (at most ``max_rows``)."""
        return sum(1 for r in self.rows.values() if r.phase != "waiting")

    @property
    def busy(self) -> bool:
        """Any admitted row (waiting ones too)."""
        return bool(self.rows)

    @property
    def ready(self) -> bool:
        """A step has work: a row joined (decoding, prefilling or to be cancelled), or one ready
        to join that is not waiting for the other arrivals' lookups (``gather_until``)."""
        if self.gather_until is not None:
            return any(r.phase == "joined" for r in self.rows.values())
        return any(r.phase in ("ready", "joined") for r in self.rows.values())

    def snapshot(self) -> dict[str, int | bool | dict[str, int]]:
        """JSON-ready statistics."""
        by_phase = dict.fromkeys(("waiting", "lookup", "ready", "deferred", "joined"), 0)
        for r in self.rows.values():
            by_phase[r.phase] += 1
        s = self.stats
        return {
            "max_rows": self.max_rows,
            "max_queue": self.max_queue,
            "gather_ms": round(self.gather_s * 1000),
            "busy": self.busy,
            "step_in_flight": self.in_flight is not None,
            "rows": by_phase,
            "requests": {
                "admitted": s.admitted,
                "rejected_queue_full": s.rejected_queue_full,
                "rejected_shutting_down": s.rejected_shutting_down,
                "finished_stop": s.finished_stop,
                "finished_length": s.finished_length,
                "cancelled": s.cancelled,
                "failed": s.failed,
            },
            "steps": {
                "run": s.steps,
                "failed": s.failed_steps,
                "tokens": s.tokens,
                "prefill_tokens": s.prefill_tokens,
                "max_rows_decoded": s.max_rows_decoded,
            },
            "joined": s.joined,
            "deferred": s.deferred,
            "cached_tokens": s.cached_tokens,
            "entries_put": s.entries_put,
            "ssd": {
                "restored": s.restored,
                "restored_tokens": s.restored_tokens,
                "restore_failed": s.restore_failed,
            },
            "rows_failed_alone": s.failed_alone,
            "memory_refused": s.memory_refused,
            "memory_taken_back": s.memory_taken_back,
            "streams": {
                "held": len(self.outboxes),
                "held_events": sum(len(b.events) for b in self.outboxes.values()),
                "full": s.streams_full,
                "slow_readers": s.slow_readers,
                "write_timeouts": s.stream_timeouts,
            },
            "checkpoints": {
                "lookups": s.checkpoint_lookups,
                "found": s.checkpoints_found,
                "sent": s.checkpoints_sent,
                "resumed": s.checkpoints_resumed,
                "resume_failed": s.checkpoint_resume_failed,
            },
        }


# --- the core ----------------------------------------------------------------------------


def handle(state: SchedulerState, event: Event) -> tuple[SchedulerState, list[Effect]]:
    """Apply one event; return the next state and the effects to perform, in order.

    NOTE: the state is updated in place and returned. A report for a turn
    that is not in flight raises ``ValueError`` before anything changes.
    """
    out: list[Effect] = []
    match event:
        case Admit():
            state.arriving.pop(event.request.request_id, None)
            _admit(state, event, out)
        case Arriving():
            # NOTE: bounded: no more announcements are kept than rows could be admitted.
            if len(state.arriving) < state.max_rows + state.max_queue:
                state.arriving[event.request_id] = event.now
        case CheckpointLoaded():
            _checkpoint_loaded(state, event, out)
        case LookupAnswered():
            _lookup_answered(state, event, out)
        case Cancel() | StreamGone():
            _cancel(state, event.request_id, event.now, out)
        case TurnGranted():
            _turn_granted(state, event, out)
        case StepFinished():
            _step_finished(state, event, out)
        case JobEnded():
            _job_ended(state, event.turn, event.now, out)
        case RowsReturned():
            _rows_returned(state, event)
        case YieldTurn():
            if state.in_flight == event.turn:
                state.yield_asked = True
        case StepFailed():
            _step_failed(state, event, out)
        case BeginDrain():
            state.draining = True
        case Stopping():
            _stopping(state, out)
        case StreamFull():
            _stream_full(state, event, out)
        case Delivered():
            _delivered(state, event, out)
        case RetryDelivery():
            state.retry_armed = False
        case GatherDue():
            pass  # NOTE: _gather ends a wait whose time is up, on this or any later event.
        case _:
            assert_never(event)
    _wake_deferred(state, out)
    _place(state, out, event.now)
    _deliver_held(state, event, out)
    _gather(state, event.now, out)
    if (
        state.in_flight is not None
        and not state.chain_stop
        and state.offerable
        and state.gather_until is None
        and not (state.yield_asked or state.stopping)
    ):
        joins, cancels = _collect(state, event.now, out, offer=True)
        if joins or cancels:
            out.append(OfferRows(state.in_flight, tuple(joins), tuple(cancels)))
    if state.in_flight is not None and not state.chain_stop and _must_stop(state):
        state.chain_stop = True
        state.offerable = False
        if state.chain_budget > 1:
            out.append(StopChain(state.in_flight))
    busy, ready = state.busy, state.ready
    left = tuple(state.ended)
    state.ended.clear()
    reported = False
    for i, effect in enumerate(out):
        if isinstance(effect, ReportTurn):
            # NOTE: the report carries the state after this event (rows placed)
            # and every request that ended, so the gateway forgets their ids.
            update = {"busy": busy, "ready": ready, "left": left}
            out[i] = ReportTurn(effect.report.model_copy(update=update))
            reported = True
    if not reported and ((busy, ready) != state.told or left):
        out.append(Status(busy, ready, left))
    state.told = (busy, ready)
    return state, out


def _admit(state: SchedulerState, ev: Admit, out: list[Effect]) -> None:
    rid = ev.request.request_id
    if rid in state.rows:
        out.append(
            AnswerAdmission(rid, False, error_code="duplicate_id", detail="already admitted")
        )
        return
    if state.draining:
        state.ended.append(rid)
        state.stats.rejected_shutting_down += 1
        out.append(
            AnswerAdmission(
                rid, False, error_code="shutting_down", detail="the server is shutting down"
            )
        )
        return
    room = state.placed() < state.max_rows
    if not room and len(state.waiting) >= state.max_queue:
        state.ended.append(rid)
        state.stats.rejected_queue_full += 1
        out.append(
            AnswerAdmission(
                rid,
                False,
                position=len(state.waiting),
                error_code="queue_full",
                detail=f"{state.max_rows} rows in the batch, {len(state.waiting)} waiting, max_queue={state.max_queue}",
            )
        )
        return
    state.rows[rid] = Row(ev.request, ev.correlation_id, ev.now, checkpoint_key=ev.checkpoint_key)
    state.waiting.append(rid)
    state.stats.admitted += 1
    position = 0 if room else len(state.waiting)
    out.append(AnswerAdmission(rid, True, position=position))


def _place(state: SchedulerState, out: list[Effect], now: float) -> None:
    """Move waiting rows into the batch's room: start their lookups (or make them ready)."""
    while state.waiting and state.placed() < state.max_rows:
        rid = state.waiting.popleft()
        row = state.rows[rid]
        row.phase = "ready"
        if row.checkpoint_key is not None and not row.checkpoint_looked:
            # NOTE: beside the prompt-cache lookup, not before it: a
            # checkpoint is found only for the retry of an interrupted
            # answer, and a lookup that waited for the checkpoint's worker
            # thread put a thread hop (and its wait for the GIL) in front of
            # every keyed row's Take. The row still waits for the later of
            # the two answers (on the CPU stand-in the lookup phase did not
            # shorten beyond the spread, docs/benchmarks.md 2026-12-07). A
            # found checkpoint gives the Take's lease back (_lookups_ended).
            row.checkpoint_looked = row.checkpoint_pending = True
            state.stats.checkpoint_lookups += 1
            out.append(LoadCheckpoint(row.request, row.checkpoint_key))
        if state.lookups and len(row.request.prompt_tokens) > 1:
            row.take_pending = True
            out.append(StartLookup(row.request, row.correlation_id))
        if row.checkpoint_pending or row.take_pending:
            row.phase = "lookup"
            row.lookup_started_at = now


def _checkpoint_loaded(state: SchedulerState, ev: CheckpointLoaded, out: list[Effect]) -> None:
    row = state.rows.get(ev.request_id)
    if row is None or row.phase != "lookup" or not row.checkpoint_pending:
        return  # NOTE: the row left while its lookup ran (the shell drops the bytes).
    row.checkpoint_pending = False
    if ev.found:
        state.stats.checkpoints_found += 1
        row.resume = True
        row.checkpoint_files = True
    _lookups_ended(row, ev.now, out)


def _lookup_answered(state: SchedulerState, ev: LookupAnswered, out: list[Effect]) -> None:
    row = state.rows.get(ev.request_id)
    if row is None or row.phase != "lookup" or not row.take_pending:
        # NOTE: the row left while its lookup ran: the lease is ours to give back.
        if ev.result is not None and ev.result.lease_id is not None:
            out.append(ReleaseLease(ev.result.lease_id))
        return
    row.take_pending = False
    row.lookup = ev.result
    _lookups_ended(row, ev.now, out)


def _lookups_ended(row: Row, now: float, out: list[Effect]) -> None:
    """Make ``row`` ready once its checkpoint and prompt-cache lookups both answered.

    A found checkpoint holds the whole answer so far: the row joins resumed
    and the prompt cache's lease (and any staged SSD restore) goes back.
    """
    if row.checkpoint_pending or row.take_pending:
        return
    if row.resume and row.lookup is not None:
        if row.lookup.lease_id is not None:
            out.append(ReleaseLease(row.lookup.lease_id))
        row.lookup = None
    row.lookup_done_at = now
    row.phase = "ready"


def _cancel(
    state: SchedulerState, rid: str, now: float, out: list[Effect], *, end_stream: bool = True
) -> None:
    row = state.rows.get(rid)
    if row is None:
        return  # NOTE: a cancel may race the row's own end.
    if row.phase == "joined":
        # NOTE: the row is in the engine's batch: the next step removes it
        # (before it decodes) and keeps its cache.
        row.cancelled = True
        return
    if rid in state.waiting:
        state.waiting.remove(rid)
    if row.lookup is not None and row.lookup.lease_id is not None:
        out.append(ReleaseLease(row.lookup.lease_id))
    # NOTE: a lookup still running is released when its answer comes (row gone).
    del state.rows[rid]
    state.ended.append(rid)
    state.stats.cancelled += 1
    request = row.request
    done = DoneEvent(
        request_id=rid,
        finish_reason="cancelled",
        usage=Usage(prompt_tokens=len(request.prompt_tokens), completion_tokens=0),
        timings=Timings(queued_s=max(0.0, now - row.admitted_at)),
    )
    if end_stream:
        _send_final(state, rid, request.stream_to, done, row.correlation_id, out)


def _turn_granted(state: SchedulerState, ev: TurnGranted, out: list[Effect]) -> None:
    if state.in_flight is not None:
        raise ValueError(f"batch turn {ev.turn} granted while turn {state.in_flight} runs")
    joins, cancels = _collect(state, ev.now, out, offer=False)
    if not joins and not any(r.phase == "joined" for r in state.rows.values()):
        # NOTE: the work vanished between the grant and now (every row left).
        out.append(ReportTurn(_report(state, ev.turn, steps=0)))
        return
    state.in_flight = ev.turn
    state.step_from = ev.now
    state.chain_budget = max(1, ev.max_steps)
    state.chain_steps = 0
    state.yield_asked = False
    state.last_step = None
    _submit(state, ev.turn, joins, cancels, state.chain_budget, out)


def _submit(
    state: SchedulerState,
    turn: int,
    joins: list[JoinRow],
    cancels: list[str],
    steps: int,
    out: list[Effect],
) -> None:
    """Start a job of the turn in flight that may run ``steps`` steps."""
    state.chain_stop = False
    # NOTE: a one-step job ends with its first step: rows offered to it would come back.
    state.offerable = steps > 1
    out.append(SubmitStep(turn, tuple(joins), tuple(cancels), steps))


def _collect(
    state: SchedulerState, now: float, out: list[Effect], *, offer: bool
) -> tuple[list[JoinRow], list[str]]:
    """The rows a step is to join (marked joined) and to remove (marked removing).

    ``offer``: for a running chain (``OfferRows``), which leaves out a row
    resuming from a checkpoint (its bytes join only with a job's first
    step) and the cancel of a row whose offered join no step confirmed yet
    (a cancel taken before that join would find nothing to remove).
    """
    joins: list[JoinRow] = []
    cancels: list[str] = []
    for rid, row in state.rows.items():
        if row.phase == "ready" and _defer(state, row, out):
            continue
        if row.phase == "ready":
            if offer and row.resume:
                continue
            lookup = row.lookup
            keyed = row.checkpoint_key is not None
            if lookup is None:
                joins.append(JoinRow(row.request, checkpoint=keyed, resume=row.resume or None))
            else:
                joins.append(JoinRow(row.request, lookup.handle, _lent(lookup), lookup.staging_id,
                                     checkpoint=keyed))
            row.resume = False
            row.phase = "joined"
            row.joined_at = now
            row.offered = offer
        elif row.phase == "joined" and row.cancelled and not row.removing and not row.offered:
            cancels.append(rid)
            row.removing = True
    return joins, cancels


def _rows_returned(state: SchedulerState, ev: RowsReturned) -> None:
    """Offered rows the job did not take: ready (or to be removed) again; the job takes no more.

    NOTE: it may come after its turn ended (an offer refused in the batch
    whose job could not start: ``StepFailed``, handled first, failed every
    joined row, the offered ones too); then it finds nothing to change.
    """
    if state.in_flight == ev.turn:
        state.offerable = False
    for rid in ev.joins:
        row = state.rows.get(rid)
        if row is not None and row.phase == "joined" and row.offered:
            row.phase = "ready"
            row.offered = False
    for rid in ev.cancels:
        row = state.rows.get(rid)
        if row is not None and row.removing:
            row.removing = False


def _gather(state: SchedulerState, now: float, out: list[Effect]) -> None:
    """Let the rows of an idle batch that arrived together start together.

    NOTE: requests sent at once are admitted and looked up one by one; a
    grant at the first answer would start that row alone and the others
    one step later each, every arrival prefilling in a step of its own
    (measured with 8 rows of 512 tokens: the last row decoding about
    twice as late as when all join at once). So while no row is joined,
    a ready row waits for the other placed rows' lookups
    (a RAM lookup answers within a millisecond or so), but never longer
    than ``gather_s`` (a cold-tier lookup reads a file first). Once
    joined rows exist, a ready row never waits: decoding rows would. A
    chain in flight with no joined row left is idle too; nothing is offered
    to it while the rows wait.
    """
    rows = state.rows.values()
    for rid in [r for r, at in state.arriving.items() if now >= at + state.gather_s]:
        del state.arriving[rid]  # NOTE: never admitted here (refused, or the serial lane's).
    if state.gather_until is not None and now >= state.gather_until:
        # NOTE: checked on every event, so a lost alarm note delays nothing past the next event.
        state.gather_until = None
        state.gathered = True
    # NOTE: idle is no row joined, whether or not a turn is in flight: a chain
    # whose last row just left (its answer delivered, the job not yet ended)
    # decodes nothing, so rows arriving then lose nothing by waiting for each
    # other; offered at once, the first would join that chain a step ahead
    # of the others.
    idle = not any(r.phase == "joined" for r in rows)
    if not idle:
        state.gathered = False
    hold = (
        idle
        and not state.gathered
        and any(r.phase == "ready" for r in rows)
        and (any(r.phase == "lookup" for r in rows) or bool(state.arriving))
    )
    if hold and state.gather_until is None:
        state.gather_until = now + state.gather_s
        out.append(ArmGather(state.gather_until))
    elif not hold and state.gather_until is not None:
        state.gather_until = None
        state.gathered = idle and any(r.phase == "ready" for r in rows)
        out.append(ArmGather(None))


def _must_stop(state: SchedulerState) -> bool:
    """Whether the turn in flight must end after its step in flight: something needs a decision here.

    NOTE: a row ready to join joins only at a grant, a joined row is removed
    only by a job's first step (its ``cancels``), and the gateway or the
    scheduler's stop wants the engine back; anything else (tokens, exits,
    snapshots, rows failing alone) a chain's steps hand back as they go.
    """
    if state.yield_asked or state.stopping:
        return True
    if state.offerable:
        # NOTE: every other row was just offered; one resuming from a checkpoint joins only
        # with a job's first step.
        return any(r.phase == "ready" and r.resume for r in state.rows.values())
    return any(
        r.phase == "ready"
        or (r.phase == "joined" and r.cancelled and not r.removing and not r.offered)
        for r in state.rows.values()
    )


def _lent(lookup: TakeResult | None) -> int:
    """Prompt tokens a lookup lends: a RAM entry (``handle``) or a cold-tier hit (``staging_id``)."""
    if lookup is None or (lookup.handle is None and lookup.staging_id is None):
        return 0
    return lookup.cached_tokens


def _defer(state: SchedulerState, row: Row, out: list[Effect]) -> bool:
    """Hold ``row`` back (True) when a row in the batch shares a much longer prefix than its lookup found.

    NOTE: rows that arrive together with one long shared prefix (a system
    prompt) would each prefill it. Instead the later ones wait until the
    first has prefilled (its prompt-boundary snapshot is then in the prompt
    cache), look up again and forward only their own suffix. A row whose
    lookup predates such a snapshot looks up again at once (once).
    """
    if not state.lookups or not row.request.snapshots_prompt or row.resume:
        return False
    lookup = row.lookup
    cached = _lent(lookup)
    prompt = row.request.prompt_tokens
    best, best_n = None, cached + state.share_min - 1
    for rid, other in state.rows.items():
        req = other.request
        if other.phase != "joined" or not req.snapshots_prompt or req.namespace != row.request.namespace:
            continue
        # NOTE: the prompt cache's galloping compare: rows of one agent trace
        # share a ~4,400-token system prompt, which a Python loop took ~100 us
        # a row to walk (24 us galloping), on the event loop, per lookup.
        n = common_prefix_len(req.prompt_tokens, prompt)
        if n > best_n:
            best, best_n = rid, n
    if best is None or (state.rows[best].prefilled and row.relooked):
        return False
    if lookup is not None and lookup.lease_id is not None:
        out.append(ReleaseLease(lookup.lease_id))
    row.lookup = None
    if state.rows[best].prefilled:
        row.relooked = True
        row.phase = "lookup"
        row.take_pending = True
        out.append(StartLookup(row.request, row.correlation_id))
        return True
    row.phase = "deferred"
    row.wait_for = best
    state.stats.deferred += 1
    return True


def _wake_deferred(state: SchedulerState, out: list[Effect]) -> None:
    """Deferred rows whose awaited row has prefilled (or left) look up again."""
    for row in state.rows.values():
        if row.phase != "deferred":
            continue
        awaited = state.rows.get(row.wait_for or "")
        if awaited is None or awaited.prefilled:
            row.phase = "lookup"
            row.wait_for = None
            row.relooked = True
            row.take_pending = True
            out.append(StartLookup(row.request, row.correlation_id))


def _check_turn(state: SchedulerState, turn: int) -> None:
    if state.in_flight != turn:
        raise ValueError(f"report of batch turn {turn} but turn {state.in_flight} is in flight")


def _job_ended(state: SchedulerState, turn: int, now: float, out: list[Effect]) -> None:
    """The turn's engine job ended: go on with a new job within the grant, or report the turn.

    NOTE: a chain ends when it runs ``AHEAD`` steps ahead of the loop, when
    a row it cannot take waits (one resuming from a checkpoint) or when it
    closed with rows offered; when the grant allows more and neither the
    gateway nor a stop wants the turn back, the turn goes on with a fresh
    job that joins and removes the waiting rows (like the serial lane's
    burst), without a trip through the gateway.
    """
    _check_turn(state, turn)
    more = state.chain_budget - state.chain_steps
    if more > 0 and not state.yield_asked and not state.stopping:
        joins, cancels = _collect(state, now, out, offer=False)
        if joins or any(r.phase == "joined" for r in state.rows.values()):
            _submit(state, turn, joins, cancels, more, out)
            return
    state.in_flight = None
    state.offerable = False
    out.append(ReportTurn(_report(state, turn, state.last_step, steps=state.chain_steps)))


MIN_OBSERVED_PREFILL = 32
"""Steps that forwarded fewer prompt tokens are not reported (their time is mostly overhead)."""


def _observe(state: SchedulerState, step: StepOut, seconds: float, out: list[Effect]) -> None:
    """A step that only prefilled measures prefill speed, for restore-or-recompute.

    NOTE: the serial lane reports each request's prefill; here rows share
    steps, so a step is reported only when no row decoded in it (its
    forward would count as prefill time). The rows' joins (an SSD hit's
    landing, a RAM prefix's copy: ``join_s``) are left out of its time, so
    a step that prefilled restored rows' suffixes still reports: after a
    restart every row may be served from disk.
    """
    if not state.observe_prefill or step.decode_rows:
        return
    seconds -= step.join_s
    if step.prefill_tokens < MIN_OBSERVED_PREFILL or seconds <= 0:
        return
    out.append(ObservePrefill(step.prefill_tokens, seconds))


def _step_finished(state: SchedulerState, ev: StepFinished, out: list[Effect]) -> None:
    _check_turn(state, ev.turn)
    step = ev.out
    stats = state.stats
    began = state.step_from
    _observe(state, step, ev.now - began, out)
    state.step_from = ev.now
    state.chain_steps += 1
    state.last_step = step
    stats.steps += 1
    stats.tokens += len(step.tokens)
    stats.prefill_tokens += step.prefill_tokens
    stats.max_rows_decoded = max(stats.max_rows_decoded, step.decode_rows)
    for rid in step.prefilled:
        if (entered := state.rows.get(rid)) is not None:
            entered.prefilled = True
    for rid, cached in step.joined:
        row = state.rows.get(rid)
        if row is None:
            continue
        row.cached_tokens = cached
        if row.offered:
            # NOTE: an offered row joined the step that took it, which began
            # when the one before it ended (not at the offer): the request
            # timeline's ``join`` phase is the wait for that step.
            row.joined_at = max(row.joined_at, began)
        row.offered = False
        stats.joined += 1
        stats.cached_tokens += cached
        # NOTE: the handle was materialized on the engine thread: the lease ends.
        if row.lookup is not None and row.lookup.lease_id is not None:
            out.append(ReleaseLease(row.lookup.lease_id))
        row.lookup = None
    stats.restored += len(step.restored)
    stats.restored_tokens += sum(c for rid, c in step.joined if rid in step.restored)
    stats.restore_failed += len(step.restore_failed)
    for failure in step.failed:
        _fail_row(state, failure, out)
    for tok in step.tokens:
        row = state.rows.get(tok.request_id)
        if row is None:
            continue
        if row.tokens == 0:
            row.first_token_at = ev.now
        row.tokens += 1
        event = TokenEvent(
            request_id=tok.request_id,
            index=tok.index,
            token_id=tok.token_id,
            text=tok.text,
            logprob=tok.logprob,
            top_logprobs=tok.top_logprobs,
        )
        _send_token(state, row, event, out)
    for rid, entry in step.snapshots:
        row = state.rows.get(rid)
        _put(state, row, entry, "snapshot", out)
    _checkpoints(state, step, out)
    for ex in step.exits:
        row = state.rows.pop(ex.request_id, None)
        if row is None:
            continue
        state.ended.append(ex.request_id)
        if row.lookup is not None and row.lookup.lease_id is not None:
            out.append(ReleaseLease(row.lookup.lease_id))
        if ex.reason == "stop":
            stats.finished_stop += 1
        elif ex.reason == "length":
            stats.finished_length += 1
        elif not (row.slow or row.timed_out):
            stats.cancelled += 1
        _put(state, row, ex.entry, "completion", out)
        if ex.reason in ("stop", "length") and row.checkpoint_key is not None \
                and row.checkpoint_files:
            # NOTE: completion voids the key's checkpoints; a cancel keeps them.
            out.append(VoidCheckpoints(row.checkpoint_key))
        request = row.request
        if row.timed_out:
            if ex.reason == "cancelled":
                stats.failed += 1
            continue  # NOTE: its stream already ended with stream_write_timeout.
        if row.slow and ex.reason == "cancelled":
            # NOTE: removed because its reader fell behind, not by its requester.
            stats.failed += 1
            stats.slow_readers += 1
            held = state.outboxes.get(ex.request_id)
            error = ErrorEvent(
                request_id=ex.request_id,
                error_code="slow_reader",
                detail=f"the client fell {0 if held is None else len(held.events)} tokens "
                "behind the generation; the request was stopped so the other rows go on",
            )
            _send_final(state, ex.request_id, request.stream_to, error, row.correlation_id, out)
            continue
        done = DoneEvent(
            request_id=ex.request_id,
            finish_reason=ex.reason,
            usage=Usage(
                prompt_tokens=len(request.prompt_tokens),
                completion_tokens=ex.completion_tokens,
                cached_tokens=row.cached_tokens,
            ),
            timings=_timings(row, ev.now),
        )
        _send_final(state, ex.request_id, request.stream_to, done, row.correlation_id, out)
    if ev.last:
        _job_ended(state, ev.turn, ev.now, out)


def _checkpoints(state: SchedulerState, step: StepOut, out: list[Effect]) -> None:
    """Resumes are counted; every snapshot goes to the spill queue (or is freed: its row is gone)."""
    for rid, replayed in step.resumed:
        row = state.rows.get(rid)
        if replayed >= 0:
            state.stats.checkpoints_resumed += 1
        else:
            state.stats.checkpoint_resume_failed += 1
        prompt = 0 if row is None else len(row.request.prompt_tokens)
        out.append(Resumed(rid, replayed, prompt))
    for rid, cap in step.checkpoints:
        row = state.rows.get(rid)
        key = None if row is None else row.checkpoint_key
        if row is not None and key is not None:
            row.checkpoint_files = True
            state.stats.checkpoints_sent += 1
        namespace = "" if row is None else row.request.namespace
        out.append(SendCheckpoint(key, namespace, cap))


def _step_failed(state: SchedulerState, ev: StepFailed, out: list[Effect]) -> None:
    _check_turn(state, ev.turn)
    state.in_flight = None
    state.offerable = False
    state.stats.failed_steps += 1
    # NOTE: a failed forward leaves the engine's batch in an unknown state:
    # every joined row fails (the shell drops the engine batch); rows not yet
    # joined are untouched and join a fresh batch.
    for rid in [rid for rid, r in state.rows.items() if r.phase == "joined"]:
        row = state.rows.pop(rid)
        state.ended.append(rid)
        state.stats.failed += 1
        if row.lookup is not None and row.lookup.lease_id is not None:
            out.append(ReleaseLease(row.lookup.lease_id))
        if row.timed_out:
            continue  # NOTE: its stream already ended (stream-write deadline).
        error = ErrorEvent(request_id=rid, error_code=ev.error_code, detail=ev.detail)
        _send_final(state, rid, row.request.stream_to, error, row.correlation_id, out)
    report = _report(state, ev.turn, steps=state.chain_steps + 1)
    out.append(ReportTurn(report.model_copy(update={"ok": False, "error_code": ev.error_code})))


def _fail_row(state: SchedulerState, failure: RowFailure, out: list[Effect]) -> None:
    """A row the engine removed alone with an error: its stream ends with it, the batch goes on.

    NOTE: a row the guard refused before its prefill (``MemoryShortAtStart``:
    nothing of it ran) is not a failure: its stream ends with that code and
    the engine API takes the request back to admission, where cached
    entries can be moved out of memory (a relief), or, with nothing to move,
    the request waits for a running stream to end. Held here instead until
    a row left, it waited while the RAM tier kept the bytes it needed: the
    budgeted soak's answer times (p99) fell by a third or more with the
    take-back (docs/benchmarks.md, 2026-12-05 evening).
    """
    row = state.rows.pop(failure.request_id, None)
    if row is None:
        return
    state.ended.append(failure.request_id)
    if failure.error_code == MemoryShortAtStart.__name__:
        state.stats.memory_taken_back += 1
    else:
        state.stats.failed += 1
        state.stats.failed_alone += 1
    if failure.error_code == MemoryPressure.__name__:
        state.stats.memory_refused += 1
    if row.lookup is not None and row.lookup.lease_id is not None:
        # NOTE: refused before it joined: its lease (and an SSD hit's host bytes) goes back.
        out.append(ReleaseLease(row.lookup.lease_id))
    row.lookup = None
    if row.timed_out:
        return  # NOTE: its stream already ended (stream-write deadline).
    error = ErrorEvent(
        request_id=failure.request_id, error_code=failure.error_code, detail=failure.detail
    )
    _send_final(state, failure.request_id, row.request.stream_to, error, row.correlation_id, out)


def _stopping(state: SchedulerState, out: list[Effect]) -> None:
    """Give back every lease still held (a lookup's RAM entry or an SSD hit's host bytes);
    end every held stream (its reader would otherwise wait for events that never come)."""
    for row in state.rows.values():
        if row.lookup is not None and row.lookup.lease_id is not None:
            out.append(ReleaseLease(row.lookup.lease_id))
        row.lookup = None
    state.draining = True
    state.stopping = True
    for rid, box in state.outboxes.items():
        error = ErrorEvent(
            request_id=rid,
            error_code="shutting_down",
            detail=f"the server stopped before the client read {len(box.events)} more tokens",
        )
        out.append(EndStream(box.stream_to, error, box.correlation_id))
    state.outboxes.clear()
    if state.retry_armed:
        state.retry_armed = False
        out.append(ArmRetry(None))


# --- streams whose reader is slow -------------------------------------------------------


def _send_token(state: SchedulerState, row: Row, event: TokenEvent, out: list[Effect]) -> None:
    """Emit a token, or hold it behind the row's earlier held events."""
    if row.timed_out:
        return  # NOTE: its stream already ended (stream-write deadline).
    box = state.outboxes.get(event.request_id)
    if box is None:
        out.append(EmitToken(row.request.stream_to, event, row.correlation_id))
        return
    _hold_token(state, event.request_id, box, event)


def _hold_token(state: SchedulerState, rid: str, box: Outbox, event: TokenEvent) -> None:
    box.events.append(event)
    row = state.rows.get(rid)
    if len(box.events) >= state.backlog_max and row is not None and row.phase == "joined":
        # NOTE: holding more would let one reader pin unbounded memory; the
        # next step removes the row (before it decodes) and keeps its cache.
        row.slow = True
        row.cancelled = True


def _send_final(
    state: SchedulerState,
    rid: str,
    stream_to: str,
    final: DoneEvent | ErrorEvent,
    correlation_id: str,
    out: list[Effect],
) -> None:
    """End a stream, or hold its final event behind its held tokens."""
    box = state.outboxes.get(rid)
    if box is None:
        out.append(EndStream(stream_to, final, correlation_id))
    else:
        box.final = final


def _stream_full(state: SchedulerState, ev: StreamFull, out: list[Effect]) -> None:
    """A delivery was refused: from now on the row's events wait in its outbox, in order."""
    box = state.outboxes.get(ev.request_id)
    if box is None:
        box = state.outboxes[ev.request_id] = Outbox(ev.stream_to, ev.correlation_id, since=ev.now)
        state.stats.streams_full += 1
    if isinstance(ev.event, TokenEvent):
        _hold_token(state, ev.request_id, box, ev.event)
    else:
        box.final = ev.event


def _delivered(state: SchedulerState, ev: Delivered, out: list[Effect]) -> None:
    box = state.outboxes.get(ev.request_id)
    if box is None:
        return
    box.attempting = False
    for _ in range(ev.sent):
        box.events.popleft()
    if ev.sent:
        box.since = ev.now  # NOTE: the reader took something: the deadline starts again.
    if ev.gone:
        # NOTE: the reader left: what it did not read is dropped, and a row
        # still in the batch is removed like a cancel.
        del state.outboxes[ev.request_id]
        _cancel(state, ev.request_id, ev.now, out)
    elif ev.ended or (not box.events and box.final is None):
        # NOTE: nothing held any more: the row's next events go out directly.
        del state.outboxes[ev.request_id]


def _may_try(event: Event, rid: str) -> bool:
    """Whether ``event`` is a reason to try ``rid``'s held stream now.

    NOTE: ``StreamFull`` and ``Delivered`` answer this core's own effects,
    performed one after another with no reader running in between, so they
    say nothing about room in any stream. Only a delivery that made progress
    goes on (the rest of its outbox, past ``deliver_chunk``); trying the other
    held streams on them would answer one refused ``Deliver`` with another,
    forever, while two streams are full. The event that caused them already
    tried every held stream; the next one, or the retry alarm, tries again.
    """
    if isinstance(event, StreamFull):
        return False
    if isinstance(event, Delivered):
        return event.request_id == rid and event.sent > 0 and not event.gone
    return True


def _deliver_held(state: SchedulerState, event: Event, out: list[Effect]) -> None:
    """End the held streams past the write deadline; try every other held stream again
    (its reader may have made room) and keep the retry alarm set."""
    _expire_held(state, event.now, out)
    for rid, box in state.outboxes.items():
        if box.attempting or (not box.events and box.final is None):
            continue
        if not _may_try(event, rid):
            continue
        box.attempting = True
        chunk = tuple(islice(box.events, state.deliver_chunk))
        final = box.final if len(chunk) == len(box.events) else None
        out.append(Deliver(rid, box.stream_to, chunk, final, box.correlation_id))
    if state.outboxes:
        # NOTE: re-set after every event, so it fires only once events stop
        # coming (while steps run, every step's end tries the held streams).
        state.retry_armed = True
        out.append(ArmRetry(event.now + state.retry_s))
    elif state.retry_armed:
        state.retry_armed = False
        out.append(ArmRetry(None))


def _expire_held(state: SchedulerState, now: float, out: list[Effect]) -> None:
    """End every held stream that took nothing for ``write_timeout_s``: the reader is gone.

    NOTE: the retry alarm runs while any stream is held, so this runs within
    ``retry_s`` of the deadline even when nothing else happens.
    """
    expired = [
        rid
        for rid, box in state.outboxes.items()
        if not box.attempting and now - box.since >= state.write_timeout_s
    ]
    for rid in expired:
        box = state.outboxes.pop(rid)
        state.stats.stream_timeouts += 1
        final = ErrorEvent(
            request_id=rid,
            error_code=STREAM_WRITE_TIMEOUT,
            detail=f"the stream took nothing for {state.write_timeout_s:g} s "
            f"({len(box.events)} events unread); the request was stopped so the others go on",
        )
        out.append(StreamTimedOut(rid, box.stream_to, final, box.correlation_id))
        row = state.rows.get(rid)
        if row is None:
            continue  # NOTE: the row already left the batch; only its events were held.
        row.timed_out = True
        if row.phase == "joined":
            # NOTE: the next step removes it (before it decodes) and keeps its cache.
            row.cancelled = True
        else:
            _cancel(state, rid, now, out, end_stream=False)


def _put(
    state: SchedulerState,
    row: Row | None,
    entry: Registered | None,
    role: EntryRole,
    out: list[Effect],
) -> None:
    if entry is None:
        return
    # NOTE: a registered handle must reach the prompt cache whatever became
    # of its row (the cache owns it from the Put on).
    request = None if row is None else row.request
    put = Put(
        tokens=entry.tokens,
        namespace="" if request is None else request.namespace,
        handle=entry.handle,
        meta=entry.meta,
        role=role,
    )
    state.stats.entries_put += 1
    out.append(PutEntry(put, "" if row is None else row.correlation_id))


def _timings(row: Row, now: float) -> Timings:
    first = row.first_token_at or now
    return Timings(
        queued_s=max(0.0, row.joined_at - row.admitted_at),
        ttft_s=max(0.0, first - row.admitted_at),
        prefill_s=max(0.0, first - row.joined_at),
        decode_s=max(0.0, now - first),
        admitted_at=row.admitted_at,
        lookup_start_s=_since(row.lookup_started_at, row.admitted_at),
        lookup_done_s=_since(row.lookup_done_at, row.admitted_at),
    )


def _since(mark: float | None, admitted_at: float) -> float | None:
    return None if mark is None else max(0.0, mark - admitted_at)


def _report(
    state: SchedulerState, turn: int, step: StepOut | None = None, *, steps: int = 1
) -> BatchTurnReport:
    # NOTE: busy/ready are filled in by handle() once the event is applied.
    return BatchTurnReport(
        turn=turn,
        busy=state.busy,
        ready=state.ready,
        steps=steps,
        decode_rows=0 if step is None else step.decode_rows,
        tokens=0 if step is None else len(step.tokens),
        prefill_tokens=0 if step is None else step.prefill_tokens,
        joined=0 if step is None else len(step.joined),
    )
