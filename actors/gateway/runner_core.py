"""Sans-IO core of the turn runner: what to run on the engine, what to stream, what to report.

``handle(state, event) -> (state, effects)`` decides; the shell
(``runner.py``) performs. The core never awaits, never reads a clock and
never touches the engine: engine work leaves as a ``Submit`` effect (one job
at a time; later jobs wait in ``queued``) and comes back as events
(``StepDone`` per step, ``JobEnded`` once the job is over). Streaming a
token is the one effect whose outcome the core needs: ``EmitToken`` is
always the last effect of its batch and the shell answers it with
``TokenDelivered``, ``StreamGone`` or, when the stream has no room now,
``StreamFull``: nothing waits on a reader. The token is then *held* (with
any later token of the job in flight), the turn ends ``blocked`` (the
gateway grants the request no turn until told, so the engine serves the
other lane meanwhile), and the held tokens go out through ``DeliverHeld``
as the reader makes room, tried by a retry alarm (``ArmRetry``,
``RetryHeld``); once all went out the gateway hears ``LaneUnblocked``. A
held stream that takes nothing for ``write_timeout_s`` is gone: its
request stops (cache kept) and its stream ends with
``ErrorEvent(stream_write_timeout)``.

Invariants (checked by the tests):

- one engine job in flight at a time, in the order decided here (a dropped
  request's cleanup runs before the next turn's steps);
- every granted turn is reported exactly once (``RequestTurnReport`` or
  ``BackgroundTurnReport``), after its last job ended, unless the gateway
  already ended it (``EndRequested(reason="failed")``);
- a turn's steps never exceed its grant; once the turn must stop (cancel,
  stream gone, request finished) no further job is started for it and the
  running one is asked to stop (``StopSteps``): at most the step in flight
  completes;
- a request's tokens reach its stream in order, none dropped, while it
  lives; one whose turn ended ``blocked`` is told unblocked (or finished,
  or cancelled) to the gateway exactly once;
- every cache entry the engine registered is handed to the prompt cache
  (``PutEntry``), whatever happened to its request; every lookup lease the
  runner received is released once, after the generation opened (or failed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, assert_never

from actors.engine_thread.ports import Registered, StepResult
from messages.gateway import (
    BackgroundTurnReport,
    DoneEvent,
    ErrorEvent,
    Generate,
    LaneUnblocked,
    RequestTurnReport,
    RunTurn,
    Timings,
    TokenEvent,
    TurnOutcome,
    Usage,
)
from messages.prompt_cache import EntryRole, Put
from messages.ssd_writer import ObservePrefill

from .burst import StepOutput
from .engine_work import Opening

__all__ = [
    "STREAM_WRITE_TIMEOUT",
    "ArmRetry",
    "BackgroundJob",
    "Crash",
    "DeliverHeld",
    "DropJob",
    "Effect",
    "EmitToken",
    "EndRequested",
    "EndStream",
    "Event",
    "HeldDelivered",
    "Job",
    "JobEnded",
    "JobError",
    "Live",
    "Observe",
    "Preempt",
    "PutEntry",
    "ReleaseLease",
    "Report",
    "RetryHeld",
    "RunnerState",
    "StepDone",
    "StepJob",
    "StopSteps",
    "StreamFull",
    "StreamGone",
    "Submit",
    "TokenDelivered",
    "Turn",
    "TurnGranted",
    "UnknownTurn",
    "handle",
]

Phase = Literal["prefill", "decode"]

STREAM_WRITE_TIMEOUT = "stream_write_timeout"
"""``ErrorEvent.error_code`` of a stream that stayed full past the stream-write deadline."""


class UnknownTurn(ValueError):
    """A turn for a request the runner never started, or a second turn while one runs."""


# --- engine jobs ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepJob:
    """Steps of ``request_id``'s turn: at least one, at most ``budget`` (a burst), opening first if asked."""

    request_id: str
    budget: int
    correlation_id: str
    namespace: str
    opening: Opening | None = None


@dataclass(frozen=True, slots=True)
class DropJob:
    """End ``request_id``'s generation: keep its cache as an entry (``keep``) or free it."""

    request_id: str
    keep: bool
    namespace: str
    correlation_id: str


