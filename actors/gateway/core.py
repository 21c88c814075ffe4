"""Sans-IO core of the gateway: admission queue, serial lane, engine-turn token.

``handle(state, event) -> (state, effects)`` is the whole decision logic. It
never awaits, never reads a clock and never touches MLX: the shell
(``actor.py``) feeds it events (each carrying ``now`` from the injected
clock) and performs the effects it returns, in order, matching them
exhaustively. That makes the turn protocol testable with plain function
calls and replayable from a trace (docs/architecture.md, "Sans-IO
convention").

Invariants (checked by the tests):

- At most one engine turn is in flight (``turn`` is ``None`` or one owner).
- A request takes its first turn only once its prompt-cache lookup is done
  (``StartLookup`` ... ``LookupDone``): the lookup runs while the request
  waits, never inside a granted turn. It starts when the request becomes
  the next to run (it takes the lane, or it heads the queue). A request
  admitted with a generation-checkpoint key also has its checkpoint loaded
  beside that lookup (``LoadCheckpoint`` ... ``CheckpointLoaded``); its
  first turn waits for both, so no turn waits for a file lookup.
- A background turn is granted when no request can run: the lane is
  free and nobody queues, or the lane holder has had no turn yet and still
  waits for its lookup. A request that becomes ready during a background
  step waits for that one step only (the lane holder goes first when the
  turn ends).
- Under load (a request or batch step could run) a background step still
  gets a bounded share of engine time, so write-behind and the SSD writer
  make progress while the server is busy: every request or batch turn earns
  ``background_share / (1 - background_share)`` of its time as *credit*
  (capped at ``background_credit_cap_s``); while the credit is positive
  the oldest background waiter goes first (a burst or step chain in flight
  is cut after its current step), one step at a time: the lanes take a turn
  before the next (a turn of one step while background is still due), so a
  row waits for one background step, never for the whole credit. Its time
  is taken off the credit.
  Hence, over any stretch of load, background time <= share/(1-share) x
  request and batch time + the cap + one background step; a waiting step
  is granted within one step while the credit is positive, else within one
  turn after the foreground time that repays the last step's overdraft.
  ``background_share == 0`` keeps the design's rule (idle turns only).
- With ``chain_background``, a due background step does not cut a batch
  step chain: it is *lent* to the chain (``LendBackground``), which runs it
  on the engine thread between two of its steps and reports it
  (``LentBackgroundDone``); its time is taken off the credit as a granted
  step's is, and off the time the batch turn earns credit for. At most one
  step is lent at a time; a chain that ended before running it hands it
  back, and it waits at the head of the background queue again.
- A background waiter whose deadline passed (or whose asker is gone) is
  dropped, never granted.
- An idle-only waiter (``RunWhenIdle.idle_only``: work every request turn
  and batch step does as it ends) is never granted under load; the first
  request or batch turn *granted after its ask* answers it as done when it
  ends (``ConfirmBackground``), so under load its asker learns the work
  is done when the turn after the one in flight ends, not at the first idle
  moment.
- The lane holder takes its turns back to back; the next owner is chosen
  lane first, then queue, then background.
- A cancelled queued request leaves the queue at once; a cancelled lane
  holder is finished when its in-flight turn ends (within one step).
- A lane holder whose turn ended ``blocked`` (its stream was full: the
  runner holds its tokens) takes no turn until ``LaneUnblocked``: the other
  lane and background work run meanwhile; a reader that stops reading never
  holds the engine. While another request waits for the lane, the blocked
  holder *parks* (gives the lane up; its generation stays open on the
  engine) so a reader that stops reading never holds the serial lane
  either; once unblocked it takes the lane back before the queue. At most
  ``max_queue`` requests are parked at once (each keeps its caches).
- A request turn may be a *burst* of up to ``max_burst`` steps. Rule "lane
  first" makes that equivalent to granting the steps one by one: nobody
  else could get the turn before the lane holder ends anyway. Only a cancel
  of the holder, or batch rows getting work, must cut a burst short, so the
  core then emits ``PreemptTurn`` (the runner stops after the step in
  flight).
- A batch turn may be a *step chain* of up to ``max_burst`` batch steps,
  granted only while the serial lane has no work; once the lane holder can
  run, the core emits ``PreemptBatchTurn`` (the chain ends after the step
  in flight). Both lanes with work get one step per turn, alternating.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal, assert_never

__all__ = [
    "DEFAULT_BACKGROUND_SHARE",
    "AdmitRequest",
    "BackgroundTurnDone",
    "BatchStatus",
    "BatchTurnDone",
    "BeginDrain",
    "CancelRequest",
    "CheckpointLoaded",
    "ConfirmBackground",
    "CoreEvent",
    "Drained",
    "Effect",
    "ExpireBackground",
    "FinishRequest",
    "GatewayState",
    "LaneUnblocked",
    "LendBackground",
    "LentBackgroundDone",
    "LoadCheckpoint",
    "LookupDone",
    "PreemptBatchTurn",
    "PreemptTurn",
    "RefuseBackground",
    "RejectRequest",
    "RequestAdmitted",
    "RequestTurnDone",
    "RunBackgroundTurn",
    "RunBatchTurn",
    "RunRequestTurn",
    "StartLookup",
    "StopTurns",
    "TokenStats",
    "WantBackgroundTurn",
    "WithdrawBackground",
    "handle",
]

DEFAULT_BACKGROUND_SHARE = 0.05
"""The share of engine time the server gives background work under load (``GatewayState``).

