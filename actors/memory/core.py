"""The memory actor's rules (sans-IO): admission relief and demotion, one job at a time.

Inputs are messages (:class:`Received`) and sends the shell could not make
(:class:`Undelivered`), each stamped with the clock and the memory reading
the shell took when it arrived (:class:`Gauges`: the gauge the engine thread
writes after every job, and the in-turn guard's counters). Effects:
:class:`Answer` a request, :class:`Ask` another actor (its answer comes back
as a message with the ask's ``ref`` as correlation id), :class:`SetAlarm`
for the earliest reply deadline, :class:`Log`.

An ``AdmitMemory`` is decided at once when it fits
(:func:`actors.engine_thread.memory_guard.decide`), unless the in-turn guard
already refused that request before its prefill (``refused_in_turn``: the
reading it fitted was too low). One that does not fit, or was so refused,
becomes a job; jobs run one at a time, in arrival order (the relief of one
request must not be counted twice by the next). An admission job:

1. ``settle``: one idle engine turn drops freed memory the reading still
   counts (MLX's buffer cache, the C heap's free pages); the executor reads
   again after it.
2. ``measure``: the RAM tier's indexed bytes (what a relief can hand back).
3. decide: fits -> ``MemoryAdmitted``; nothing reclaimable -> ``Refuse``;
   else ``demote`` the bytes over the budget (``prompt_cache.Demote``,
   dropped without a cold tier), ``drain`` the spill queue (the moved
   entries are written or given up), ``release`` their arrays in an idle
   turn, and measure again; at most :attr:`MemoryConfig.rounds` times.

A ``Relieve`` job (``Engine.demote_cache``) is ``before`` (the spill queue's
counts, when waiting), ``demote``, ``drain`` (when waiting), answered with
the counts' difference. Any ask that fails (no answer by its deadline, the
target gone or full) counts as "nothing came of it": a settle or release
turn is skipped, a measure reads 0, a demotion hands nothing back (so the
next decision refuses); a ``Relieve`` is answered with the error.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from actors.engine_thread.memory_guard import (
    Fits,
    Footprint,
    Relieve,
    decide,
    prompt_scoring_bytes,
    token_logprob_bytes,
)
from messages import Body, Envelope, Failure, Request
from messages.gateway import RunWhenIdle, TurnDone
from messages.memory import (
    AdmitMemory,
    MemoryAdmitted,
    MemoryStats,
    MemoryStatsRequest,
    MemoryWake,
    Refuse,
    Relieved,
)
from messages.memory import Relieve as RelieveMessage
from messages.prompt_cache import Demote, DemoteResult, PromptCacheStats, PromptCacheStatsRequest
from messages.spill_queue import DrainSpills, SpillQueueStats, SpillQueueStatsRequest, SpillsDrained

__all__ = [
    "AFTER_RELIEF_MESSAGE",
    "Answer",
    "Ask",
    "Effect",
    "Event",
    "Gauges",
    "Log",
    "MemoryConfig",
    "MemoryState",
    "Received",
    "SetAlarm",
    "Stopping",
    "Target",
    "Undelivered",
    "UnknownMemoryMessage",
    "fits_now",
    "handle",
    "next_wake",
]

Target = Literal["gateway", "prompt_cache", "spill_queue"]

AFTER_RELIEF_MESSAGE = (
    "not enough memory for this request after moving cached entries out of memory; "
    "retry with a shorter prompt or fewer max_tokens, or later"
)


class UnknownMemoryMessage(TypeError):
    """A message the memory actor has no rule for."""


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """What the rules are given at construction.

    ``budget``/``footprint`` ``None``: no guard (every admission fits).
    ``settle_step``/``release_step``: the standing background steps that
    drop freed memory / drop released arrays and then freed memory
    (``None``: skipped). ``prompt_cache``/``spill_queue``: whether those
    actors exist. ``reply_timeout_s``: how long an admission's ask waits.
    ``rounds``: reliefs per admission before it is refused.
    """

    budget: int | None = None
    footprint: Footprint | None = None
    margin: int = 0
    settle_step: str | None = None
    release_step: str | None = None
    prompt_cache: bool = True
    spill_queue: bool = False
    reply_timeout_s: float = 30.0
    rounds: int = 4

    def __post_init__(self) -> None:
        if self.reply_timeout_s <= 0:
            raise ValueError("reply_timeout_s must be positive")
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the shell read from the engine thread's gauges when an input arrived.

    ``active``: the memory in use (``None``: no gauge). ``ahead``: what the
    requests running now may still add to it (every lane's figure in the
    guard's growth ledger, by lane): their KV still to come up to their
    ``max_tokens``, which ``active`` does not show yet. The rest feed
    :class:`MemoryStats` only (thread-safe reads of engine-thread counters).
    """

    active: int | None = None
    ahead: tuple[tuple[str, int], ...] = ()
    samples: int | None = None
    checks: int | None = None
    refused: int | None = None
    refused_before_prefill: int | None = None
    settled: int | None = None
    resident: int | None = None
    mlx: int | None = None
    resident_at_start: int | None = None
    mlx_parts: tuple[int, int, int] | None = None
    device_used: int | None = None
    heap_trims: int | None = None
    heap_trim_s: float | None = None

    @property
    def in_use(self) -> int:
        """The memory an admission must fit beside: ``active`` and the running requests' growth."""
        return (self.active or 0) + sum(growth for _, growth in self.ahead)


