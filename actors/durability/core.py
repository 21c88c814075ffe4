"""The durability coordinator's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

Pure Python over token tuples and reply bodies: no arrays, no I/O, no clock
reads (every event carries ``now``, read by the shell from the injected
clock), no timers (the core
asks for ONE alarm with :class:`SetAlarm`). The shell
(``actors/durability/actor.py``) performs the effects and reports what it
could not do (:class:`Undelivered`). The protocol is ``docs/durability.md``.

A *record* is one dirty prefix, keyed by (namespace, exact tokens); every
``Schedule`` of the key makes a new *version* (a new RAM handle). An
*attempt* persists one version of one record:

1. ``Covers`` (SSD index): already on disk -> clean, nothing written;
2. one background engine turn clones the RAM handle (``RunWhenIdle``; a
   write-behind attempt waits ``turn_wait_s`` for it, then is re-armed
   ``busy_rearm_s`` later: background work never holds a request back);
   the handle is gone -> ``Covers`` again: covered -> clean, else *missing*;
3. the clone goes to the spill queue (``Enqueue``, which owns it from
   then on); its ``SpillSettled`` says ``stored`` -> clean, anything else
   leaves the record dirty and retryable (with a growing back-off).

Every request carries a fresh *ref* as its correlation id; replies are
matched by it, so a late reply to a request given up (its deadline passed)
is recognised and ignored.

``FlushAll`` is the whole flush sequence of ``Engine.flush``: a barrier
(``PromptCacheStatsRequest`` to the prompt cache: once it answers, every
``Schedule`` of a ``Put`` it had received is queued here), then a flush
like ``Flush``, then ``DrainSpills`` (what entered the queue meanwhile);
a barrier or final drain that fails or times out is skipped.

Invariants kept here (``tests/actors/durability`` checks them, the
simulated-runtime proof over 1,000 seeded runs with faults):

- a record leaves the dirty set only on evidence that its version is on
  disk: a ``stored`` settle of that version, or a ``Covers`` answer asked
  after that version was scheduled (a newer version is never cleaned by an
  older one's evidence);
- at most one attempt per record at a time; at most ``max_attempts`` at
  once, and exactly one while a flush forces;
- a flush writes (enqueues) each record version at most once;
- ``FlushResult.durable`` only when every prefix in the flush's scope was
  found on disk by a ``Covers`` asked after every write of the flush had
  settled, or was *evicted unwritten* (its RAM entry gone before any write
  and, after the spill queue drained, no file covering it), and nothing of
  the flush was dropped, failed or given up while RAM held it;
- a prefix evicted unwritten is counted once (``evicted_unwritten``, in
  the flush answer and the lifetime statistics) and then forgotten: it no
  longer blocks ``durable``, which means "every prefix the tiers hold, and
  every put since the last durable flush that is still cached, is on
  disk";
- every clone handle the core is told about is either enqueued (the
  queue owns it) or disposed, exactly once.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, assert_never

from messages import (
    Body,
    Covers,
    CoversResult,
    DrainSpills,
    Enqueue,
    EntryMeta,
    Envelope,
    Failure,
    Request,
    SpillsDrained,
    SpillSettled,
    SsdStats,
    SsdStatsRequest,
)
from messages.durability import (
    DurabilityStats,
    DurabilityStatsRequest,
    Flush,
    FlushAll,
    FlushResult,
    Schedule,
    Wake,
)
from messages.gateway import TurnDone
from messages.prompt_cache import PromptCacheStats, PromptCacheStatsRequest

__all__ = [
    "Answer",
    "Attempt",
    "CloneFailed",
    "CloneOutcome",
    "Cloned",
    "DisposeClone",
    "DropStep",
    "DurabilityConfig",
    "DurabilityState",
    "Effect",
    "Event",
    "FlushRun",
    "Key",
    "Log",
    "Received",
    "Record",
    "RunClone",
    "Send",
    "SetAlarm",
    "Stopping",
    "Target",
    "Undelivered",
    "UnknownDurabilityMessage",
    "Vanished",
    "handle",
    "next_wake",
    "stats",
]

Key = tuple[str, tuple[int, ...]]
"""A record's identity: (namespace, exact token sequence)."""

Target = Literal["ssd_writer", "spill_queue", "prompt_cache"]
"""Whom a :class:`Send` goes to (the shell maps these to addresses)."""


class UnknownDurabilityMessage(TypeError):
    """A body the durability coordinator has no rule for."""