NOTE: the core's own default is 0 (the design's rule: idle turns only), so
recorded traces replay unchanged; the engine's wiring passes this value.
"""

Phase = Literal["prefill", "decode"]
RequestOutcome = Literal["continue", "finished", "failed", "cancelled", "blocked"]


# --- events (shell -> core) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """A requester asks for the lane (``checkpoint``: it has a generation-checkpoint key to load)."""

    request_id: str
    now: float
    checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """The requester left (stream closed, client disconnected)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class LookupDone:
    """The prompt-cache lookup of ``request_id`` answered (hit, miss or failure: all are ready)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class CheckpointLoaded:
    """The checkpoint load of ``request_id`` ended (found, none or failed: all are ready)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class WantBackgroundTurn:
    """A background actor asks for one engine turn (``RunWhenIdle``); ``deadline``: when it stops waiting."""

    step_id: str
    now: float
    deadline: float | None = None
    idle_only: bool = False
    """Granted only while no request or batch work can run (``RunWhenIdle.idle_only``)."""


@dataclass(frozen=True, slots=True)
class WithdrawBackground:
    """The asker of ``step_id`` is gone: drop its wait, or its grant if not yet sent to the runner."""

    step_id: str
    now: float


@dataclass(frozen=True, slots=True)
class RequestTurnDone:
    """The lane holder's engine turn ended; ``outcome`` says whether more turns are needed.

    ``steps`` is how many steps (all of ``phase``) the turn ran: 1, or more for a burst.
    """

    request_id: str
    phase: Phase
    outcome: RequestOutcome
    now: float
    steps: int = 1


@dataclass(frozen=True, slots=True)
class LaneUnblocked:
    """The blocked lane holder's held tokens went out (``continue``), its last among them
    (``finished``), or its stream is gone (``cancelled``: the runner already cleaned up)."""

    request_id: str
    outcome: Literal["continue", "finished", "cancelled"]
    now: float


@dataclass(frozen=True, slots=True)
class BackgroundTurnDone:
    """A background engine turn ended (successfully or not; the shell replies to the asker)."""

    step_id: str
    now: float


@dataclass(frozen=True, slots=True)
class LentBackgroundDone:
    """The batch chain a step was lent to ran it (``ran``; ``held_s`` on the engine thread) or handed it back."""

    step_id: str
    now: float
    ran: bool
    held_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """The batch lane changed: rows exist (``busy``), a batch step has work (``ready``)."""

    busy: bool
    ready: bool
    now: float


@dataclass(frozen=True, slots=True)
class BatchTurnDone:
    """The batch turn in flight ended after ``steps`` steps; ``busy``/``ready`` as after it."""

    busy: bool
    ready: bool
    now: float
    steps: int = 1


@dataclass(frozen=True, slots=True)
class BeginDrain:
    """Stop admitting requests; queued and running ones finish; background still runs."""

    now: float


@dataclass(frozen=True, slots=True)
class StopTurns:
    """Grant no more background turns; refuse waiting and future ``RunWhenIdle`` asks."""

    now: float


CoreEvent = (
    AdmitRequest
    | CancelRequest
    | LookupDone
    | CheckpointLoaded
    | WantBackgroundTurn
    | WithdrawBackground
    | RequestTurnDone
    | LaneUnblocked
    | BackgroundTurnDone
    | LentBackgroundDone
    | BatchStatus
    | BatchTurnDone
    | BeginDrain
    | StopTurns
)


# --- effects (core -> shell) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestAdmitted:
    """Tell the requester it is admitted; ``position`` 0 holds the lane, n waits behind n."""

    request_id: str
    position: int


@dataclass(frozen=True, slots=True)
class RejectRequest:
    """Tell the requester it was refused (``queue_full`` or ``shutting_down``)."""

    request_id: str
    reason: Literal["queue_full", "shutting_down", "duplicate_id"]
    queued: int
    max_queue: int


@dataclass(frozen=True, slots=True)
class StartLookup:
    """Ask the prompt cache for ``request_id``'s longest usable prefix; answer with ``LookupDone``."""

    request_id: str


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    """Load ``request_id``'s generation checkpoint on a worker thread; answer with ``CheckpointLoaded``."""

    request_id: str


@dataclass(frozen=True, slots=True)
class RunRequestTurn:
    """Run the lane holder's next step (one prefill chunk or one decode step) on the engine.

    ``max_steps`` > 1 grants a burst: up to that many decode steps back to
    back, ended early by ``PreemptTurn`` (or the request's end).
    """

    request_id: str
    max_steps: int = 1


@dataclass(frozen=True, slots=True)
class PreemptTurn:
    """End the lane holder's burst after the step in flight (its requester cancelled, or batch
    rows have work)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PreemptBatchTurn:
    """End batch turn ``turn``'s step chain after the step in flight (the serial lane has work)."""

    turn: int


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """End a request that will get no more turns (cancelled); the shell closes its stream."""

    request_id: str
    reason: Literal["cancelled"]
    had_turns: bool