@dataclass(frozen=True, slots=True)
class BackgroundJob:
    """Run the registered background step ``step_id``."""

    step_id: str


Job = StepJob | DropJob | BackgroundJob


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job failed: ``code`` (the exception's type name, or a runner code) and ``detail``."""

    code: str
    detail: str


# --- events (shell -> core) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnGranted:
    """The gateway granted a turn (``RunTurn``); ``correlation_id`` is its request's."""

    turn: RunTurn
    correlation_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Preempt:
    """``StopBurst``: the lane holder's requester cancelled; end its burst after the step in flight."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class EndRequested:
    """``EndRequest``: drop a request (``cancelled``: keep its cache, end its stream)."""

    request_id: str
    reason: Literal["cancelled", "failed"]
    now: float


@dataclass(frozen=True, slots=True)
class StepDone:
    """The running ``StepJob`` produced one step's output."""

    output: StepOutput
    now: float


@dataclass(frozen=True, slots=True)
class TokenDelivered:
    """The last ``EmitToken`` reached its stream."""

    now: float


@dataclass(frozen=True, slots=True)
class StreamGone:
    """The last ``EmitToken`` found its stream closed (the requester left)."""

    now: float


@dataclass(frozen=True, slots=True)
class StreamFull:
    """The last ``EmitToken`` found its stream without room now: the token is held."""

    now: float


@dataclass(frozen=True, slots=True)
class RetryHeld:
    """The retry alarm went off: try the held streams again."""

    now: float


@dataclass(frozen=True, slots=True)
class HeldDelivered:
    """A ``DeliverHeld`` sent the first ``sent`` held tokens (``gone``: the stream is closed)."""

    request_id: str
    sent: int
    gone: bool
    now: float


@dataclass(frozen=True, slots=True)
class JobEnded:
    """The running job is over (every ``StepDone`` of it came first); ``kept``: a ``DropJob``'s entry."""

    now: float
    error: JobError | None = None
    kept: Registered | None = None


@dataclass(frozen=True, slots=True)
class Crash:
    """The shell hit a bug while performing the turn: fail the turn's request now; the lane goes on."""

    error: JobError
    now: float


Event = (TurnGranted | Preempt | EndRequested | StepDone | TokenDelivered | StreamGone | StreamFull
         | RetryHeld | HeldDelivered | JobEnded | Crash)


# --- effects (core -> shell) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Start ``job`` on the engine thread as job number ``job_id`` (on behalf of ``correlation_id``)."""

    job_id: int
    job: Job
    correlation_id: str


@dataclass(frozen=True, slots=True)
class StopSteps:
    """Set the stop flag of running job ``job_id``: it starts no further step."""

    job_id: int


@dataclass(frozen=True, slots=True)
class EmitToken:
    """Send ``event`` to the stream (waiting while it is full, at most the stream-write
    deadline); answer ``TokenDelivered``/``StreamGone``."""

    stream_to: str
    correlation_id: str
    event: TokenEvent


@dataclass(frozen=True, slots=True)
class DeliverHeld:
    """Send ``events`` (a request's held tokens, in order) without waiting, until the stream
    refuses one; answer ``HeldDelivered``."""

    request_id: str
    stream_to: str
    correlation_id: str
    events: tuple[TokenEvent, ...]


@dataclass(frozen=True, slots=True)
class ArmRetry:
    """Post a ``RetryHeld`` at clock time ``at`` (``None``: no held stream, disarm)."""

    at: float | None


@dataclass(frozen=True, slots=True)
class EndStream:
    """End the stream with ``final`` (delivered even when the stream is full)."""

    stream_to: str
    correlation_id: str
    final: DoneEvent | ErrorEvent


@dataclass(frozen=True, slots=True)
class Report:
    """Tell the gateway the turn ended."""

    correlation_id: str
    body: RequestTurnReport | BackgroundTurnReport | LaneUnblocked


@dataclass(frozen=True, slots=True)
class PutEntry:
    """Hand a registered entry to the prompt cache (it owns the handle from then on)."""

    correlation_id: str
    put: Put


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """Give a lookup's lease back to the prompt cache."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class Observe:
    """Report a measured prefill to the cold tier's restore-or-recompute estimator."""

    body: ObservePrefill


Effect = (Submit | StopSteps | EmitToken | DeliverHeld | ArmRetry | EndStream | Report | PutEntry
          | ReleaseLease | Observe)

MIN_OBSERVED_PREFILL = 32
"""Prefills shorter than this many computed tokens are not reported (their time is mostly overhead)."""


# --- state ---------------------------------------------------------------------


@dataclass(slots=True)
class Live:
    """A request the runner has started: its stream, its lookup lease, its accounting."""

    request: Generate
    correlation_id: str
    admitted_at: float
    lease_id: str | None = None
    lookup_at: tuple[float | None, float | None] = (None, None)
    """When the gateway's lookup was sent and answered (``Timings``)."""
    handle: str | None = None
    staging_id: str | None = None
    tier: Literal["ram", "ssd"] | None = None
    lookup_tokens: int = 0
    opened: bool = False
    cached_tokens: int = 0
    emitted: int = 0
    first_token_at: float | None = None
    started_at: float | None = None
    held: deque[tuple[TokenEvent, StepResult]] = field(default_factory=deque)
    """Tokens its full stream did not take yet, in order (the turn that produced them ended
    ``blocked``); the last one's result says whether it finished."""
    held_since: float = 0.0
    """When the held stream last took something (or was first found full)."""
    delivering: bool = False
    """A ``DeliverHeld`` of its held tokens is out."""
    prefill_s: float = 0.0
    open_s: float = 0.0
    """Of ``prefill_s``: the openings (an SSD landing, a RAM entry's copy), not prefill work."""
    decode_s: float = 0.0


@dataclass(slots=True)
class Turn:
    """The granted turn in progress."""

    owner: Literal["request", "background"]
    ident: str
    correlation_id: str
    max_steps: int
    began: float
    namespace: str = ""
    steps: int = 0
    phase: Phase = "prefill"
    stop: bool = False
    more: bool = False
    """The last step allows another one (a decode step that did not finish)."""
    outcome: TurnOutcome = "continue"
    delivering: tuple[TokenEvent, StepResult] | None = None
    """The token on its way to the stream, with the step that made it."""
    silent: bool = False
    """The gateway already ended this turn: report nothing."""


@dataclass(slots=True)
class RunnerState:
    """Everything the runner's rules know. ``keep_entries``: a prompt cache takes registered entries."""

    keep_entries: bool = False
    write_timeout_s: float = 30.0
    """The stream-write deadline: a held stream that takes nothing this long is gone."""
    retry_s: float = 0.02
    """How often the held streams are tried again."""
    live: dict[str, Live] = field(default_factory=dict)
    turn: Turn | None = None
    running: tuple[int, Job] | None = None
    queued: deque[Job] = field(default_factory=deque)
    jobs: int = 0


# --- the core --------------------------------------------------------------------


def handle(state: RunnerState, event: Event) -> tuple[RunnerState, list[Effect]]:
    """Apply one event; return the next state and the effects to perform, in order.

    NOTE: the state is updated in place and returned. An event that does not
    fit (a turn for an unknown request, a second turn) raises ``UnknownTurn``
    before anything changes.
    """
    out: list[Effect] = []
    match event:
        case TurnGranted():
            _granted(state, event, out)
        case Preempt():
            turn = state.turn
            if turn is not None and turn.owner == "request" and turn.ident == event.request_id:
                _stop(state, turn, out)
        case EndRequested():
            _end_requested(state, event, out)
        case StepDone():
            _step_done(state, event, out)
        case TokenDelivered():
            turn = state.turn
            if turn is None or turn.delivering is None:
                raise UnknownTurn("a token delivery outcome without a token in flight")
            (_, result), turn.delivering = turn.delivering, None
            _after_step(state, turn, result, event.now, out)
        case StreamGone():
            _stream_gone(state, event, out)
        case StreamFull():
            _stream_full(state, event, out)
        case RetryHeld():
            _retry_held(state, event.now, out)
        case HeldDelivered():
            _held_delivered(state, event, out)
        case JobEnded():
            _job_ended(state, event, out)
        case Crash():
            turn = state.turn
            if turn is not None and turn.owner == "request":
                turn.delivering = None
                _fail_turn(state, turn, event.error, out, failed_step=False)
            elif turn is not None:
                state.turn = None
                report = BackgroundTurnReport(
                    step_id=turn.ident, ok=False, error_code=event.error.code, detail=event.error.detail
                )
                out.append(Report(turn.correlation_id, report))
        case _:
            assert_never(event)
    _start_next(state, out)
    return state, out


def _granted(state: RunnerState, ev: TurnGranted, out: list[Effect]) -> None:
    body = ev.turn
    if state.turn is not None:
        raise UnknownTurn(f"turn for {body.ident!r} while {state.turn.ident!r} still runs")
    if body.owner == "background":
        state.turn = Turn("background", body.ident, ev.correlation_id, 1, ev.now)
        state.queued.append(BackgroundJob(body.ident))
        return
    rid = body.ident
    live = state.live.get(rid)
    if live is None:
        if body.start is None:
            raise UnknownTurn(f"turn for unknown request {rid!r}")
        lookup = body.lookup
        live = Live(request=body.start, correlation_id=ev.correlation_id, admitted_at=body.admitted_at,
                    lookup_at=(body.lookup_started_at, body.lookup_done_at))
        if lookup is not None:
            live.lease_id, live.handle, live.lookup_tokens = (
                lookup.lease_id,
                lookup.handle,
                lookup.cached_tokens,
            )
            live.staging_id, live.tier = lookup.staging_id, lookup.tier
        state.live[rid] = live
    if live.started_at is None:
        live.started_at = ev.now
    state.turn = Turn(
        "request", rid, live.correlation_id, body.max_steps, ev.now, live.request.namespace
    )
    opening: Opening | None = None
    if not live.opened:
        live.opened = True
        # NOTE: a request that scores its prompt forwards all of it (a cached
        # prefix has no logits); its lease is released as after any opening.
        opening = (Opening(live.request) if live.request.params.prompt_logprobs is not None
                   else Opening(live.request, live.handle, live.lookup_tokens, live.staging_id))
    state.queued.append(
        StepJob(rid, body.max_steps, live.correlation_id, live.request.namespace, opening)
    )


def _step_done(state: RunnerState, ev: StepDone, out: list[Effect]) -> None:
    turn = state.turn
    running = state.running
    if running is None or not isinstance(running[1], StepJob):
        raise UnknownTurn("a step output without a running step job")
    job = running[1]
    rid = job.request_id
    output = ev.output
    result = output.result
    for role, entry in output.entries:
        # NOTE: the engine registered it: the prompt cache owns it now,
        # whatever happens to the request.
        out.append(_put(job.correlation_id, job.namespace, role, entry))
    if turn is None or turn.ident != rid:
        return  # NOTE: a step of a turn that already ended (failed): nothing else to do.
    live = state.live.get(rid)
    # NOTE: every step the engine ran counts against the grant, streamed or not.
    turn.steps += 1
    turn.phase = result.phase
    if live is not None and output.cached_tokens is not None:
        live.cached_tokens = output.cached_tokens
        if live.lease_id is not None:
            out.append(ReleaseLease(live.lease_id))
            live.lease_id = None
    blocked = live is not None and turn.outcome == "blocked" and bool(live.held)
    if live is None or (turn.outcome != "continue" and not blocked):
        return  # NOTE: a step the engine ran after the request stopped: nothing to stream.
    elapsed = max(0.0, ev.now - turn.began)
    turn.began = ev.now
    if result.phase == "prefill":
        live.prefill_s += elapsed
        live.open_s += min(elapsed, output.open_s)
    else:
        live.decode_s += elapsed
    if result.finish_reason is not None:
        live.opened = False  # NOTE: the engine registered or dropped the generation itself.
    token = result.token
    if token is None:
        _after_step(state, turn, result, ev.now, out)
        return
    if live.first_token_at is None:
        live.first_token_at = ev.now
    event = TokenEvent(
        request_id=rid,
        index=live.emitted,
        token_id=token.token_id,
        text=token.text,
        logprob=token.logprob,
        top_logprobs=token.top_logprobs,
        prompt_logprobs=token.prompt_logprobs,
    )
    live.emitted += 1
    if blocked:
        # NOTE: a step the chain ran ahead of the full stream: held behind the others.
        live.held.append((event, result))
        _maybe_end_turn(state, turn, out)
        return
    turn.delivering = (event, result)
    out.append(EmitToken(live.request.stream_to, live.correlation_id, event))


def _after_step(state: RunnerState, turn: Turn, result: StepResult, now: float, out: list[Effect]) -> None:
    rid = turn.ident
    if result.finish_reason is not None:
        live = state.live.pop(rid, None)
        if live is not None:
            _observe(live, out)
            out.append(EndStream(live.request.stream_to, live.correlation_id, _done(live, result.finish_reason, now)))
        turn.outcome = "finished"
        turn.stop = True
    else:
        turn.more = result.phase == "decode"
    _maybe_end_turn(state, turn, out)


def _stream_gone(state: RunnerState, ev: StreamGone, out: list[Effect]) -> None:
    del ev
    turn = state.turn
    if turn is None or turn.delivering is None:
        raise UnknownTurn("a token delivery outcome without a token in flight")
    turn.delivering = None
    live = state.live.pop(turn.ident, None)
    # NOTE: the requester closed its stream (client left): stop now and keep
    # what was computed for the prompt cache, after the job in flight (one
    # job at a time on the engine thread).
    turn.outcome = "cancelled"
    _stop(state, turn, out)
    if live is not None:
        _drop(state, live, keep=True, out=out)
    _maybe_end_turn(state, turn, out)


def _stream_full(state: RunnerState, ev: StreamFull, out: list[Effect]) -> None:
    """The token found no room: hold it, stop the turn's steps and end it ``blocked``.

    NOTE: waiting here for the reader held the one engine turn, so a client
    that stopped reading a serial-lane answer (grammar, ``top_logprobs``,
    ``--max-batch 1``) stopped every other client, the batch lane's too, for
    up to the stream-write deadline (measured: a batch request took 26 s
    instead of 0.7 s beside such a reader). The engine goes on with the
    other lane; the request takes turns again once its tokens went out.
    """
    turn = state.turn
    if turn is None or turn.delivering is None:
        raise UnknownTurn("a token delivery outcome without a token in flight")
    live = state.live.get(turn.ident)
    held, turn.delivering = turn.delivering, None
    if live is None:
        _maybe_end_turn(state, turn, out)
        return
    live.held.append(held)
    live.held_since = ev.now
    turn.outcome = "blocked"
    _stop(state, turn, out)
    out.append(ArmRetry(ev.now + state.retry_s))
    _maybe_end_turn(state, turn, out)


def _retry_held(state: RunnerState, now: float, out: list[Effect]) -> None:
    """Try every held stream whose turn has ended; end those past the deadline; re-arm."""
    turn = state.turn
    for rid, live in list(state.live.items()):
        if not live.held or live.delivering:
            continue
        if turn is not None and turn.owner == "request" and turn.ident == rid:
            continue  # NOTE: its blocked turn is still ending: the gateway hears that first.
        if now - live.held_since >= state.write_timeout_s:
            _stalled(state, rid, live, out)
            continue
        live.delivering = True
        events = tuple(event for event, _ in live.held)
        out.append(DeliverHeld(rid, live.request.stream_to, live.correlation_id, events))
    _arm(state, now, out)


def _arm(state: RunnerState, now: float, out: list[Effect]) -> None:
    held = any(live.held for live in state.live.values())
    out.append(ArmRetry(now + state.retry_s if held else None))


def _held_delivered(state: RunnerState, ev: HeldDelivered, out: list[Effect]) -> None:
    rid = ev.request_id
    live = state.live.get(rid)
    if live is None or not live.delivering:
        return  # NOTE: the request ended meanwhile (the gateway cancelled it).
    live.delivering = False
    last: StepResult | None = None
    for _ in range(min(ev.sent, len(live.held))):
        _, last = live.held.popleft()
    if ev.sent:
        live.held_since = ev.now  # NOTE: the reader took something: the deadline starts again.
    if ev.gone:
        del state.live[rid]
        _drop(state, live, keep=True, out=out)
        out.append(Report(live.correlation_id, LaneUnblocked(request_id=rid, outcome="cancelled")))
    elif not live.held:
        assert last is not None
        if last.finish_reason is not None:
            del state.live[rid]
            _observe(live, out)
            final = _done(live, last.finish_reason, ev.now)
            out.append(EndStream(live.request.stream_to, live.correlation_id, final))
            outcome: Literal["continue", "finished"] = "finished"
        else:
            outcome = "continue"
        out.append(Report(live.correlation_id, LaneUnblocked(request_id=rid, outcome=outcome)))
    _arm(state, ev.now, out)


def _stalled(state: RunnerState, rid: str, live: Live, out: list[Effect]) -> None:
    """A held stream that took nothing for the deadline: the request stops, its cache kept."""
    del state.live[rid]
    _drop(state, live, keep=True, out=out)
    # NOTE: the reader is still there but took nothing for the whole deadline:
    # its stream ends (the final uses the reserved room), so a reader that comes
    # back learns why instead of waiting forever.
    final = ErrorEvent(
        request_id=rid,
        error_code=STREAM_WRITE_TIMEOUT,
        detail="the stream stayed full past the stream-write deadline; "
        "the request was stopped so the other requests go on",
    )
    out.append(EndStream(live.request.stream_to, live.correlation_id, final))
    out.append(Report(live.correlation_id, LaneUnblocked(request_id=rid, outcome="cancelled")))


def _end_requested(state: RunnerState, ev: EndRequested, out: list[Effect]) -> None:
    rid = ev.request_id
    turn = state.turn
    if turn is not None and turn.owner == "request" and turn.ident == rid:
        # NOTE: the gateway ended this turn itself (its Failure path): stop it
        # and report nothing more.
        turn.silent = True
        turn.outcome = "failed"
        _stop(state, turn, out)
    live = state.live.pop(rid, None)
    if live is None:
        return
    cancelled = ev.reason == "cancelled"
    _drop(state, live, keep=cancelled, out=out)
    if cancelled:
        out.append(EndStream(live.request.stream_to, live.correlation_id, _done(live, "cancelled", ev.now)))
    if turn is not None and turn.silent:
        _maybe_end_turn(state, turn, out)


def _job_ended(state: RunnerState, ev: JobEnded, out: list[Effect]) -> None:
    if state.running is None:
        raise UnknownTurn("a job ended but none was running")
    _, job = state.running
    state.running = None
    turn = state.turn
    match job:
        case StepJob():
            if turn is None or turn.ident != job.request_id:
                return
            if ev.error is not None and turn.outcome == "continue":
                _fail_turn(state, turn, ev.error, out, failed_step=True)
                return
            _maybe_end_turn(state, turn, out)
        case DropJob():
            if ev.kept is not None:
                out.append(_put(job.correlation_id, job.namespace, "completion", ev.kept))
        case BackgroundJob():
            error = ev.error
            report = BackgroundTurnReport(
                step_id=job.step_id,
                ok=error is None,
                error_code="" if error is None else error.code,
                detail="" if error is None else error.detail,
            )
            if turn is not None and turn.owner == "background":
                state.turn = None
                out.append(Report(turn.correlation_id, report))
        case _:
            assert_never(job)


def _fail_turn(
    state: RunnerState, turn: Turn, error: JobError, out: list[Effect], *, failed_step: bool
) -> None:
    """Fail the turn's request (its engine job raised, or the shell hit a bug) and report at once.

    NOTE: reporting before a job still running for it ends is safe: the
    request's cleanup and every later job queue behind it here, so the
    engine thread still holds one job at a time.
    """
    rid = turn.ident
    live = state.live.pop(rid, None)
    if failed_step:
        # NOTE: the failing step ran too (a burst that failed at its k-th step ran k).
        turn.steps = min(turn.steps + 1, turn.max_steps)
    turn.outcome = "failed"
    _stop(state, turn, out)
    state.queued = deque(
        job for job in state.queued if not (isinstance(job, StepJob) and job.request_id == rid)
    )
    if live is not None:
        _drop(state, live, keep=False, out=out)
        final = ErrorEvent(request_id=rid, error_code=error.code, detail=error.detail)
        out.append(EndStream(live.request.stream_to, live.correlation_id, final))
        turn.phase = "decode" if live.emitted else "prefill"
    state.turn = None
    if not turn.silent:
        report = RequestTurnReport(
            request_id=rid, phase=turn.phase, outcome="failed", steps=max(1, turn.steps)
        )
        out.append(Report(turn.correlation_id, report))


def _stop(state: RunnerState, turn: Turn, out: list[Effect]) -> None:
    turn.stop = True
    running = state.running
    if running is not None and isinstance(running[1], StepJob) and running[1].request_id == turn.ident:
        out.append(StopSteps(running[0]))


def _drop(state: RunnerState, live: Live, *, keep: bool, out: list[Effect]) -> None:
    """A stopped request: release its lease if still held; queue the end of its generation."""
    if live.lease_id is not None:
        out.append(ReleaseLease(live.lease_id))
        live.lease_id = None
    if live.opened:
        live.opened = False
        request = live.request
        state.queued.append(
            DropJob(request.request_id, keep and state.keep_entries, request.namespace, live.correlation_id)
        )


def _steps_pending(state: RunnerState, rid: str) -> bool:
    running = state.running
    if running is not None and isinstance(running[1], StepJob) and running[1].request_id == rid:
        return True
    return any(isinstance(job, StepJob) and job.request_id == rid for job in state.queued)


def _maybe_end_turn(state: RunnerState, turn: Turn, out: list[Effect]) -> None:
    """Report the turn once nothing of it is running or being streamed; or chain more steps."""
    if state.turn is not turn or turn.delivering is not None or _steps_pending(state, turn.ident):
        return
    if turn.outcome == "continue" and not turn.stop and turn.more and turn.steps < turn.max_steps:
        # NOTE: the chain stopped ahead of the stream (a slow reader); the
        # grant allows more: queue the next chain now that the stream caught up.
        state.queued.append(
            StepJob(turn.ident, turn.max_steps - turn.steps, turn.correlation_id, turn.namespace)
        )
        return
    state.turn = None
    if turn.silent:
        return
    report = RequestTurnReport(
        request_id=turn.ident, phase=turn.phase, outcome=turn.outcome, steps=max(1, turn.steps)
    )
    out.append(Report(turn.correlation_id, report))


def _start_next(state: RunnerState, out: list[Effect]) -> None:
    if state.running is None and state.queued:
        state.jobs += 1
        job = state.queued.popleft()
        state.running = (state.jobs, job)
        if isinstance(job, DropJob):
            correlation = job.correlation_id
        else:
            correlation = "" if state.turn is None else state.turn.correlation_id
        out.append(Submit(state.jobs, job, correlation))


def _observe(live: Live, out: list[Effect]) -> None:
    """A finished request's prefill speed, for restore-or-recompute (cold, RAM hits, SSD hits).

    Reports the prompt tokens it computed and its prefill turns' time less
    the openings' (``open_s``: an SSD hit's landing, a RAM hit's copy).
    NOTE: a request served from the SSD tier reports the suffix it
    prefilled after its landing: after a restart every turn may be served
    from disk, and the estimator's prefill side would otherwise stay at its
    prior.
    """
    computed = len(live.request.prompt_tokens) - live.cached_tokens
    seconds = live.prefill_s - live.open_s
    if computed < MIN_OBSERVED_PREFILL or seconds <= 0:
        return
    out.append(Observe(ObservePrefill(tokens=computed, seconds=seconds)))


def _put(correlation_id: str, namespace: str, role: EntryRole, entry: Registered) -> PutEntry:
    put = Put(tokens=entry.tokens, namespace=namespace, handle=entry.handle, meta=entry.meta, role=role)
    return PutEntry(correlation_id, put)


def _done(live: Live, reason: Literal["stop", "length", "cancelled"], now: float) -> DoneEvent:
    request = live.request
    first = live.first_token_at
    return DoneEvent(
        request_id=request.request_id,
        finish_reason=reason,
        usage=Usage(
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=live.emitted,
            cached_tokens=live.cached_tokens,
        ),
        timings=Timings(
            queued_s=max(0.0, (live.started_at or now) - live.admitted_at),
            ttft_s=max(0.0, (first if first is not None else now) - live.admitted_at),
            prefill_s=live.prefill_s,
            decode_s=live.decode_s,
            admitted_at=live.admitted_at,
            lookup_start_s=_since(live.lookup_at[0], live.admitted_at),
            lookup_done_s=_since(live.lookup_at[1], live.admitted_at),
        ),
    )


def _since(mark: float | None, admitted_at: float) -> float | None:
    return None if mark is None else max(0.0, mark - admitted_at)
