"""Sans-IO core of the gateway: admission queue, serial lane, engine-turn token.

The core never awaits, never reads a clock and never touches MLX: the shell
feeds it events (each carrying ``now`` from the injected clock) and performs
the effects it returns, in order. That makes the turn protocol testable with
plain function calls and replayable from a trace.

Invariants (checked by the tests):

- At most one engine turn is in flight (``turn`` is ``None`` or one owner).
- A background turn is granted only when the lane is free AND no request
  waits in the queue; so a background step never runs while a request is
  active or queued.
- The lane holder takes its turns back to back; when a turn ends the next
  owner is chosen lane-first, then queue, then background. So a request that
  arrives during a background step waits for that one step only.
- A cancelled queued request leaves the queue at once; a cancelled lane
  holder is finished when its in-flight turn ends (within one step).
- A request turn may be a *burst* of up to ``max_burst`` steps (the runner
  runs them back to back without a report per step). Rule 3 makes that
  equivalent to granting the steps one by one: nobody else could get the
  turn before the lane holder ends anyway. Only a cancel of the holder must
  cut a burst short, so the core then emits ``PreemptTurn`` (the runner
  stops after the step in flight: the lane is still free within one step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "AdmitRequest",
    "BackgroundTurnDone",
    "BeginDrain",
    "CancelRequest",
    "CoreEvent",
    "Drained",
    "Effect",
    "FinishRequest",
    "GatewayCore",
    "PreemptTurn",
    "RefuseBackground",
    "RejectRequest",
    "RequestAdmitted",
    "RequestTurnDone",
    "RunBackgroundTurn",
    "RunRequestTurn",
    "StopTurns",
    "TokenStats",
    "WantBackgroundTurn",
]

Phase = Literal["prefill", "decode"]
RequestOutcome = Literal["continue", "finished", "failed", "cancelled"]


# --- events (shell -> core) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """A requester asks for the lane."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """The requester left (stream closed, client disconnected)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class WantBackgroundTurn:
    """A background actor asks for one engine turn (``RunWhenIdle``)."""

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
class BackgroundTurnDone:
    """A background engine turn ended (successfully or not; the shell replies to the asker)."""

    step_id: str
    now: float


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
    | WantBackgroundTurn
    | RequestTurnDone
    | BackgroundTurnDone
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
class RunRequestTurn:
    """Run the lane holder's next step (one prefill chunk or one decode step) on the engine.

    ``max_steps`` > 1 grants a burst: up to that many decode steps back to
    back, ended early by ``PreemptTurn`` (or the request's end).
    """

    request_id: str
    max_steps: int = 1


@dataclass(frozen=True, slots=True)
class PreemptTurn:
    """End the lane holder's burst after the step in flight (its requester cancelled)."""

    request_id: str


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
class RefuseBackground:
    """Answer a ``RunWhenIdle`` ask without running it (turns are stopped)."""

    step_id: str


@dataclass(frozen=True, slots=True)
class Drained:
    """Draining and nothing is running or queued any more."""