@dataclass(frozen=True, slots=True)
class RunBackgroundTurn:
    """Run exactly one registered background step on the engine, then report it."""

    step_id: str


@dataclass(frozen=True, slots=True)
class LendBackground:
    """Hand background step ``step_id`` to batch turn ``turn``'s chain: run it between two steps, then report it."""

    turn: int
    step_id: str


@dataclass(frozen=True, slots=True)
class RunBatchTurn:
    """Run up to ``max_steps`` batch steps as one turn (the batch scheduler performs them,
    then ``BatchTurnDone``)."""

    turn: int
    max_steps: int = 1


@dataclass(frozen=True, slots=True)
class RefuseBackground:
    """Answer a ``RunWhenIdle`` ask without running it (turns are stopped)."""

    step_id: str


@dataclass(frozen=True, slots=True)
class ConfirmBackground:
    """Answer an idle-only ``RunWhenIdle`` ask as done without running it: a request or
    batch turn granted after the ask did its work as it ended."""

    step_id: str


@dataclass(frozen=True, slots=True)
class ExpireBackground:
    """Forget a ``RunWhenIdle`` ask without running it: its deadline passed or its asker is gone."""

    step_id: str


@dataclass(frozen=True, slots=True)
class Drained:
    """Draining and nothing is running or queued any more."""


Effect = (
    RequestAdmitted
    | RejectRequest
    | StartLookup
    | LoadCheckpoint
    | RunRequestTurn
    | FinishRequest
    | PreemptTurn
    | PreemptBatchTurn
    | RunBackgroundTurn
    | LendBackground
    | RunBatchTurn
    | RefuseBackground
    | ConfirmBackground
    | ExpireBackground
    | Drained
)


# --- state ------------------------------------------------------------------


@dataclass(slots=True)
class TokenStats:
    """Counters of the engine-turn token (all times in clock seconds)."""

    request_turns: int = 0
    burst_turns: int = 0
    max_burst_steps: int = 0
    preempted: int = 0
    prefill_turns: int = 0
    decode_turns: int = 0
    background_turns: int = 0
    batch_turns: int = 0
    batch_held_s: float = 0.0
    batch_steps: int = 0
    batch_chains: int = 0
    batch_longest: int = 0
    batch_preempted: int = 0
    request_held_s: float = 0.0
    background_held_s: float = 0.0
    background_wait_s: float = 0.0
    max_background_wait_s: float = 0.0
    admitted: int = 0
    rejected_queue_full: int = 0
    rejected_shutting_down: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    background_refused: int = 0
    background_expired: int = 0
    background_confirmed: int = 0
    """Idle-only steps answered as done by a request or batch turn's end (never run)."""
    background_under_load: int = 0
    background_under_load_s: float = 0.0
    background_in_chain: int = 0
    """Steps run inside a batch chain (lent), counted in the two above as well."""
    lookups: int = 0
    checkpoint_loads: int = 0
    blocked_turns: int = 0
    """Request turns that ended on a full stream (its tokens held, the engine free for others)."""
    parked: int = 0
    """Blocked lane holders that gave the lane up to a waiting request."""


@dataclass(frozen=True, slots=True)
class Turn:
    """The one engine turn in flight: whose, since when, and how many steps it may run."""

    owner: Literal["request", "background", "batch"]
    ident: str
    started: float
    max_steps: int = 1
    preempted: bool = False
    """Told to end after its step in flight (``PreemptTurn``/``PreemptBatchTurn`` sent)."""
    under_load: bool = False
    """A background turn granted ahead of request or batch work (paid from the credit)."""
    grant: int = 0
    """The request or batch turn's number among all such grants (0 for a background turn)."""


@dataclass(frozen=True, slots=True)
class BackgroundWait:
    """A ``RunWhenIdle`` waiting for the engine: asked at ``asked``, given up at ``deadline``."""

    step_id: str
    asked: float
    deadline: float | None
    idle_only: bool = False
    grants_before: int = 0
    """Request and batch turns granted before the ask: a later one does an idle-only step's work."""