# --- inputs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    """A message arrived at clock time ``now``."""

    envelope: Envelope
    now: float
    gauges: Gauges = field(default_factory=Gauges)


@dataclass(frozen=True, slots=True)
class Undelivered:
    """The shell could not send ask ``ref`` (the target's mailbox was full, or it is gone)."""

    ref: str
    now: float
    gauges: Gauges = field(default_factory=Gauges)


@dataclass(frozen=True, slots=True)
class Stopping:
    """The actor stops: answer every waiting asker."""

    now: float
    gauges: Gauges = field(default_factory=Gauges)


Event = Received | Undelivered | Stopping


# --- effects ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply ``body`` to ``request``."""

    request: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class Ask:
    """Send ``body`` to ``to`` without waiting, with this actor as reply slot and ``ref`` as correlation id."""

    ref: str
    to: Target
    body: Request


@dataclass(frozen=True, slots=True)
class SetAlarm:
    """Wake the actor (a ``MemoryWake``) at clock time ``at``; ``None``: no alarm."""

    at: float | None


@dataclass(frozen=True, slots=True)
class Log:
    """A line worth an operator's attention (``level`` info or warning)."""

    event: str
    level: Literal["info", "warning"]
    fields: tuple[tuple[str, str | int | float | None], ...] = ()


Effect = Answer | Ask | SetAlarm | Log


# --- state -------------------------------------------------------------------------------

Phase = Literal["queued", "settle", "measure", "demote", "drain", "release", "before"]


@dataclass
class Job:
    """One admission that did not fit, or one ``Relieve``, in progress or queued."""

    envelope: Envelope
    demand: int = 0
    need: int = 0
    phase: Phase = "queued"
    ref: str | None = None
    deadline: float = 0.0
    rounds: int = 0
    handed: int = 0
    relieved: int = 0
    before: SpillQueueStats | None = None
    result: DemoteResult | None = None

    @property
    def admission(self) -> bool:
        """Whether this job decides an ``AdmitMemory``."""
        return isinstance(self.envelope.body, AdmitMemory)