@dataclass(frozen=True, slots=True)
class DurabilityConfig:
    """Timing and bounds of the coordinator.

    ``debounce_s``: a put waits this long before write-behind snapshots it
    (a conversation's next put usually follows within it). ``busy_rearm_s``:
    when no engine turn came within ``turn_wait_s``, the attempt is put
    back this long. NOTE: ``turn_wait_s`` outlasts one request turn (a
    burst of decode steps): under load the gateway grants background work
    its share of engine time at a turn boundary (``actors.gateway.core``),
    and a shorter wait would expire before that boundary every time. A failed or dropped write is retried after
    ``busy_rearm_s * 2**(failures - 1)`` seconds, at most ``max_backoff_s``.
    ``retry_s``: a request a full mailbox refused is sent again after this.
    ``reply_timeout_s``: a request whose reply has not come by then is given
    up (a reply that never comes must not wedge a flush). ``max_attempts``:
    write-behind attempts at once (a flush forces one at a time).
    ``max_records``: dirty records kept; past it the oldest is given up and
    counted as ``lost`` (the next flush then says not durable).
    ``write_behind``: ``False`` leaves records dirty until a flush.
    """

    debounce_s: float = 1.0
    busy_rearm_s: float = 5.0
    turn_wait_s: float = 5.0
    retry_s: float = 0.1
    max_backoff_s: float = 300.0
    reply_timeout_s: float = 300.0
    max_attempts: int = 2
    max_records: int = 4096
    write_behind: bool = True

    def __post_init__(self) -> None:
        for name in ("debounce_s", "busy_rearm_s", "max_backoff_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("turn_wait_s", "retry_s", "reply_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.max_records < 1:
            raise ValueError("max_records must be >= 1")


# --- events (shell -> core) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cloned:
    """The engine turn cloned the RAM entry: ``handle`` is the clone (the core now owns it)."""

    handle: str
    meta: EntryMeta


@dataclass(frozen=True, slots=True)
class Vanished:
    """The engine turn found the RAM handle gone (evicted, replaced or superseded)."""


@dataclass(frozen=True, slots=True)
class CloneFailed:
    """The clone raised (``error`` names it); nothing was registered."""

    error: str


CloneOutcome = Cloned | Vanished | CloneFailed


@dataclass(frozen=True, slots=True)
class Received:
    """A message arrived at clock time ``now``. For a ``TurnDone``, ``clone`` is what the step produced, if it ran."""

    envelope: Envelope
    now: float
    clone: CloneOutcome | None = None


@dataclass(frozen=True, slots=True)
class Undelivered:
    """The shell could not send request ``ref`` at ``now``: the mailbox was ``full``, or the actor is ``gone``."""

    ref: str
    reason: Literal["full", "gone"]
    now: float


@dataclass(frozen=True, slots=True)
class Stopping:
    """The coordinator stops at clock time ``now``."""

    now: float


Event = Received | Undelivered | Stopping


# --- effects (core -> shell) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``body`` to ``to`` without waiting, replies to this actor, correlation id ``ref``."""

    ref: str
    to: Target
    body: Request


@dataclass(frozen=True, slots=True)
class RunClone:
    """Register a step cloning ``handle`` as ``step_id`` and ask the gateway for a turn.

    ``RunWhenIdle(step_id, deadline)`` goes to the gateway with correlation
    ``ref``; its ``TurnDone`` comes back with the step's :class:`CloneOutcome`.
    """

    ref: str
    step_id: str
    handle: str
    deadline: float | None


@dataclass(frozen=True, slots=True)
class DropStep:
    """Step ``step_id`` is no longer wanted: never run it; dispose its clone if it ran."""

    step_id: str


@dataclass(frozen=True, slots=True)
class DisposeClone:
    """Dispose clone ``handle`` (it never reached the spill queue)."""

    handle: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply ``body`` to ``request``."""

    request: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class SetAlarm:
    """Wake the coordinator (a ``Wake`` message) at clock time ``at``; ``None``: no alarm."""

    at: float | None


@dataclass(frozen=True, slots=True)
class Log:
    """A warning worth an operator's attention."""

    event: str
    fields: tuple[tuple[str, str | int | float], ...] = ()


Effect = Send | RunClone | DropStep | DisposeClone | Answer | SetAlarm | Log


# --- state --------------------------------------------------------------------

Stage = Literal["covers", "turn", "recheck", "parked", "queued"]
Outcome = Literal["covered", "stored", "missing", "busy", "retry", "error", "dropped", "failed"]
Purpose = Literal["attempt", "drain", "verify", "stats", "barrier", "final_drain"]
Phase = Literal["settling", "draining", "forcing", "verifying", "stats"]


@dataclass
class Record:
    """One dirty prefix: its latest version and RAM handle, and when write-behind tries next.

    ``due``: the next write-behind attempt (``None``: none armed: missing, an
    attempt runs, or write-behind is off). ``missing``: the latest version's
    RAM handle is gone and no file covered it when last checked.
    """

    namespace: str
    tokens: tuple[int, ...]
    version: int
    handle: str
    scheduled_at: float
    due: float | None = None
    missing: bool = False
    attempt: int | None = None
    failures: int = 0

    @property
    def key(self) -> Key:
        """(namespace, tokens)."""
        return (self.namespace, self.tokens)


@dataclass
class Attempt:
    """One version of one record on its way to disk."""

    id: int
    key: Key
    version: int
    handle: str
    forced: bool
    stage: Stage = "covers"
    ref: str = ""
    step_id: str | None = None
    clone: str | None = None
    clone_meta: EntryMeta | None = None
    flush_id: int | None = None
    """The flush during which this attempt enqueued its clone (its write counts there)."""


@dataclass
class _Outstanding:
    purpose: Purpose
    deadline: float
    attempt: int | None = None
    key: Key | None = None
    version: int | None = None
    """For a flush's ``Covers``: the record's version when it was asked."""


@dataclass
class FlushRun:
    """A flush in progress. ``scope``: the keys dirty when it began, in put order."""

    id: int
    waiters: list[Envelope]
    started_at: float
    scope: tuple[Key, ...]
    phase: Phase = "settling"
    todo: deque[Key] = field(default_factory=deque)
    held: list[tuple[float, Key]] = field(default_factory=list)
    """Forced attempts a full mailbox refused, with when to try them again."""
    resume_at: float | None = None
    """A flush-level request (drain, verify, stats) a full mailbox refused: send it again then."""
    tried: set[tuple[Key, int]] = field(default_factory=set)
    written: int = 0
    dropped: int = 0
    failed: int = 0
    covered: int = 0
    pending: int = 0
    uncovered: int = 0
    evicted_unwritten: int = 0
    verify_cursor: int = 0
    checkpoints_lost: int = 0
    entries: int | None = None
    longest: int | None = None
    ssd_bytes: int | None = None
    """The SSD tier's committed bytes at the flush's end (its stats answer; ``None``: none came)."""
    ssd_max_bytes: int | None = None

    def in_scope(self, key: Key) -> bool:
        """Whether ``key`` was dirty when the flush began."""
        return key in self._scope_set

    def __post_init__(self) -> None:
        self._scope_set = frozenset(self.scope)
        self.todo.extend(self.scope)


@dataclass
class DurabilityState:
    """Everything the rules know (mutated in place and returned by :func:`handle`)."""

    config: DurabilityConfig = field(default_factory=DurabilityConfig)
    records: dict[Key, Record] = field(default_factory=dict)
    attempts: dict[int, Attempt] = field(default_factory=dict)
    checkpoints_lost_seen: int = 0
    outstanding: dict[str, _Outstanding] = field(default_factory=dict)
    due_heap: list[tuple[float, int, Key]] = field(default_factory=list)
    parked: deque[int] = field(default_factory=deque)
    """Attempts holding a clone until our clone in the spill queue settles."""
    flush: FlushRun | None = None
    flush_queue: list[Envelope] = field(default_factory=list)
    barriers: dict[str, Envelope] = field(default_factory=dict)
    """``FlushAll`` askers waiting for their barrier (the prompt cache's answer), by ref."""
    final_drains: dict[str, tuple[list[Envelope], FlushResult]] = field(default_factory=dict)
    """``FlushAll`` askers whose flush ended, waiting for the spill queue's drain, by ref."""
    alarm_at: float | None = None
    stopped: bool = False
    seq: int = 0
    last_flush: FlushResult | None = None
    lost_since_flush: int = 0
    evicted_since_flush: int = 0
    """Records given up as evicted unwritten outside a flush's verification (the record cap)."""
    # lifetime counters
    scheduled: int = 0
    attempts_started: int = 0
    written: int = 0
    stored: int = 0
    already_covered: int = 0
    vanished: int = 0
    busy_rearms: int = 0
    dropped: int = 0
    failed: int = 0
    timeouts: int = 0
    lost: int = 0
    evicted_unwritten: int = 0
    flushes: int = 0

    def next_id(self) -> int:
        """A fresh number (versions, attempts, refs, flushes share one sequence)."""
        self.seq += 1
        return self.seq


# --- helpers ----------------------------------------------------------------------


def _arm(state: DurabilityState, rec: Record, at: float) -> None:
    rec.due = at
    heapq.heappush(state.due_heap, (at, rec.version, rec.key))


def _backoff(state: DurabilityState, rec: Record) -> float:
    cfg = state.config
    return float(min(cfg.busy_rearm_s * 2 ** max(rec.failures - 1, 0), cfg.max_backoff_s))


def _request(
    state: DurabilityState,
    to: Target,
    body: Request,
    purpose: Purpose,
    now: float,
    out: list[Effect],
    *,
    attempt: Attempt | None = None,
    key: Key | None = None,
    version: int | None = None,
) -> str:
    ref = f"dur-{state.next_id()}"
    state.outstanding[ref] = _Outstanding(
        purpose, now + state.config.reply_timeout_s, attempt.id if attempt else None, key, version
    )
    if attempt is not None:
        attempt.ref = ref
    out.append(Send(ref, to, body))
    return ref


def _give_up_oldest(state: DurabilityState, out: list[Effect]) -> None:
    """Make room for one record: forget the oldest missing one, else the oldest idle one."""
    victim: Record | None = None
    for rec in state.records.values():
        if rec.attempt is None and rec.missing:
            victim = rec
            break
    if victim is None:
        victim = next((r for r in state.records.values() if r.attempt is None), None)
    if victim is None:
        return  # NOTE: every record has an attempt (max_attempts >= max_records); keep them all.
    del state.records[victim.key]
    if victim.missing:
        # NOTE: RAM no longer holds it and no file did when last checked: it
        # is evicted unwritten, not a prefix the tiers hold and failed to write.
        state.evicted_unwritten += 1
        state.evicted_since_flush += 1
        return
    state.lost += 1
    state.lost_since_flush += 1
    out.append(
        Log(
            "durability.record_lost",
            (("namespace", victim.namespace), ("tokens", len(victim.tokens))),
        )
    )


# --- schedule -----------------------------------------------------------------------


def _schedule(state: DurabilityState, msg: Schedule, now: float, out: list[Effect]) -> None:
    state.scheduled += 1
    key: Key = (msg.namespace, msg.tokens)
    version = state.next_id()
    rec = state.records.get(key)
    if rec is None:
        if len(state.records) >= state.config.max_records:
            _give_up_oldest(state, out)
        rec = Record(msg.namespace, msg.tokens, version, msg.handle, now)
        state.records[key] = rec
    else:
        # NOTE: a new version. An attempt still running for the old one goes
        # on; its evidence cleans only the old version, so this one gets its
        # own attempt (equal tokens hold equal KV, so that attempt usually
        # just finds the prefix covered and writes nothing).
        rec.version, rec.handle, rec.scheduled_at = version, msg.handle, now
        rec.missing, rec.failures, rec.due = False, 0, None
    if state.config.write_behind and rec.attempt is None:
        _arm(state, rec, now + state.config.debounce_s)
    flush = state.flush
    if (
        flush is not None
        and flush.phase in ("settling", "draining", "forcing")
        and (flush.in_scope(key))
    ):
        flush.todo.append(key)


# --- attempts -----------------------------------------------------------------------


def _start_attempt(
    state: DurabilityState, rec: Record, *, forced: bool, now: float, out: list[Effect]
) -> None:
    attempt = Attempt(state.next_id(), rec.key, rec.version, rec.handle, forced)
    state.attempts[attempt.id] = attempt
    state.attempts_started += 1
    rec.attempt, rec.due = attempt.id, None
    _request(
        state,
        "ssd_writer",
        Covers(tokens=rec.tokens, namespace=rec.namespace),
        "attempt",
        now,
        out,
        attempt=attempt,
    )


def _ask_turn(state: DurabilityState, attempt: Attempt, now: float, out: list[Effect]) -> None:
    cfg = state.config
    ref = f"dur-{state.next_id()}"
    # NOTE: write-behind waits turn_wait_s for an idle turn (the gateway drops
    # the ask after that, never granting it late); a flush waits for one.
    deadline = None if attempt.forced else now + cfg.turn_wait_s
    limit = now + cfg.reply_timeout_s + (0.0 if deadline is None else cfg.turn_wait_s)
    state.outstanding[ref] = _Outstanding("attempt", limit, attempt.id)
    attempt.stage, attempt.ref, attempt.step_id = "turn", ref, ref
    out.append(RunClone(ref, ref, attempt.handle, deadline))


def _enqueue(
    state: DurabilityState, attempt: Attempt, clone: Cloned, now: float, out: list[Effect]
) -> None:
    attempt.clone, attempt.clone_meta = clone.handle, clone.meta
    if any(a.stage == "queued" for a in state.attempts.values()):
        # NOTE: one of our clones in the spill queue at a time: under the
        # queue's cap (oldest not in flight dropped first) two of our own
        # snapshots could otherwise push each other out.
        attempt.stage = "parked"
        state.parked.append(attempt.id)
        return
    _send_clone(state, attempt, now, out)


def _unpark(state: DurabilityState, now: float, out: list[Effect]) -> None:
    while state.parked:
        attempt = state.attempts.get(state.parked.popleft())
        if attempt is not None and attempt.stage == "parked":
            _send_clone(state, attempt, now, out)
            return


def _send_clone(state: DurabilityState, attempt: Attempt, now: float, out: list[Effect]) -> None:
    namespace, tokens = attempt.key
    assert attempt.clone is not None
    assert attempt.clone_meta is not None
    attempt.stage = "queued"
    state.written += 1
    flush = state.flush
    if flush is not None:
        attempt.flush_id = flush.id
        flush.written += 1
        flush.tried.add((attempt.key, attempt.version))
    body = Enqueue(
        handle=attempt.clone,
        namespace=namespace,
        tokens=tokens,
        meta=attempt.clone_meta,
        source="snapshot",
    )
    _request(state, "spill_queue", body, "attempt", now, out, attempt=attempt)


def _unwrite(state: DurabilityState, attempt: Attempt) -> None:
    """The enqueue never reached the queue: it was not a write."""
    state.written -= 1
    flush = state.flush
    if flush is not None and attempt.flush_id == flush.id:
        flush.written -= 1
        flush.tried.discard((attempt.key, attempt.version))
    attempt.flush_id = None


def _finish(
    state: DurabilityState,
    attempt: Attempt,
    outcome: Outcome,
    now: float,
    out: list[Effect],
    *,
    reason: str = "",
) -> None:
    """Settle ``attempt``: clean its record, or leave it dirty with its next try armed."""
    del state.attempts[attempt.id]
    if attempt.stage == "queued":
        _unpark(state, now, out)
    cfg = state.config
    flush = state.flush
    counted = flush is not None and attempt.flush_id == flush.id
    if outcome == "covered":
        state.already_covered += 1
    elif outcome == "stored":
        state.stored += 1
    elif outcome == "busy":
        state.busy_rearms += 1
    elif outcome == "dropped":
        state.dropped += 1
        if counted and flush is not None:
            flush.dropped += 1
    elif outcome == "failed":
        state.failed += 1
        if counted and flush is not None:
            flush.failed += 1
        out.append(
            Log(
                "durability.write_failed",
                (
                    ("namespace", attempt.key[0]),
                    ("tokens", len(attempt.key[1])),
                    ("reason", reason),
                ),
            )
        )
    rec = state.records.get(attempt.key)
    if rec is None or rec.attempt != attempt.id:
        return
    rec.attempt = None
    if rec.version != attempt.version:
        # NOTE: a newer version arrived meanwhile: it keeps its own timer (or
        # gets one now); this attempt's evidence says nothing about it.
        if cfg.write_behind:
            _arm(state, rec, max(now, rec.scheduled_at + cfg.debounce_s))
        return
    if outcome in ("covered", "stored"):
        del state.records[attempt.key]
        return
    if outcome == "missing":
        rec.missing = True
        return
    if outcome in ("dropped", "failed", "error"):
        rec.failures += 1
    if attempt.forced and outcome == "retry" and flush is not None:
        flush.tried.discard((attempt.key, attempt.version))
        flush.held.append((now + cfg.retry_s, attempt.key))
    if not cfg.write_behind:
        return
    if outcome == "busy":
        _arm(state, rec, now + cfg.busy_rearm_s)
    elif outcome == "retry":
        _arm(state, rec, now + cfg.retry_s)
    else:
        _arm(state, rec, now + _backoff(state, rec))


def _attempt_reply(
    state: DurabilityState,
    attempt: Attempt,
    body: Body,
    clone: CloneOutcome | None,
    now: float,
    out: list[Effect],
) -> None:
    stage = attempt.stage
    rec = state.records.get(attempt.key)
    if stage in ("covers", "recheck"):
        if isinstance(body, CoversResult) and body.covered:
            _finish(state, attempt, "covered", now, out)
        elif stage == "recheck":
            # NOTE: RAM lost it and no file holds it (or the index could not say).
            _finish(state, attempt, "missing", now, out)
        elif not isinstance(body, CoversResult):
            _finish(state, attempt, "error", now, out)
        elif rec is not None and rec.missing and rec.version == attempt.version:
            _finish(state, attempt, "missing", now, out)
        else:
            _ask_turn(state, attempt, now, out)
        return
    if stage == "turn":
        if isinstance(clone, Cloned):
            _enqueue(state, attempt, clone, now, out)
        elif isinstance(clone, Vanished):
            state.vanished += 1
            attempt.stage = "recheck"
            namespace, tokens = attempt.key
            body_ = Covers(tokens=tokens, namespace=namespace)
            _request(state, "ssd_writer", body_, "attempt", now, out, attempt=attempt)
        elif isinstance(clone, CloneFailed):
            _finish(state, attempt, "error", now, out, reason=clone.error)
        else:
            if attempt.step_id is not None:
                out.append(DropStep(attempt.step_id))
            expired = isinstance(body, TurnDone) and body.error_code == "expired"
            _finish(state, attempt, "busy" if expired else "error", now, out)
        return
    # stage == "queued"
    if isinstance(body, SpillSettled):
        if body.outcome == "stored":
            _finish(state, attempt, "stored", now, out)
        elif body.outcome in ("dropped", "refused"):
            _finish(state, attempt, "dropped", now, out, reason=body.reason)
        else:
            _finish(state, attempt, "failed", now, out, reason=body.reason)
    else:
        # NOTE: the queue's handler raised on our Enqueue: whether it took the
        # clone is unknown, so it is not disposed here (a double disposal
        # could free arrays a store still reads; the queue releases what it holds).
        _finish(state, attempt, "failed", now, out, reason="queue_failed")


# --- replies ------------------------------------------------------------------------


def _reply(
    state: DurabilityState,
    ref: str,
    body: Body,
    clone: CloneOutcome | None,
    now: float,
    out: list[Effect],
) -> None:
    pending = state.outstanding.pop(ref, None)
    if pending is None:
        # NOTE: a late reply to a request given up. A clone made for it is ours to dispose.
        if isinstance(clone, Cloned):
            out.append(DisposeClone(clone.handle))
        return
    if pending.purpose == "attempt":
        attempt = state.attempts.get(pending.attempt or -1)
        if attempt is None:
            if isinstance(clone, Cloned):
                out.append(DisposeClone(clone.handle))
            return
        _attempt_reply(state, attempt, body, clone, now, out)
        return
    if isinstance(clone, Cloned):
        out.append(DisposeClone(clone.handle))
    if _sequence_step(state, ref, pending, out):
        return
    flush = state.flush
    if flush is None:
        return
    if pending.purpose == "drain":
        flush.phase = "forcing"
        if isinstance(body, SpillsDrained):
            # NOTE: the queue's lifetime count; the flush reports what is new.
            flush.checkpoints_lost = max(0, body.checkpoints_lost - state.checkpoints_lost_seen)
            state.checkpoints_lost_seen = body.checkpoints_lost
    elif pending.purpose == "verify":
        covered = isinstance(body, CoversResult) and body.covered
        _verified(state, flush, pending, covered)
    elif pending.purpose == "stats":
        if isinstance(body, SsdStats):
            flush.entries, flush.longest = body.entries, body.longest_entry_tokens
            flush.ssd_bytes, flush.ssd_max_bytes = body.bytes, body.max_bytes
        _finish_flush(state, flush, now, out)


def _sequence_step(
    state: DurabilityState, ref: str, pending: _Outstanding, out: list[Effect]
) -> bool:
    """A ``FlushAll``'s barrier or final drain ended (answered, failed or timed out): move it on.

    NOTE: a failed barrier or drain is skipped, never fatal: the flush's own
    result says what is durable.
    """
    if pending.purpose == "barrier":
        asker = state.barriers.pop(ref, None)
        if asker is not None:
            state.flush_queue.append(asker)
        return True
    if pending.purpose == "final_drain":
        waiters, result = state.final_drains.pop(ref, ([], None))
        if result is not None:
            out.extend(Answer(w, result) for w in waiters)
        return True
    return False


def _undelivered(state: DurabilityState, ev: Undelivered, now: float, out: list[Effect]) -> None:
    pending = state.outstanding.pop(ev.ref, None)
    if pending is None:
        return
    if _sequence_step(state, ev.ref, pending, out):
        return
    flush = state.flush
    if pending.purpose == "attempt":
        attempt = state.attempts.get(pending.attempt or -1)
        if attempt is None:
            return
        if attempt.stage == "queued":
            assert attempt.clone is not None
            out.append(DisposeClone(attempt.clone))
            _unwrite(state, attempt)
        elif attempt.stage == "turn" and attempt.step_id is not None:
            out.append(DropStep(attempt.step_id))
        _finish(state, attempt, "retry" if ev.reason == "full" else "error", now, out)
        return
    if flush is None:
        return
    if ev.reason == "full":
        # NOTE: ask again shortly (the alarm brings the flush back here).
        flush.resume_at = now + state.config.retry_s
        if pending.purpose == "verify":
            flush.verify_cursor -= 1
        elif pending.purpose == "drain":
            flush.phase = "settling"
        elif pending.purpose == "stats":
            flush.phase = "verifying"
        return
    if pending.purpose == "drain":
        flush.phase = "forcing"
    elif pending.purpose == "verify":
        _verified(state, flush, pending, False)
    elif pending.purpose == "stats":
        _finish_flush(state, flush, now, out)


def _expire(state: DurabilityState, now: float, out: list[Effect]) -> None:
    late = [ref for ref, p in state.outstanding.items() if p.deadline <= now]
    for ref in late:
        pending = state.outstanding.pop(ref)
        state.timeouts += 1
        out.append(Log("durability.reply_timeout", (("purpose", pending.purpose),)))
        flush = state.flush
        if _sequence_step(state, ref, pending, out):
            continue
        if pending.purpose == "attempt":
            attempt = state.attempts.get(pending.attempt or -1)
            if attempt is None:
                continue
            if attempt.stage == "turn" and attempt.step_id is not None:
                out.append(DropStep(attempt.step_id))
            # NOTE: a queued clone stays the queue's; its late SpillSettled is ignored.
            outcome: Outcome = "failed" if attempt.stage == "queued" else "error"
            _finish(state, attempt, outcome, now, out, reason="timeout")
        elif flush is None:
            continue
        elif pending.purpose == "drain":
            flush.phase = "forcing"
        elif pending.purpose == "verify":
            _verified(state, flush, pending, False)
        elif pending.purpose == "stats":
            _finish_flush(state, flush, now, out)


# --- flush ----------------------------------------------------------------------------


def _start_flush(
    state: DurabilityState, waiters: list[Envelope], now: float, out: list[Effect]
) -> None:
    # NOTE: "cancel timers": while a flush runs no write-behind attempt starts;
    # records keep their ``due`` for afterwards.
    scope = tuple(state.records)
    state.flush = FlushRun(state.next_id(), waiters, now, scope)


def _verified(state: DurabilityState, flush: FlushRun, asked: _Outstanding, covered: bool) -> None:
    assert asked.key is not None
    rec = state.records.get(asked.key)
    if covered:
        flush.covered += 1
        if rec is not None and rec.attempt is None and rec.version == asked.version:
            # NOTE: evidence asked after this version was scheduled; a version
            # scheduled since keeps its record (and its write-behind timer).
            del state.records[asked.key]
    elif (
        rec is not None
        and rec.missing
        and rec.attempt is None
        and rec.version == asked.version
    ):
        # NOTE: evicted before any write reached disk, and the spill queue
        # (which held its eviction spill, if any) has drained: no tier holds
        # this prefix any more. Reported once, then forgotten, so it never
        # blocks a later flush; a new put of the same tokens is a new record.
        del state.records[asked.key]
        flush.evicted_unwritten += 1
        state.evicted_unwritten += 1
    elif rec is None or rec.missing:
        flush.uncovered += 1
    else:
        flush.pending += 1


def _pick_forced(state: DurabilityState, flush: FlushRun, now: float) -> Record | None:
    ready = [k for at, k in flush.held if at <= now]
    flush.held = [(at, k) for at, k in flush.held if at > now]
    flush.todo.extend(ready)
    while flush.todo:
        key = flush.todo.popleft()
        rec = state.records.get(key)
        if rec is None or rec.attempt is not None or (key, rec.version) in flush.tried:
            continue
        return rec
    return None


def _advance_flush(state: DurabilityState, flush: FlushRun, now: float, out: list[Effect]) -> None:
    if flush.resume_at is not None:
        if flush.resume_at > now:
            return
        flush.resume_at = None
    if flush.phase == "settling":
        if state.attempts:
            return
        flush.phase = "draining"
        _request(state, "spill_queue", DrainSpills(), "drain", now, out)
        return
    if flush.phase == "draining":
        return
    if flush.phase == "forcing":
        if state.attempts:
            return
        rec = _pick_forced(state, flush, now)
        if rec is not None:
            flush.tried.add((rec.key, rec.version))
            _start_attempt(state, rec, forced=True, now=now, out=out)
            return
        if flush.held:
            return
        flush.phase = "verifying"
    if flush.phase == "verifying":
        if any(p.purpose == "verify" for p in state.outstanding.values()):
            return
        if flush.verify_cursor < len(flush.scope):
            key = flush.scope[flush.verify_cursor]
            flush.verify_cursor += 1
            rec = state.records.get(key)
            body = Covers(tokens=key[1], namespace=key[0])
            version = rec.version if rec is not None else None
            _request(state, "ssd_writer", body, "verify", now, out, key=key, version=version)
            return
        flush.phase = "stats"
        _request(state, "ssd_writer", SsdStatsRequest(), "stats", now, out)


def _finish_flush(state: DurabilityState, flush: FlushRun, now: float, out: list[Effect]) -> None:
    lost = state.lost_since_flush
    evicted = flush.evicted_unwritten + state.evicted_since_flush
    result = FlushResult(
        durable=(
            flush.pending == 0
            and flush.uncovered == 0
            and flush.dropped == 0
            and flush.failed == 0
            and lost == 0
        ),
        pending=flush.pending,
        dropped=flush.dropped,
        failed=flush.failed,
        uncovered=flush.uncovered,
        lost=lost,
        evicted_unwritten=evicted,
        entries=flush.entries,
        longest_durable_prefix_tokens=flush.longest,
        scope=len(flush.scope),
        written=flush.written,
        covered=flush.covered,
        dirty_after=len(state.records),
        started_at=flush.started_at,
        finished_at=now,
        checkpoints_lost=flush.checkpoints_lost,
    )
    state.flush = None
    state.flushes += 1
    state.last_flush = result
    state.lost_since_flush = 0
    state.evicted_since_flush = 0
    plain = [w for w in flush.waiters if not isinstance(w.body, FlushAll)]
    out.extend(Answer(w, result) for w in plain)
    whole = [w for w in flush.waiters if isinstance(w.body, FlushAll)]
    if whole:
        # NOTE: what entered the spill queue while the flush ran (evictions,
        # demotions) reaches the writer before a FlushAll is answered.
        ref = _request(state, "spill_queue", DrainSpills(), "final_drain", now, out)
        state.final_drains[ref] = (whole, result)
    if evicted:
        out.append(Log("durability.evicted_unwritten", (("prefixes", evicted),)))
    if not result.durable:
        # NOTE: with the SSD tier at its cap, the flush's own forced writes
        # evict files it wrote earlier, so prefixes verified gone count as
        # uncovered: the tier's fill says whether that is why.
        tier: tuple[tuple[str, str | int | float], ...] = ()
        if flush.ssd_bytes is not None and flush.ssd_max_bytes is not None:
            tier = (("ssd_bytes", flush.ssd_bytes), ("ssd_max_bytes", flush.ssd_max_bytes))
        out.append(
            Log(
                "durability.not_durable",
                (
                    ("pending", result.pending),
                    ("uncovered", result.uncovered),
                    ("dropped", result.dropped),
                    ("failed", result.failed),
                    ("lost", result.lost),
                    *tier,
                ),
            )
        )
    if state.config.write_behind:
        # NOTE: records the flush left dirty go back to write-behind.
        for rec in state.records.values():
            if rec.attempt is None and rec.due is None and not rec.missing:
                _arm(state, rec, now + _backoff(state, rec))


# --- pump and alarm ---------------------------------------------------------------------


def _start_due(state: DurabilityState, now: float, out: list[Effect]) -> None:
    heap = state.due_heap
    while heap and len(state.attempts) < state.config.max_attempts:
        at, version, key = heap[0]
        if at > now:
            return
        heapq.heappop(heap)
        rec = state.records.get(key)
        if rec is None or rec.version != version or rec.due != at or rec.attempt is not None:
            continue  # NOTE: a stale heap entry (lazy deletion).
        if rec.missing:
            rec.due = None
            continue
        _start_attempt(state, rec, forced=False, now=now, out=out)


def _pump(state: DurabilityState, now: float, out: list[Effect]) -> None:
    """Start what may start now: the next flush, its next step, or due write-behind attempts."""
    if state.stopped:
        return
    while True:
        flush = state.flush
        if flush is None:
            if state.flush_queue:
                waiters, state.flush_queue = state.flush_queue, []
                _start_flush(state, waiters, now, out)
                continue
            if state.config.write_behind:
                _start_due(state, now, out)
            return
        mark = (flush.phase, len(out))
        _advance_flush(state, flush, now, out)
        # NOTE: a phase with nothing to do (nothing to settle, force or verify)
        # moves on at once; every pass either sends, changes phase, or stops.
        if state.flush is flush and (flush.phase, len(out)) == mark:
            return


def next_wake(state: DurabilityState, now: float) -> float | None:
    """When the core next needs a ``Wake`` after ``now``: a reply deadline, a retry, a due record.

    NOTE: only future times: anything due by ``now`` was started by the
    pump, or waits for a reply (itself an event) because the attempts or the
    flush are busy; an alarm for a past time would only spin.
    """
    times = [p.deadline for p in state.outstanding.values()]
    flush = state.flush
    if flush is not None:
        times.extend(at for at, _ in flush.held if at > now)
        if flush.resume_at is not None and flush.resume_at > now:
            times.append(flush.resume_at)
    elif (
        state.config.write_behind
        and not state.stopped
        and len(state.attempts) < state.config.max_attempts
    ):
        heap = state.due_heap
        while heap:
            at, version, key = heap[0]
            rec = state.records.get(key)
            if rec is None or rec.version != version or rec.due != at or rec.attempt is not None:
                heapq.heappop(heap)
                continue
            times.append(at)
            break
    return min(times, default=None)


def _alarm(state: DurabilityState, now: float, out: list[Effect]) -> None:
    at = next_wake(state, now)
    if at != state.alarm_at:
        state.alarm_at = at
        out.append(SetAlarm(at))


# --- entry points ------------------------------------------------------------------------


def stats(state: DurabilityState) -> DurabilityStats:
    """The statistics snapshot of ``state``."""
    missing = sum(1 for r in state.records.values() if r.missing)
    return DurabilityStats(
        dirty=len(state.records),
        pending_snapshots=len(state.records) - missing,
        missing=missing,
        in_flight=len(state.attempts),
        flushing=state.flush is not None,
        scheduled=state.scheduled,
        attempts=state.attempts_started,
        written=state.written,
        stored=state.stored,
        already_covered=state.already_covered,
        vanished=state.vanished,
        busy_rearms=state.busy_rearms,
        dropped=state.dropped,
        failed=state.failed,
        timeouts=state.timeouts,
        lost=state.lost,
        evicted_unwritten=state.evicted_unwritten,
        flushes=state.flushes,
        last_flush=state.last_flush,
    )


def handle(state: DurabilityState, event: Event) -> tuple[DurabilityState, list[Effect]]:
    """Apply one event (at its clock time ``now``); return the state and the effects, in order."""
    now = event.now
    out: list[Effect] = []
    match event:
        case Stopping():
            _stop(state, now, out)
            return state, out
        case Undelivered():
            _undelivered(state, event, now, out)
        case Received():
            _received(state, event, now, out)
        case _:
            assert_never(event)
    _expire(state, now, out)
    _pump(state, now, out)
    _alarm(state, now, out)
    return state, out


def _received(state: DurabilityState, event: Received, now: float, out: list[Effect]) -> None:
    envelope = event.envelope
    body = envelope.body
    if isinstance(body, Schedule):
        _schedule(state, body, now, out)
    elif isinstance(body, Flush):
        if state.stopped:
            out.append(Answer(envelope, _stopped_result(state, now)))
        else:
            state.flush_queue.append(envelope)
    elif isinstance(body, FlushAll):
        if state.stopped:
            out.append(Answer(envelope, _stopped_result(state, now)))
        else:
            # NOTE: each FlushAll its own barrier: puts handed to the
            # prompt cache before THIS message are in its scope.
            ref = _request(state, "prompt_cache", PromptCacheStatsRequest(), "barrier",
                           now, out)
            state.barriers[ref] = envelope
    elif isinstance(body, DurabilityStatsRequest):
        out.append(Answer(envelope, stats(state)))
    elif isinstance(body, Wake):
        pass  # NOTE: the alarm only brings time forward; the pump in handle acts.
    elif isinstance(
        body,
        CoversResult | TurnDone | SpillSettled | SpillsDrained | SsdStats | PromptCacheStats
        | Failure,
    ):
        _reply(state, envelope.correlation_id, body, event.clone, now, out)
    else:
        raise UnknownDurabilityMessage(f"durability has no rule for {body.kind!r}")


def _stopped_result(state: DurabilityState, now: float) -> FlushResult:
    missing = sum(1 for r in state.records.values() if r.missing)
    return FlushResult(
        durable=False,
        pending=len(state.records) - missing,
        dropped=0,
        failed=0,
        uncovered=missing,
        lost=state.lost_since_flush,
        evicted_unwritten=state.evicted_since_flush,
        scope=len(state.records),
        dirty_after=len(state.records),
        started_at=now,
        finished_at=now,
    )


def _stop(state: DurabilityState, now: float, out: list[Effect]) -> None:
    """The coordinator stops: answer every flush asker (not durable), drop waiting steps, no alarm."""
    state.stopped = True
    waiters = list(state.flush_queue) + list(state.barriers.values())
    if state.flush is not None:
        waiters = state.flush.waiters + waiters
    state.flush, state.flush_queue, state.barriers = None, [], {}
    result = _stopped_result(state, now)
    out.extend(Answer(w, result) for w in waiters)
    for drained, finished in state.final_drains.values():
        out.extend(Answer(w, finished) for w in drained)
    state.final_drains = {}
    for attempt in state.attempts.values():
        if attempt.stage == "turn" and attempt.step_id is not None:
            out.append(DropStep(attempt.step_id))
        elif attempt.stage == "parked" and attempt.clone is not None:
            out.append(DisposeClone(attempt.clone))
    state.parked.clear()
    state.outstanding.clear()
    state.attempts.clear()
    for rec in state.records.values():
        rec.attempt = None
    if state.alarm_at is not None:
        state.alarm_at = None
        out.append(SetAlarm(None))