@dataclass(slots=True)
class GatewayState:
    """The gateway's decision state; :func:`handle` is the only thing that changes it.

    ``lookups``: a prompt cache is attached, so every request's first turn
    waits for its lookup. ``lookup`` holds, for the requests whose lookup
    started, ``pending`` or ``ready``. ``background_share`` and
    ``background_credit_cap_s``: background work's share of engine time
    under load (module docstring); ``background_credit_s`` is the credit.
    ``checkpoint`` holds, for the admitted requests with a generation-checkpoint
    key, whether its load is yet to start (``keyed``), ``pending`` or ``ready``.
    """

    max_queue: int
    max_burst: int = 1
    lookups: bool = False
    background_share: float = 0.0
    background_credit_cap_s: float = 0.25
    background_credit_s: float = 0.0
    lane: str | None = None
    lane_had_turns: bool = False
    lane_cancelled: bool = False
    lane_blocked: bool = False
    """The lane holder's last turn ended ``blocked``: no turn until ``LaneUnblocked``."""
    parked: dict[str, Literal["blocked", "ready"]] = field(default_factory=dict)
    """Requests that gave the lane up while blocked, oldest first: still ``blocked``, or
    ``ready`` (unblocked, next for the lane). Their generations stay open on the engine."""
    queue: deque[str] = field(default_factory=deque)
    lookup: dict[str, Literal["pending", "ready"]] = field(default_factory=dict)
    checkpoint: dict[str, Literal["keyed", "pending", "ready"]] = field(default_factory=dict)
    background: deque[BackgroundWait] = field(default_factory=deque)
    chain_background: bool = False
    """Lend due background steps to a running batch chain instead of cutting it (module docstring)."""
    lent: BackgroundWait | None = None
    """The background step lent to a batch chain, until its report."""
    lent_at: float = 0.0
    lend_refused: bool = False
    """A chain handed a lent step back: the next due step takes a turn of its own (cut), then lending resumes."""
    lent_in_turn_s: float = 0.0
    """Engine time lent steps took inside the batch turn in flight (earns no credit)."""
    turn: Turn | None = None
    draining: bool = False
    stopped: bool = False
    drained_reported: bool = False
    batch_busy: bool = False
    """The batch lane holds rows (active, pending or waiting): the engine counts as busy."""
    batch_ready: bool = False
    """A batch step has work now."""
    last_owner: str = ""
    """Who had the last request or batch turn (both lanes with work alternate)."""
    lanes_owed: bool = False
    """A background step ran under load and no request or batch turn has run since: the lanes go next."""
    grants: int = 0
    """Request and batch turns granted so far (``Turn.grant``, ``BackgroundWait.grants_before``)."""
    stats: TokenStats = field(default_factory=TokenStats)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_burst < 1:
            raise ValueError("max_burst must be >= 1")
        if not 0.0 <= self.background_share < 1.0:
            raise ValueError("background_share must be in [0, 1)")
        if not self.background_credit_cap_s >= 0.0:
            raise ValueError("background_credit_cap_s must be >= 0")

    # --- queries (pure reads) --------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a request holds or waits for the lane, or the batch lane holds rows."""
        return self.lane is not None or bool(self.queue) or bool(self.parked) or self.batch_busy

    @property
    def idle(self) -> bool:
        """True when no turn runs and nobody waits: nothing to drain."""
        return (
            self.turn is None and not self.busy and not self.background and self.lent is None
        )

    def ready(self, request_id: str) -> bool:
        """Whether ``request_id`` may take a turn (its lookup and checkpoint load, if any, have
        answered; it is not blocked on its full stream)."""
        if self.checkpoint.get(request_id, "ready") != "ready":
            return False
        if self.lane_blocked and request_id == self.lane:
            return False
        return not self.lookups or self.lookup.get(request_id) == "ready"

    def holder(self) -> str | None:
        """Who holds the engine turn now: ``request:<id>``, ``background:<id>`` or None."""
        if self.turn is None:
            return None
        return f"{self.turn.owner}:{self.turn.ident}"

    def snapshot(self, now: float) -> dict[str, object]:
        """JSON-ready statistics: holder, waiters, grants, time held."""
        s = self.stats
        held_now = 0.0 if self.turn is None else max(0.0, now - self.turn.started)
        return {
            "holder": self.holder(),
            "holder_held_s": held_now,
            "lane": self.lane,
            "queued": len(self.queue),
            "parked": len(self.parked),
            "max_queue": self.max_queue,
            "background_waiting": len(self.background),
            "background_lent": None if self.lent is None else self.lent.step_id,
            "lookups_pending": sum(1 for v in self.lookup.values() if v == "pending"),
            "draining": self.draining,
            "stopped": self.stopped,
            "grants": {
                "request": s.request_turns,
                "prefill": s.prefill_turns,
                "decode": s.decode_turns,
                "background": s.background_turns,
            },
            "bursts": {
                "granted": s.burst_turns,
                "max_steps": self.max_burst,
                "longest": s.max_burst_steps,
                "preempted": s.preempted,
            },
            "held_s": {"request": s.request_held_s, "background": s.background_held_s},
            "batch_lane": {"turns": s.batch_turns, "held_s": s.batch_held_s},
            "batch_chains": {
                "steps": s.batch_steps,
                "granted": s.batch_chains,
                "longest": s.batch_longest,
                "preempted": s.batch_preempted,
            },
            "batch_busy": self.batch_busy,
            "batch_ready": self.batch_ready,
            "background_wait_s": {
                "total": s.background_wait_s,
                "max": s.max_background_wait_s,
            },
            "requests": {
                "admitted": s.admitted,
                "completed": s.completed,
                "failed": s.failed,
                "cancelled": s.cancelled,
                "rejected_queue_full": s.rejected_queue_full,
                "rejected_shutting_down": s.rejected_shutting_down,
            },
            "lookups": s.lookups,
            "checkpoint_loads": s.checkpoint_loads,
            "blocked_turns": s.blocked_turns,
            "parked_turns": s.parked,
            "background_refused": s.background_refused,
            "background_expired": s.background_expired,
            "background_confirmed": s.background_confirmed,
            "background_under_load": {
                "turns": s.background_under_load,
                "held_s": s.background_under_load_s,
                "in_chain": s.background_in_chain,
                "share": self.background_share,
                "credit_s": self.background_credit_s,
            },
        }


# --- the core -----------------------------------------------------------------