@dataclass
class MemoryState:
    """Everything the rules know (mutated in place and returned by :func:`handle`)."""

    config: MemoryConfig = field(default_factory=MemoryConfig)
    job: Job | None = None
    queue: deque[Job] = field(default_factory=deque)
    alarm_at: float | None = None
    stopped: bool = False
    seq: int = 0
    admitted: int = 0
    refused: int = 0
    relieved_entries: int = 0
    relieved_bytes: int = 0
    reliefs: int = 0
    readmissions: int = 0
    busy: int = 0
    """Refusals that may fit later (``Refuse.may_fit_later``): the asker waits, not a failure."""
    timeouts: int = 0
    floor: int | None = None
    """The least memory reading seen (the process at rest: weights, nothing cached)."""


# --- helpers -------------------------------------------------------------------------------


def fits_now(config: MemoryConfig, gauges: Gauges, ask: AdmitMemory) -> bool:
    """Whether ``ask`` fits the budget beside ``gauges.in_use`` with nothing moved out.

    The one rule for "admitted at once": the actor answers such an
    ``AdmitMemory`` without a relief, and :class:`~actors.memory.AdmissionCheck`
    lets the asker skip the ask (pure: numbers in, a verdict out).

    NOTE: the running requests' growth counts here as in the check before
    the prefill (``MemoryGuard.before_prefill``): admitted on the reading
    alone, a request that fit it met that check, which cannot relieve (it
    runs inside a turn), and went back to admission, where a relief could
    have made room at once.
    """
    if config.budget is None or config.footprint is None:
        return True
    verdict = decide(active=gauges.in_use, demand=_demand(config.footprint, ask),
                     budget=config.budget, reclaimable=0)
    return isinstance(verdict, Fits)


def _demand(footprint: Footprint, ask: AdmitMemory) -> int:
    demand = footprint.at_prefill(ask.prompt_tokens, ask.max_tokens)
    demand += prompt_scoring_bytes(ask.prompt_tokens, ask.prompt_logprobs)
    return demand + token_logprob_bytes(ask.max_tokens, ask.logprobs, ask.top_logprobs)


def _timeout(state: MemoryState, job: Job) -> float:
    body = job.envelope.body
    if isinstance(body, RelieveMessage):
        return body.timeout_s
    return state.config.reply_timeout_s


def _ask(
    state: MemoryState, job: Job, phase: Phase, to: Target, body: Request, now: float,
    out: list[Effect],
) -> None:
    state.seq += 1
    job.phase, job.ref = phase, f"mem-{state.seq}"
    job.deadline = now + _timeout(state, job)
    out.append(Ask(job.ref, to, body))


def _turn(state: MemoryState, job: Job, phase: Phase, step: str, now: float, out: list[Effect]) -> None:
    # NOTE: the deadline tells the gateway when this ask stops waiting, so a
    # turn nobody waits for is never granted.
    ask = RunWhenIdle(step_id=step, label=f"memory.{phase}", deadline=now + _timeout(state, job))
    _ask(state, job, phase, "gateway", ask, now, out)


def _finish(state: MemoryState, job: Job, body: Body, out: list[Effect]) -> None:
    out.append(Answer(job.envelope, body))
    if state.job is job:
        state.job = None


def _refuse(state: MemoryState, job: Job, detail: str, out: list[Effect], *,
            later: bool = False) -> None:
    if later:
        state.busy += 1
    else:
        state.refused += 1
    body = job.envelope.body
    assert isinstance(body, AdmitMemory)
    _finish(state, job, Refuse(request_id=body.request_id, detail=detail, may_fit_later=later),
            out)


def _may_fit_later(state: MemoryState, job: Job) -> bool:
    """Whether ``job``'s demand fits beside the least memory seen (see ``Refuse.may_fit_later``)."""
    budget, floor = state.config.budget, state.floor
    return budget is not None and floor is not None and floor + job.demand <= budget


def _admit(state: MemoryState, job: Job, out: list[Effect]) -> None:
    state.admitted += 1
    body = job.envelope.body
    assert isinstance(body, AdmitMemory)
    _finish(state, job, MemoryAdmitted(request_id=body.request_id, relieved_bytes=job.relieved), out)