Effect = (
    RequestAdmitted
    | RejectRequest
    | RunRequestTurn
    | FinishRequest
    | PreemptTurn
    | RunBackgroundTurn
    | RefuseBackground
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


@dataclass(frozen=True, slots=True)
class _Turn:
    owner: Literal["request", "background"]
    ident: str
    started: float
    max_steps: int = 1


@dataclass(slots=True)
class GatewayCore:
    """The gateway's decision state; feed events with :meth:`handle`, perform the effects."""

    max_queue: int
    max_burst: int = 1
    lane: str | None = None
    lane_had_turns: bool = False
    lane_cancelled: bool = False
    queue: deque[str] = field(default_factory=deque)
    background: deque[tuple[str, float]] = field(default_factory=deque)
    turn: _Turn | None = None
    draining: bool = False
    stopped: bool = False
    drained_reported: bool = False
    stats: TokenStats = field(default_factory=TokenStats)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_burst < 1:
            raise ValueError("max_burst must be >= 1")

    # NOTE: one entry point keeps the shell trivial and the trace complete:
    # every state change is caused by exactly one recorded event.
    def handle(self, event: CoreEvent) -> list[Effect]:
        """Apply one event and return the effects to perform, in order."""
        effects: list[Effect] = []
        match event:
            case AdmitRequest():
                self._admit(event, effects)
            case CancelRequest():
                self._cancel(event, effects)
            case WantBackgroundTurn():
                if self.stopped:
                    self.stats.background_refused += 1
                    effects.append(RefuseBackground(event.step_id))
                else:
                    self.background.append((event.step_id, event.now))
            case RequestTurnDone():
                self._request_turn_done(event, effects)
            case BackgroundTurnDone():
                self._background_turn_done(event)
            case BeginDrain():
                self.draining = True
            case StopTurns():
                self.stopped = True
                self.draining = True
                while self.background:
                    step_id, _ = self.background.popleft()
                    self.stats.background_refused += 1
                    effects.append(RefuseBackground(step_id))
        self._dispatch(event.now, effects)
        return effects

    # --- queries -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a request holds or waits for the lane (background must wait)."""
        return self.lane is not None or bool(self.queue)

    @property
    def idle(self) -> bool:
        """True when no turn runs and nobody waits: nothing to drain."""
        return self.turn is None and not self.busy and not self.background

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
            "max_queue": self.max_queue,
            "background_waiting": len(self.background),
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
            "background_refused": s.background_refused,
        }

    # --- transitions ---------------------------------------------------------

    def _admit(self, ev: AdmitRequest, out: list[Effect]) -> None:
        rid = ev.request_id
        if rid == self.lane or rid in self.queue:
            out.append(RejectRequest(rid, "duplicate_id", len(self.queue), self.max_queue))
            return
        if self.draining:
            self.stats.rejected_shutting_down += 1
            out.append(RejectRequest(rid, "shutting_down", len(self.queue), self.max_queue))
            return
        if self.lane is None and not self.queue:
            # NOTE: the lane is reserved even while a background turn runs; the
            # request then waits for that one step only (dispatch picks the
            # lane before background when the turn ends).
            self._take_lane(rid)
            self.stats.admitted += 1
            out.append(RequestAdmitted(rid, 0))
            return
        if len(self.queue) >= self.max_queue:
            self.stats.rejected_queue_full += 1
            out.append(RejectRequest(rid, "queue_full", len(self.queue), self.max_queue))
            return
        self.queue.append(rid)
        self.stats.admitted += 1
        out.append(RequestAdmitted(rid, len(self.queue)))

    def _cancel(self, ev: CancelRequest, out: list[Effect]) -> None:
        rid = ev.request_id
        if rid in self.queue:
            self.queue.remove(rid)
            self.stats.cancelled += 1
            out.append(FinishRequest(rid, "cancelled", had_turns=False))
        elif rid == self.lane:
            if self.turn is not None and self.turn.owner == "request":
                # NOTE: a step in flight on the engine thread cannot be
                # interrupted; the holder is finished when it reports back.
                # A burst must not start another step after this one.
                if not self.lane_cancelled and self.turn.max_steps > 1:
                    self.stats.preempted += 1
                    out.append(PreemptTurn(rid))
                self.lane_cancelled = True
            else:
                self.stats.cancelled += 1
                out.append(FinishRequest(rid, "cancelled", had_turns=self.lane_had_turns))
                self._free_lane()
        # NOTE: unknown ids are ignored: a cancel may race the request's own end.

    def _request_turn_done(self, ev: RequestTurnDone, out: list[Effect]) -> None:
        turn = self.turn
        if turn is None or turn.owner != "request" or turn.ident != ev.request_id:
            raise ValueError(f"request turn report for {ev.request_id!r} but holder is {self.holder()!r}")
        if not 1 <= ev.steps <= turn.max_steps:
            raise ValueError(f"turn of {ev.request_id!r} ran {ev.steps} steps, granted {turn.max_steps}")
        self.turn = None
        self.stats.request_held_s += max(0.0, ev.now - turn.started)
        self.stats.max_burst_steps = max(self.stats.max_burst_steps, ev.steps)
        if ev.phase == "prefill":
            self.stats.prefill_turns += ev.steps
        else:
            self.stats.decode_turns += ev.steps
        if ev.outcome == "finished":
            self.stats.completed += 1
            self._free_lane()
        elif ev.outcome == "failed":
            self.stats.failed += 1
            self._free_lane()
        elif ev.outcome == "cancelled":
            # NOTE: the runner found the stream gone and already cleaned up.
            self.stats.cancelled += 1
            self._free_lane()
        elif self.lane_cancelled:
            self.stats.cancelled += 1
            out.append(FinishRequest(ev.request_id, "cancelled", had_turns=True))
            self._free_lane()

    def _background_turn_done(self, ev: BackgroundTurnDone) -> None:
        turn = self.turn
        if turn is None or turn.owner != "background" or turn.ident != ev.step_id:
            raise ValueError(f"background turn report for {ev.step_id!r} but holder is {self.holder()!r}")
        self.turn = None
        self.stats.background_held_s += max(0.0, ev.now - turn.started)

    def _take_lane(self, rid: str) -> None:
        self.lane = rid
        self.lane_had_turns = False
        self.lane_cancelled = False

    def _free_lane(self) -> None:
        self.lane = None
        self.lane_had_turns = False
        self.lane_cancelled = False

    def _dispatch(self, now: float, out: list[Effect]) -> None:
        if self.draining and not self.drained_reported and not self.busy:
            # NOTE: drained means "no request runs or waits"; background turns
            # keep running during a drain (a shutdown flush needs them).
            self.drained_reported = True
            out.append(Drained())
        if self.turn is not None:
            return
        if self.lane is None and self.queue:
            self._take_lane(self.queue.popleft())
        if self.lane is not None:
            self.turn = _Turn("request", self.lane, now, self.max_burst)
            self.lane_had_turns = True
            self.stats.request_turns += 1
            if self.max_burst > 1:
                self.stats.burst_turns += 1
            out.append(RunRequestTurn(self.lane, self.max_burst))
            return
        if self.background and not self.stopped:
            step_id, asked = self.background.popleft()
            waited = max(0.0, now - asked)
            self.stats.background_wait_s += waited
            self.stats.max_background_wait_s = max(self.stats.max_background_wait_s, waited)
            self.stats.background_turns += 1
            self.turn = _Turn("background", step_id, now)
            out.append(RunBackgroundTurn(step_id))