def handle(state: GatewayState, event: CoreEvent) -> tuple[GatewayState, list[Effect]]:
    """Apply one event; return the next state and the effects to perform, in order.

    NOTE: the state is updated in place and returned (the shell keeps only
    what is returned). An event that does not fit the state (a report from
    a non-holder) raises ``ValueError`` before anything changes.
    """
    effects: list[Effect] = []
    match event:
        case AdmitRequest():
            _admit(state, event, effects)
        case CancelRequest():
            _cancel(state, event, effects)
        case LookupDone():
            if state.lookup.get(event.request_id) == "pending":
                state.lookup[event.request_id] = "ready"
            # NOTE: an unknown id is a request cancelled while its lookup ran.
        case CheckpointLoaded():
            if state.checkpoint.get(event.request_id) == "pending":
                state.checkpoint[event.request_id] = "ready"
        case WantBackgroundTurn():
            if state.stopped:
                state.stats.background_refused += 1
                effects.append(RefuseBackground(event.step_id))
            else:
                state.background.append(
                    BackgroundWait(event.step_id, event.now, event.deadline, event.idle_only,
                                   state.grants)
                )
        case WithdrawBackground():
            _withdraw(state, event, effects)
        case RequestTurnDone():
            _request_turn_done(state, event, effects)
        case LaneUnblocked():
            _lane_unblocked(state, event)
        case BackgroundTurnDone():
            _background_turn_done(state, event)
        case LentBackgroundDone():
            _lent_done(state, event)
        case BatchStatus():
            state.batch_busy, state.batch_ready = event.busy, event.ready
        case BatchTurnDone():
            _batch_turn_done(state, event, effects)
        case BeginDrain():
            state.draining = True
        case StopTurns():
            state.stopped = True
            state.draining = True
            while state.background:
                wait = state.background.popleft()
                state.stats.background_refused += 1
                effects.append(RefuseBackground(wait.step_id))
        case _:
            assert_never(event)
    _dispatch(state, event.now, effects)
    return state, effects


def _admit(state: GatewayState, ev: AdmitRequest, out: list[Effect]) -> None:
    rid = ev.request_id
    if rid == state.lane or rid in state.queue or rid in state.parked:
        out.append(RejectRequest(rid, "duplicate_id", len(state.queue), state.max_queue))
        return
    if state.draining:
        state.stats.rejected_shutting_down += 1
        out.append(RejectRequest(rid, "shutting_down", len(state.queue), state.max_queue))
        return
    if state.lane is None and not state.queue and _next_parked(state) is None:
        # NOTE: the lane is reserved even while a background turn runs; the
        # request then waits for that one step only (dispatch picks the
        # lane before background when the turn ends).
        _take_lane(state, rid)
        state.stats.admitted += 1
        if ev.checkpoint:
            state.checkpoint[rid] = "keyed"
        out.append(RequestAdmitted(rid, 0))
        return
    if len(state.queue) >= state.max_queue:
        state.stats.rejected_queue_full += 1
        out.append(RejectRequest(rid, "queue_full", len(state.queue), state.max_queue))
        return
    state.queue.append(rid)
    state.stats.admitted += 1
    if ev.checkpoint:
        state.checkpoint[rid] = "keyed"
    out.append(RequestAdmitted(rid, len(state.queue)))


def _cancel(state: GatewayState, ev: CancelRequest, out: list[Effect]) -> None:
    rid = ev.request_id
    if rid in state.queue:
        state.queue.remove(rid)
        _forget(state, rid)
        state.stats.cancelled += 1
        out.append(FinishRequest(rid, "cancelled", had_turns=False))
    elif rid in state.parked:
        # NOTE: its generation is open on the engine: the finish drops it.
        del state.parked[rid]
        _forget(state, rid)
        state.stats.cancelled += 1
        out.append(FinishRequest(rid, "cancelled", had_turns=True))
    elif rid == state.lane:
        turn = state.turn
        if turn is not None and turn.owner == "request":
            # NOTE: a step in flight on the engine thread cannot be
            # interrupted; the holder is finished when it reports back.
            # A burst must not start another step after this one.
            if not state.lane_cancelled and turn.max_steps > 1 and not turn.preempted:
                state.stats.preempted += 1
                state.turn = replace(turn, preempted=True)
                out.append(PreemptTurn(rid))
            state.lane_cancelled = True
        else:
            state.stats.cancelled += 1
            out.append(FinishRequest(rid, "cancelled", had_turns=state.lane_had_turns))
            _free_lane(state)
    # NOTE: unknown ids are ignored: a cancel may race the request's own end.


def _withdraw(state: GatewayState, ev: WithdrawBackground, out: list[Effect]) -> None:
    turn = state.turn
    if turn is not None and turn.owner == "background" and turn.ident == ev.step_id:
        # NOTE: only for a grant the shell has not sent to the runner yet:
        # the step never reached the engine, so the grant is taken back.
        state.turn = None
        state.stats.background_turns -= 1
        if turn.under_load:
            state.stats.background_under_load -= 1
        state.stats.background_expired += 1
        out.append(ExpireBackground(ev.step_id))
        return
    for wait in state.background:
        if wait.step_id == ev.step_id:
            state.background.remove(wait)
            state.stats.background_expired += 1
            out.append(ExpireBackground(ev.step_id))
            return