# --- the admission job -------------------------------------------------------------------


def _measure(state: MemoryState, job: Job, gauges: Gauges, now: float, out: list[Effect]) -> None:
    if state.config.prompt_cache:
        _ask(state, job, "measure", "prompt_cache", PromptCacheStatsRequest(), now, out)
    else:
        _decide(state, job, 0, gauges, now, out)


def _decide(
    state: MemoryState, job: Job, reclaimable: int, gauges: Gauges, now: float, out: list[Effect]
) -> None:
    cfg = state.config
    assert cfg.budget is not None
    verdict = decide(active=gauges.in_use, demand=job.demand, budget=cfg.budget,
                     reclaimable=reclaimable)
    if isinstance(verdict, Fits):
        _admit(state, job, out)
    elif not isinstance(verdict, Relieve):
        _refuse(state, job, verdict.message(), out, later=_may_fit_later(state, job))
    elif job.rounds >= cfg.rounds:
        _refuse(state, job, AFTER_RELIEF_MESSAGE, out, later=_may_fit_later(state, job))
    else:
        job.rounds += 1
        job.need = verdict.need
        state.reliefs += 1
        ask = Demote(max_bytes=verdict.need, dispose_without_tier=True)
        _ask(state, job, "demote", "prompt_cache", ask, now, out)


def _after_drain(state: MemoryState, job: Job, gauges: Gauges, now: float, out: list[Effect]) -> None:
    if not job.admission:
        _answer_relieved(job, state, None, out)
        return
    step = state.config.release_step
    if job.handed and step is not None:
        _turn(state, job, "release", step, now, out)
    else:
        _next_round(state, job, gauges, now, out)


def _next_round(state: MemoryState, job: Job, gauges: Gauges, now: float, out: list[Effect]) -> None:
    if job.handed == 0:
        # NOTE: nothing handed back means nothing left to reclaim (every
        # entry is leased or gone): the decision refuses if still over.
        _decide(state, job, 0, gauges, now, out)
    else:
        _measure(state, job, gauges, now, out)


def _demoted(state: MemoryState, job: Job, body: Body | None, gauges: Gauges, now: float,
             out: list[Effect]) -> None:
    result = body if isinstance(body, DemoteResult) else None
    job.result = result
    job.handed = 0 if result is None else result.spilled_bytes + result.disposed_bytes
    if result is None:
        out.append(Log("memory.relief_incomplete", "warning", (("step", "demote"),)))
        if not job.admission:
            _answer_relieved(job, state, "the RAM tier did not answer the demotion", out)
            return
    elif job.admission:
        moved = result.spilled + result.disposed
        job.relieved += job.handed
        state.relieved_entries += moved
        state.relieved_bytes += job.handed
        out.append(Log("memory.relieved", "info", (
            ("need", job.need), ("handed_bytes", job.handed),
            ("spilled", result.spilled), ("disposed", result.disposed),
            ("reading", gauges.active))))
    waits = not job.admission and job.before is not None
    if state.config.spill_queue and result is not None and (job.admission or waits):
        _ask(state, job, "drain", "spill_queue", DrainSpills(), now, out)
    elif job.admission:
        _after_drain(state, job, gauges, now, out)
    else:
        _answer_relieved(job, state, None, out)


def _answer_relieved(job: Job, state: MemoryState, error: str | None, out: list[Effect]) -> None:
    _finish(state, job, Relieved(result=job.result, error=error or ""), out)


def _drained(state: MemoryState, job: Job, body: Body | None, gauges: Gauges, now: float,
             out: list[Effect]) -> None:
    if job.admission:
        _after_drain(state, job, gauges, now, out)
        return
    before = job.before
    if before is None or not isinstance(body, SpillsDrained):
        _answer_relieved(job, state, None, out)
        return
    _finish(state, job, Relieved(
        result=job.result,
        stored=body.stored - before.stored,
        dropped=body.dropped - before.dropped,
        failed=body.failed - before.failed,
    ), out)