def _request_turn_done(state: GatewayState, ev: RequestTurnDone, out: list[Effect]) -> None:
    turn = state.turn
    if turn is None or turn.owner != "request" or turn.ident != ev.request_id:
        raise ValueError(
            f"request turn report for {ev.request_id!r} but holder is {state.holder()!r}"
        )
    if not 1 <= ev.steps <= turn.max_steps:
        raise ValueError(f"turn of {ev.request_id!r} ran {ev.steps} steps, granted {turn.max_steps}")
    stats = state.stats
    state.turn = None
    if ev.outcome not in ("failed", "cancelled"):
        # NOTE: a failed turn may have been lost before it ran (the shell's
        # ``_turn_lost``), a cancelled one may not have run: neither confirms.
        _confirm_idle_only(state, turn, out)
    stats.request_held_s += max(0.0, ev.now - turn.started)
    _earn_credit(state, ev.now - turn.started)
    stats.max_burst_steps = max(stats.max_burst_steps, ev.steps)
    if ev.phase == "prefill":
        stats.prefill_turns += ev.steps
    else:
        stats.decode_turns += ev.steps
    if ev.outcome == "finished":
        stats.completed += 1
        _free_lane(state)
    elif ev.outcome == "failed":
        stats.failed += 1
        _free_lane(state)
    elif ev.outcome == "cancelled":
        # NOTE: the runner found the stream gone and already cleaned up.
        stats.cancelled += 1
        _free_lane(state)
    elif state.lane_cancelled:
        stats.cancelled += 1
        out.append(FinishRequest(ev.request_id, "cancelled", had_turns=True))
        _free_lane(state)
    elif ev.outcome == "blocked":
        stats.blocked_turns += 1
        state.lane_blocked = True


def _lane_unblocked(state: GatewayState, ev: LaneUnblocked) -> None:
    rid = ev.request_id
    if state.parked.get(rid) == "blocked":
        if ev.outcome == "continue":
            state.parked[rid] = "ready"
            return
        del state.parked[rid]
        _forget(state, rid)
        if ev.outcome == "finished":
            state.stats.completed += 1
        else:
            state.stats.cancelled += 1
        return
    if rid != state.lane or not state.lane_blocked:
        return  # NOTE: the holder was cancelled meanwhile (the runner dropped it).
    state.lane_blocked = False
    if ev.outcome == "finished":
        state.stats.completed += 1
        _free_lane(state)
    elif ev.outcome == "cancelled":
        state.stats.cancelled += 1
        _free_lane(state)


def _background_turn_done(state: GatewayState, ev: BackgroundTurnDone) -> None:
    turn = state.turn
    if turn is None or turn.owner != "background" or turn.ident != ev.step_id:
        raise ValueError(
            f"background turn report for {ev.step_id!r} but holder is {state.holder()!r}"
        )
    state.turn = None
    # NOTE: a step handed back by a chain has now run in a turn of its own.
    state.lend_refused = False
    held = max(0.0, ev.now - turn.started)
    state.stats.background_held_s += held
    if turn.under_load:
        state.stats.background_under_load_s += held
        state.background_credit_s -= held


def _lent_done(state: GatewayState, ev: LentBackgroundDone) -> None:
    lent = state.lent
    if lent is None or lent.step_id != ev.step_id:
        return  # NOTE: a report the core does not wait for changes nothing.
    state.lent = None
    if not ev.ran:
        # NOTE: the chain ended first (or cannot run it): the step keeps its
        # place at the head and takes a turn of its own (the chain in flight,
        # if it still runs, is cut for it), so a chain that cannot run lent
        # steps never has one lent again and again.
        state.background.appendleft(lent)
        state.lend_refused = True
        return
    stats = state.stats
    _count_wait(state, lent, state.lent_at)
    held = max(0.0, ev.held_s)
    stats.background_turns += 1
    stats.background_under_load += 1
    stats.background_in_chain += 1
    stats.background_held_s += held
    stats.background_under_load_s += held
    state.background_credit_s -= held
    if state.turn is not None and state.turn.owner == "batch":
        state.lent_in_turn_s += held


def _batch_turn_done(state: GatewayState, ev: BatchTurnDone, out: list[Effect]) -> None:
    turn = state.turn
    if turn is None or turn.owner != "batch":
        raise ValueError(f"batch turn report but holder is {state.holder()!r}")
    state.turn = None
    if ev.steps > 0:
        _confirm_idle_only(state, turn, out)
    stats = state.stats
    held = max(0.0, ev.now - turn.started)
    # NOTE: the steps lent to this chain are background time, not batch time.
    lent, state.lent_in_turn_s = state.lent_in_turn_s, 0.0
    stats.batch_held_s += max(0.0, held - lent)
    _earn_credit(state, held - lent)
    stats.batch_steps += ev.steps
    stats.batch_longest = max(stats.batch_longest, ev.steps)
    state.batch_busy, state.batch_ready = ev.busy, ev.ready