# --- dispatch ------------------------------------------------------------------------------


def _begin(state: MemoryState, job: Job, gauges: Gauges, now: float, out: list[Effect]) -> None:
    state.job = job
    body = job.envelope.body
    if isinstance(body, AdmitMemory):
        step = state.config.settle_step
        if step is not None:
            _turn(state, job, "settle", step, now, out)
        else:
            _measure(state, job, gauges, now, out)
        return
    assert isinstance(body, RelieveMessage)
    if body.wait and state.config.spill_queue:
        _ask(state, job, "before", "spill_queue", SpillQueueStatsRequest(), now, out)
    else:
        _demote_now(state, job, body, now, out)


def _demote_now(state: MemoryState, job: Job, body: RelieveMessage, now: float,
                out: list[Effect]) -> None:
    ask = Demote(idle_s=body.idle_s, max_bytes=body.max_bytes,
                 dispose_without_tier=body.dispose_without_tier)
    _ask(state, job, "demote", "prompt_cache", ask, now, out)


def _advance(state: MemoryState, job: Job, body: Body | None, gauges: Gauges, now: float,
             out: list[Effect]) -> None:
    """The answer to the job's ask (``None``: it failed or timed out) moves the job on."""
    job.ref = None
    phase = job.phase
    if phase == "settle":
        if body is None:
            out.append(Log("memory.settle_incomplete", "warning"))
        _measure(state, job, gauges, now, out)
    elif phase == "measure":
        reclaimable = body.bytes if isinstance(body, PromptCacheStats) else 0
        _decide(state, job, reclaimable, gauges, now, out)
    elif phase == "demote":
        _demoted(state, job, body, gauges, now, out)
    elif phase == "drain":
        _drained(state, job, body, gauges, now, out)
    elif phase == "release":
        if body is None:
            out.append(Log("memory.relief_incomplete", "warning", (("step", "release"),)))
        _next_round(state, job, gauges, now, out)
    elif phase == "before":
        relieve = job.envelope.body
        assert isinstance(relieve, RelieveMessage)
        job.before = body if isinstance(body, SpillQueueStats) else None
        _demote_now(state, job, relieve, now, out)
    else:
        raise AssertionError(f"a job in phase {phase!r} has no ask out")


_REPLIES = (PromptCacheStats, DemoteResult, SpillsDrained, SpillQueueStats, TurnDone, Failure)
"""The answers to the asks the rules send (a ``Failure`` when the target's handler raised)."""


def _reply_body(body: Body) -> Body | None:
    """A reply's body; ``None`` for a refusal or failure (a ``TurnDone`` that did not run, a ``Failure``)."""
    if isinstance(body, Failure) or (isinstance(body, TurnDone) and not body.ok):
        return None
    return body


def _stats(state: MemoryState, g: Gauges) -> MemoryStats:
    cfg = state.config
    parts = g.mlx_parts
    return MemoryStats(
        budget_bytes=cfg.budget,
        active_bytes=g.active,
        samples=g.samples,
        checks_in_turn=g.checks,
        refused_in_turn=g.refused,
        refused_before_prefill=g.refused_before_prefill,
        refused_at_admission=state.refused,
        busy_at_admission=state.busy,
        relieved_entries=state.relieved_entries,
        relieved_bytes=state.relieved_bytes,
        reliefs=state.reliefs,
        readmissions=state.readmissions,
        settled_in_turn=g.settled,
        margin_bytes=cfg.margin if cfg.budget is not None else None,
        resident_bytes=g.resident,
        mlx_bytes=g.mlx,
        resident_at_start_bytes=g.resident_at_start,
        heap_trims=g.heap_trims,
        heap_trim_s=None if g.heap_trim_s is None else round(g.heap_trim_s, 4),
        mlx_active_bytes=None if parts is None else parts[0],
        mlx_cache_bytes=None if parts is None else parts[1],
        mlx_peak_bytes=None if parts is None else parts[2],
        device_used_bytes=g.device_used,
        growth_ahead_bytes=None if cfg.budget is None else sum(n for _, n in g.ahead),
        growth_ahead_by_lane=None if cfg.budget is None else dict(g.ahead),
    )