def _confirm_idle_only(state: GatewayState, turn: Turn, out: list[Effect]) -> None:
    """Answer the idle-only steps asked before ``turn`` was granted: its end did their work.

    NOTE: an idle-only step's work is what every request turn and batch step
    does as it ends (the registry's drain of disposed handles). The asker
    disposed before it asked, so a turn granted after the ask drained those
    arrays; one granted before may have drained just before the disposal,
    so it confirms nothing. Without this, under sustained load such a step
    waits for the first idle moment and its asker reports work as pending
    that was done long ago.
    """
    done = [w for w in state.background if w.idle_only and w.grants_before < turn.grant]
    if not done:
        return
    state.background = deque(w for w in state.background if w not in done)
    state.stats.background_confirmed += len(done)
    out.extend(ConfirmBackground(w.step_id) for w in done)


def _earn_credit(state: GatewayState, held: float) -> None:
    """A request or batch turn held the engine ``held`` seconds: background earns its share."""
    share = state.background_share
    if share <= 0.0:
        return
    earned = max(0.0, held) * share / (1.0 - share)
    state.background_credit_s = min(state.background_credit_cap_s,
                                    state.background_credit_s + earned)


def _background_due(state: GatewayState) -> bool:
    """A background step that may run under load waits and has earned a turn ahead of request and batch work."""
    return (
        not state.stopped
        and state.background_share > 0.0
        and state.background_credit_s > 0.0
        and any(not wait.idle_only for wait in state.background)
    )


def _grant_background(state: GatewayState, now: float, out: list[Effect], *,
                      under_load: bool) -> None:
    """Grant the oldest waiting step; under load the oldest one that may run under load."""
    if under_load:
        # NOTE: an idle-only step keeps its place: a later request or batch
        # turn does its work as it ends, or the engine idles and grants it.
        wait = next(w for w in state.background if not w.idle_only)
        state.background.remove(wait)
    else:
        wait = state.background.popleft()
    _count_wait(state, wait, now)
    state.stats.background_turns += 1
    if under_load:
        state.stats.background_under_load += 1
    state.turn = Turn("background", wait.step_id, now, under_load=under_load)
    out.append(RunBackgroundTurn(wait.step_id))


def _count_wait(state: GatewayState, wait: BackgroundWait, granted: float) -> None:
    """How long ``wait`` waited for its grant (or its lending), into the statistics."""
    waited = max(0.0, granted - wait.asked)
    state.stats.background_wait_s += waited
    state.stats.max_background_wait_s = max(state.stats.max_background_wait_s, waited)


def _take_lane(state: GatewayState, rid: str) -> None:
    state.lane = rid
    state.lane_had_turns = False
    state.lane_cancelled = False


def _next_parked(state: GatewayState) -> str | None:
    """The oldest parked request that is unblocked: it takes the lane before the queue."""
    return next((rid for rid, status in state.parked.items() if status == "ready"), None)


def _park(state: GatewayState) -> None:
    """The blocked lane holder gives the lane up (its lookup and checkpoint states stay)."""
    assert state.lane is not None
    state.parked[state.lane] = "blocked"
    state.stats.parked += 1
    state.lane = None
    state.lane_had_turns = False
    state.lane_cancelled = False
    state.lane_blocked = False


def _forget(state: GatewayState, rid: str) -> None:
    """Drop a request's lookup and checkpoint states (it left the lane, the queue or the parked set)."""
    state.lookup.pop(rid, None)
    state.checkpoint.pop(rid, None)


def _free_lane(state: GatewayState) -> None:
    if state.lane is not None:
        _forget(state, state.lane)
    state.lane = None
    state.lane_had_turns = False
    state.lane_cancelled = False
    state.lane_blocked = False


def _start_lookups(state: GatewayState, out: list[Effect]) -> None:
    """Start the lookups of whoever runs next: the lane holder before its first turn, the queue head.

    NOTE: a keyed request's checkpoint load starts beside its prompt-cache
    lookup (both run while it waits), never inside its first turn.
    """
    for rid in (state.lane, state.queue[0] if state.queue else None):
        if rid is None:
            continue
        if state.lookups and rid not in state.lookup:
            state.lookup[rid] = "pending"
            state.stats.lookups += 1
            out.append(StartLookup(rid))
        if state.checkpoint.get(rid) == "keyed":
            state.checkpoint[rid] = "pending"
            state.stats.checkpoint_loads += 1
            out.append(LoadCheckpoint(rid))


def _expire_background(state: GatewayState, now: float, out: list[Effect]) -> None:
    if not any(w.deadline is not None and w.deadline <= now for w in state.background):
        return
    kept: deque[BackgroundWait] = deque()
    for wait in state.background:
        if wait.deadline is not None and wait.deadline <= now:
            state.stats.background_expired += 1
            out.append(ExpireBackground(wait.step_id))
        else:
            kept.append(wait)
    state.background = kept


def _lend(state: GatewayState, turn: Turn, now: float, out: list[Effect]) -> None:
    """Lend the oldest step that may run under load to the batch chain in flight."""
    wait = next(w for w in state.background if not w.idle_only)
    state.background.remove(wait)
    state.lent = wait
    state.lent_at = now
    out.append(LendBackground(int(turn.ident), wait.step_id))


def _preempt_for_other_lane(state: GatewayState, turn: Turn, now: float,
                            out: list[Effect]) -> None:
    """Cut a multi-step turn short once the other lane has work, so the lanes alternate.

    NOTE: a serial burst stops for batch rows ready to step, a batch step
    chain for a lane holder ready to run; each is told once, and ends after
    its step in flight.
    """
    if turn.max_steps <= 1 or turn.preempted:
        return
    if turn.owner == "batch" and state.chain_background and _background_due(state) \
            and not state.lend_refused:
        # NOTE: the chain runs the step between two of its steps: no trip
        # through the loop and the gateway, no restart of the chain.
        if state.lent is None:
            _lend(state, turn, now, out)
        return
    if turn.owner != "background" and _background_due(state):
        # NOTE: background has earned a turn and waits: the burst or chain
        # ends after its step in flight, so a waiting step is granted within
        # one step, not one whole burst (the share bounds how often).
        state.turn = replace(turn, preempted=True)
        if turn.owner == "batch":
            state.stats.batch_preempted += 1
            out.append(PreemptBatchTurn(int(turn.ident)))
        elif not state.lane_cancelled:
            state.stats.preempted += 1
            out.append(PreemptTurn(turn.ident))
        return
    if turn.owner == "batch" and state.lane is not None and state.ready(state.lane):
        state.turn = replace(turn, preempted=True)
        state.stats.batch_preempted += 1
        out.append(PreemptBatchTurn(int(turn.ident)))
    elif turn.owner == "request" and state.batch_ready and not state.lane_cancelled:
        state.turn = replace(turn, preempted=True)
        state.stats.preempted += 1
        out.append(PreemptTurn(turn.ident))


def _dispatch(state: GatewayState, now: float, out: list[Effect]) -> None:
    if state.draining and not state.drained_reported and not state.busy:
        # NOTE: drained means "no request runs or waits"; background turns
        # keep running during a drain (a shutdown flush needs them).
        state.drained_reported = True
        out.append(Drained())
    _expire_background(state, now, out)
    if state.lane_blocked and (state.queue or _next_parked(state) is not None) \
            and len(state.parked) < state.max_queue:
        # NOTE: its reader may not read for the whole stream-write deadline:
        # the waiting request takes the lane meanwhile. Parked requests keep
        # their generations open, so they are bounded as the queue is.
        _park(state)
    if state.turn is None and state.lane is None:
        resumed = _next_parked(state)
        if resumed is not None:
            del state.parked[resumed]
            _take_lane(state, resumed)
            state.lane_had_turns = True
        elif state.queue:
            _take_lane(state, state.queue.popleft())
    _start_lookups(state, out)
    if state.turn is not None:
        _preempt_for_other_lane(state, state.turn, now, out)
        return
    lane = state.lane
    lane_ok = lane is not None and state.ready(lane)
    batch_ok = state.batch_ready
    lend = state.chain_background and batch_ok and not lane_ok and not state.lend_refused
    if (lane_ok or batch_ok) and _background_due(state) and not lend and not state.lanes_owed:
        # NOTE: the engine is busy, but background work has earned a turn
        # (its share of the request and batch turns' time): one step, then
        # the lanes again. Its time is taken off the credit when it ends.
        # ``lanes_owed`` keeps it to one step: with credit left, a second
        # step back to back would hold a joining or decoding row behind the
        # whole credit (up to background_credit_cap_s) instead of one step.
        _grant_background(state, now, out, under_load=True)
        state.lanes_owed = True
        return
    state.lanes_owed = False
    if lane_ok and batch_ok:
        # NOTE: both lanes have work: they alternate turns, so neither starves.
        if state.last_owner == "batch":
            batch_ok = False
        else:
            lane_ok = False
    if lane is not None and lane_ok:
        # NOTE: while batch rows wait for steps, the lane holder gets one step
        # per turn (a burst would hold every batch row for max_burst tokens).
        steps = 1 if state.batch_ready else state.max_burst
        state.grants += 1
        state.turn = Turn("request", lane, now, steps, grant=state.grants)
        state.lane_had_turns = True
        state.last_owner = "request"
        state.stats.request_turns += 1
        if steps > 1:
            state.stats.burst_turns += 1
        out.append(RunRequestTurn(lane, steps))
        return
    if batch_ok:
        # NOTE: a step chain only while the serial lane has no work (symmetric
        # to the lane holder's burst); work arriving later preempts it.
        steps = 1 if lane is not None and state.ready(lane) else state.max_burst
        state.stats.batch_turns += 1
        if steps > 1:
            state.stats.batch_chains += 1
        state.grants += 1
        state.turn = Turn("batch", str(state.stats.batch_turns), now, steps, grant=state.grants)
        state.last_owner = "batch"
        out.append(RunBatchTurn(state.stats.batch_turns, steps))
        # NOTE: a step due now rides the new chain (after its first step)
        # instead of taking a turn of its own before it.
        _preempt_for_other_lane(state, state.turn, now, out)
        return
    # NOTE: here no request can run: the lane is free (and so is the queue),
    # or its holder has had no turn and still waits for its lookup; and no
    # batch step has work. Rows of the batch lane (even waiting ones) keep
    # background work out: it never runs between the steps of active rows.
    # NOTE: nor a lane holder blocked on its full stream: its reader may make
    # room any moment, and its next step must not wait behind background work
    # (as before, when its turn waited for the reader).
    blocked = state.lane_blocked or "blocked" in state.parked.values()
    if state.background and not state.stopped and not state.batch_busy and not blocked:
        _grant_background(state, now, out, under_load=False)