def _received(state: MemoryState, event: Received, out: list[Effect]) -> None:
    envelope, now, gauges = event.envelope, event.now, event.gauges
    body = envelope.body
    cfg = state.config
    if isinstance(body, AdmitMemory):
        if cfg.budget is None or cfg.footprint is None:
            state.admitted += 1
            out.append(Answer(envelope, MemoryAdmitted(request_id=body.request_id)))
            return
        job = Job(envelope, demand=_demand(cfg.footprint, body))
        if state.stopped:
            _refuse(state, job, "the server is shutting down", out)
            return
        if body.refused_in_turn:
            # NOTE: the reading it would fit at once is the one the in-turn
            # check contradicted: settle, measure and relieve first.
            state.readmissions += 1
        elif fits_now(cfg, gauges, body):
            _admit(state, job, out)
            return
        state.queue.append(job)
    elif isinstance(body, RelieveMessage):
        job = Job(envelope)
        if state.stopped or not cfg.prompt_cache:
            error = "the memory actor is stopping" if state.stopped else "no RAM tier"
            _answer_relieved(job, state, error, out)
            return
        state.queue.append(job)
    elif isinstance(body, MemoryStatsRequest):
        out.append(Answer(envelope, _stats(state, gauges)))
    elif isinstance(body, MemoryWake):
        pass  # NOTE: the alarm only brings time forward; expiry below acts.
    elif isinstance(body, _REPLIES):
        running = state.job
        if running is not None and running.ref is not None \
                and envelope.correlation_id == running.ref:
            _advance(state, running, _reply_body(body), gauges, now, out)
        # NOTE: otherwise a late answer to an ask given up (its deadline passed).
    else:
        raise UnknownMemoryMessage(f"the memory actor has no rule for {body.kind!r}")


def _stop(state: MemoryState, out: list[Effect]) -> None:
    state.stopped = True
    jobs = [*([state.job] if state.job is not None else []), *state.queue]
    state.job, state.queue = None, deque()
    for job in jobs:
        if job.admission:
            _refuse(state, job, "the server is shutting down", out)
        else:
            _answer_relieved(job, state, "the memory actor is stopping", out)


def next_wake(state: MemoryState) -> float | None:
    """When the core next needs a ``MemoryWake``: the running job's reply deadline."""
    job = state.job
    return job.deadline if job is not None and job.ref is not None else None


def handle(state: MemoryState, event: Event) -> tuple[MemoryState, list[Effect]]:
    """Apply one input; return the state and the effects, in order."""
    out: list[Effect] = []
    now, gauges = event.now, event.gauges
    # NOTE: the reading at the engine's start (after loading, settled) seeds
    # the floor: the actor may first hear of memory while requests run.
    for seen in (gauges.active, gauges.resident_at_start):
        if seen is not None:
            state.floor = seen if state.floor is None else min(state.floor, seen)
    match event:
        case Received():
            _received(state, event, out)
        case Undelivered(ref=ref):
            job = state.job
            if job is not None and job.ref == ref:
                _advance(state, job, None, gauges, now, out)
        case Stopping():
            _stop(state, out)
    job = state.job
    if job is not None and job.ref is not None and job.deadline <= now:
        state.timeouts += 1
        out.append(Log("memory.reply_timeout", "warning", (("phase", job.phase),)))
        _advance(state, job, None, gauges, now, out)
    while state.job is None and state.queue and not state.stopped:
        _begin(state, state.queue.popleft(), gauges, now, out)
    at = next_wake(state)
    if at != state.alarm_at:
        state.alarm_at = at
        out.append(SetAlarm(at))
    return state, out
