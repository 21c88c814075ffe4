"""The RAM prompt cache's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

Pure Python over token tuples and :class:`messages.EntryMeta`; no arrays, no
I/O, no clock: every event carries the time the shell read from the injected
clock. The actor shell (``actors/prompt_cache/actor.py``) performs the
effects: :class:`Reply` answers a request (the one being handled, or a
``Take`` answered later), :class:`Dispose` hands a handle back to the
registry, :class:`Spill` sends the entry to the cold tier's queue (which
then owns its disposal), :class:`RequestDrain` asks the gateway for a
background engine turn that drops disposed arrays, :class:`AskCold` asks the
SSD index (``Find``, then ``Restore``), :class:`DiscardStaged` drops restored
bytes nobody will use, :class:`SetAlarm` sets the one timer. The shell
reports what it could not do, or what the core must know, as events
(:class:`LeaseUndelivered`, :class:`SpillUndelivered`, :class:`ColdAskSent`,
:class:`ColdAskUndelivered`). The rules are written down in
``docs/prompt-cache.md`` and ``docs/cold-tier.md``.

Invariants kept by every function here:

- the bytes the cache retains never exceed ``cap_bytes``: indexed entries
  plus pinned ones (evicted, replaced or superseded while a lease held them,
  kept until the last ``Release``). NOTE: pinned bytes count because the
  arrays stay alive until the release; a ``Put`` that cannot fit beside the
  leased and pinned bytes is refused (``reason="no_room"``) rather than
  breaking the cap;
- a leased entry is never chosen for eviction or demotion (evicting it would
  free nothing until its release);
- a handle is disposed or spilled exactly once, and never while leased;
- entries of different namespaces never serve each other;
- a lease ends exactly once: by ``Release``, when its ``TakeResult`` could
  not be delivered, or when its deadline (``lease_ttl_s`` after the
  ``Take``) has passed; a lease on restored bytes drops them when it ends;
- every ``Take`` is answered exactly once: at once, or (when the SSD index
  is asked) when the cold lookup ends, fails, or passes ``cold_timeout_s``;
  a cold candidate replaces the RAM one only with a strictly longer usable
  prefix, and any cold-tier failure answers what RAM had (a miss at worst).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, assert_never

from messages import (
    Body,
    EntryMeta,
    Envelope,
    Failure,
    PromptCacheStats,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Request,
    Take,
    TakeResult,
)
from messages.gateway import TurnDone
from messages.kv_events import TierChange, TierChanged
from messages.prompt_cache import Demote, DemoteResult, PromptCacheWake
from messages.spill_queue import Enqueue, SpillSource
from messages.ssd_writer import Find, FindResult, Restore, RestoreResult

__all__ = [
    "DEFAULT_COLD_TIMEOUT_S",
    "DEFAULT_LEASE_TTL_S",
    "AskCold",
    "ColdAskSent",
    "ColdAskUndelivered",
    "CoreState",
    "DiscardStaged",
    "Dispose",
    "DrainUndelivered",
    "Effect",
    "Entry",
    "Event",
    "Lease",
    "LeaseUndelivered",
    "NotifyPut",
    "PendingTake",
    "Received",
    "Reply",
    "ReportTier",
    "RequestDrain",
    "SetAlarm",
    "Spill",
    "SpillUndelivered",
    "Started",
    "Stopping",
    "UnknownPromptCacheMessage",
    "common_prefix_len",
    "demote",
    "demote_idle",
    "dispose_all",
    "expire_leases",
    "handle",
    "next_wake",
    "pinned_bytes",
    "put",
    "release",
    "retained_bytes",
    "stats",
    "stop",
    "take",
]

DEFAULT_LEASE_TTL_S = 300.0
"""How long a lease may live before the cache ends it (see :class:`Lease`)."""

DEFAULT_COLD_TIMEOUT_S = 30.0
"""How long a ``Take`` may wait for the SSD index and a file read before RAM answers."""


class UnknownPromptCacheMessage(TypeError):
    """A body the prompt cache has no rule for."""


# --- effects (core -> shell) ----------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Answer ``to`` (``None``: the request being handled) with ``body``.

    A ``TakeResult`` holding a lease that cannot be delivered (the asker's
    deadline passed, or the Take was a tell) comes back as :class:`LeaseUndelivered`.
    """

    body: Body
    to: Envelope | None = None


@dataclass(frozen=True)
class Dispose:
    """Give ``handle``'s arrays back (``CacheRegistry.dispose``)."""

    handle: str


@dataclass(frozen=True)
class Spill:
    """Send ``message`` to the cold tier's queue; its ``handle``'s ownership goes with it.

    If the queue cannot take the message now, the shell reports
    :class:`SpillUndelivered` and the entry is disposed instead.
    """

    message: Enqueue

    @property
    def handle(self) -> str:
        """The handle whose ownership the message carries."""
        return self.message.handle


@dataclass(frozen=True)
class RequestDrain:
    """Ask for one background engine turn that drops the arrays of disposed handles.

    The shell sends ``RunWhenIdle(step_id)`` to the gateway with this actor
    as the reply address (the wiring registered the registry's ``drain`` as
    that standing background step); the ``TurnDone`` comes back here.
    """

    step_id: str


@dataclass(frozen=True)
class AskCold:
    """Send ``body`` to the SSD index as a request answered to this actor.

    The shell answers with :class:`ColdAskSent` (the message id the answer
    will name as its cause) or :class:`ColdAskUndelivered`.
    """

    take_id: str
    body: Find | Restore


@dataclass(frozen=True)
class DiscardStaged:
    """Drop the restored bytes waiting under ``staging_id`` (nobody will materialize them)."""

    staging_id: str


@dataclass(frozen=True)
class SetAlarm:
    """Wake this actor (``PromptCacheWake``) at clock time ``at`` (``None``: no alarm)."""

    at: float | None


@dataclass(frozen=True)
class NotifyPut:
    """Tell the durability coordinator that ``handle`` now holds ``tokens`` (``Schedule``).

    NOTE: sent with a waiting tell: a dropped notice would let a flush claim
    durability for a prefix it never saw. The handle stays the cache's.
    """

    namespace: str
    tokens: tuple[int, ...]
    handle: str


@dataclass(frozen=True)
class ReportTier:
    """Tell the KV-event publisher which entries entered and left the index (a waiting tell).

    Only with ``report_tier`` set (``--kv-events``); ``body.medium`` is ``CPU``.
    """

    body: TierChanged


Effect = (
    Reply
    | Dispose
    | Spill
    | RequestDrain
    | AskCold
    | DiscardStaged
    | SetAlarm
    | NotifyPut
    | ReportTier
)


# --- events (shell -> core) -----------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A message from the mailbox, handled at ``now``."""

    envelope: Envelope
    now: float


@dataclass(frozen=True)
class LeaseUndelivered:
    """The ``TakeResult`` granting ``lease_id`` reached nobody."""

    lease_id: str
    now: float = 0.0


@dataclass(frozen=True)
class SpillUndelivered:
    """The cold tier's queue did not take ``message`` (full, stopped, gone)."""

    message: Enqueue
    now: float = 0.0


@dataclass(frozen=True)
class ColdAskSent:
    """The :class:`AskCold` of ``take_id`` left as message ``msg_id``."""

    take_id: str
    msg_id: str
    now: float = 0.0


@dataclass(frozen=True)
class ColdAskUndelivered:
    """The :class:`AskCold` of ``take_id`` could not be sent (the SSD index is gone)."""

    take_id: str
    now: float = 0.0


@dataclass(frozen=True)
class DrainUndelivered:
    """The :class:`RequestDrain` could not be sent (the gateway is gone or full): a refusal."""

    step_id: str
    now: float = 0.0


@dataclass(frozen=True)
class Started:
    """The actor (re)started at ``now``: no timer of an earlier instance is set any more."""

    now: float


@dataclass(frozen=True)
class Stopping:
    """The actor stops: answer every cold lookup, drop every indexed entry, cancel the alarm."""

    now: float


Event = (
    Received
    | LeaseUndelivered
    | SpillUndelivered
    | ColdAskSent
    | ColdAskUndelivered
    | DrainUndelivered
    | Started
    | Stopping
)
"""What :func:`handle` accepts: a message, or a fact the shell reports."""


# --- state ------------------------------------------------------------------------------


@dataclass
class Lease:
    """One lease: on a RAM entry (``handle``) or on restored bytes (``staging_id``).

    ``deadline``: when the cache ends it if nobody released it.

    NOTE: a lease lives from ``Take`` until the holder materialized its views
    (or failed). A holder that died (its task cancelled, its actor restarted)
    never releases; the deadline bounds how long such a lease pins its entry.
    Ending a lease early is safe: the holder's later ``materialize`` finds
    the handle (or the staged bytes) gone and serves a miss, never wrong KV.
    """

    handle: str | None
    deadline: float
    staging_id: str | None = None


_Fate = Literal["dispose", "spill", "demote"]


@dataclass
class Entry:
    """One stored prefix entry (indexed, or pinned by leases after leaving the index).

    ``last_used`` orders the LRU (a counter); ``used_at`` is the clock time
    of its put or latest hit (idle demotion).
    """

    handle: str
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta
    last_used: int
    used_at: float = 0.0
    leases: int = 0
    indexed: bool = True
    fate: _Fate = "dispose"
    """What happens once an unindexed entry's last lease is released."""


@dataclass
class PendingTake:
    """A ``Take`` whose answer waits for the SSD index (and maybe a file read).

    ``ram`` is what RAM found; its lease (if any) is held meanwhile, so the
    entry cannot be evicted under the request. ``ask``: the message id of
    the outstanding ask.
    """

    take_id: str
    request: Envelope
    take: Take
    ram: TakeResult
    deadline: float
    phase: Literal["find", "restore"] = "find"
    find: FindResult | None = None
    ask: str | None = None


@dataclass
class CoreState:
    """Everything the rules know (mutated in place and returned by :func:`handle`).

    ``spill_enabled``: a cold tier's queue receives spills (else they are
    disposed). ``drain_step``: the background step that drops disposed
    arrays (``None``: no drain is requested; the engine drains at its next
    turn). ``lease_ttl_s``: how long a lease may live. ``cold_lookups``: a
    ``Take`` also asks the SSD index (at most ``max_cold_lookups`` at once,
    each answered within ``cold_timeout_s``), unless the prompt's rest past
    what RAM serves is shorter than ``cold_min_gain`` (the index's
    ``min_restore_tokens``: its ``Find`` offers no file adding fewer, so
    its answer would be a miss). ``demote_idle_s``: entries
    unused this long are handed to the cold tier (0: never; needs
    ``spill_enabled``), at most ``demote_batch`` per scan, one scan per
    ``demote_scan_s`` at most. ``notify_puts``: every stored put is
    announced to the durability coordinator (write-behind, flush).
    """

    cap_bytes: int
    spill_enabled: bool = False
    drain_step: str | None = None
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    cold_lookups: bool = False
    cold_timeout_s: float = DEFAULT_COLD_TIMEOUT_S
    max_cold_lookups: int = 4
    cold_min_gain: int = 1
    demote_idle_s: float = 0.0
    demote_batch: int = 4
    demote_scan_s: float = 0.0
    notify_puts: bool = False
    report_tier: bool = False
    """Entries entering and leaving the index are reported (:class:`ReportTier`, KV events)."""
    tier_changes: list[TierChange] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    by_namespace: dict[str, dict[tuple[int, ...], str]] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    pending: dict[str, PendingTake] = field(default_factory=dict)
    asks: dict[str, str] = field(default_factory=dict)
    indexed_bytes: int = 0
    tick: int = 0
    lease_seq: int = 0
    take_seq: int = 0
    next_demote_scan: float = 0.0
    alarm_at: float | None = None
    hits: int = 0
    misses: int = 0
    cached_tokens_served: int = 0
    puts: int = 0
    stored: int = 0
    rejected_too_large: int = 0
    rejected_no_room: int = 0
    replaced: int = 0
    superseded: int = 0
    evicted: int = 0
    spilled: int = 0
    disposed: int = 0
    leases_expired: int = 0
    leases_undelivered: int = 0
    spills_undelivered: int = 0
    ssd_hits: int = 0
    ssd_cached_tokens_served: int = 0
    ssd_lookups: int = 0
    ssd_lookups_skipped: int = 0
    ssd_recompute: int = 0
    ssd_failures: int = 0
    ssd_timeouts: int = 0
    demotions: int = 0
    # Disposed handles whose arrays no confirmed drain has dropped yet: those
    # no drain was requested for, and those the drain in flight covers.
    undrained: int = 0
    undrained_bytes: int = 0
    draining: int = 0
    draining_bytes: int = 0
    drain_in_flight: str | None = None
    drains_requested: int = 0
    drains_refused: int = 0

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError("cap_bytes cannot be negative")
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        if self.cold_timeout_s <= 0 or self.max_cold_lookups < 1 or self.cold_min_gain < 1:
            raise ValueError(
                "cold_timeout_s must be positive, max_cold_lookups and cold_min_gain >= 1")
        if self.demote_idle_s < 0 or self.demote_batch < 1 or self.demote_scan_s < 0:
            raise ValueError("demote_idle_s, demote_scan_s >= 0 and demote_batch >= 1")


# --- matching -----------------------------------------------------------------------------


_GALLOP_FIRST = 16
"""Tokens the first slice of :func:`common_prefix_len`'s gallop compares."""


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples.

    NOTE: slice equality keeps the element comparisons in C (a Python loop
    over 3k-token prompts per entry would stall the loop), and the slices
    gallop: blocks of 16, 32, 64, ... tokens from the start until one
    differs, then a binary search inside it. Every lookup scans every entry
    of its namespace (RAM tier and SSD index), and most entries part from
    the prompt within a chat template's first tokens: comparing whole
    prompts first cost ~12 us an entry, 3.7 ms a lookup over 300 entries of
    ~600 tokens (the H200 runs' 32-64 streams queued lookups behind each
    other in the prompt cache's mailbox). A prompt sharing all of an
    entry compares about twice its length, as before.
    """
    n = min(len(a), len(b))
    lo, step = 0, _GALLOP_FIRST
    while True:
        if lo >= n:
            return n
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    # NOTE: a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi].
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _usable(entry: Entry, prompt: tuple[int, ...]) -> int:
    """Tokens ``entry`` can serve for ``prompt`` (0 when it cannot serve)."""
    usable = min(common_prefix_len(entry.tokens, prompt), len(prompt) - 1)
    if usable <= 0:
        return 0
    if usable < len(entry.tokens) and (
        not entry.meta.trimmable or usable < entry.meta.min_reusable_offset
    ):
        return 0
    return usable


def _touch(state: CoreState, entry: Entry, now: float) -> None:
    state.tick += 1
    entry.last_used = state.tick
    entry.used_at = now


def _ram_best(state: CoreState, msg: Take) -> tuple[Entry | None, int]:
    """The RAM entry with the longest usable prefix of ``msg.tokens`` and that length."""
    best: Entry | None = None
    best_usable = 0
    candidates = state.by_namespace.get(msg.namespace, {})
    if len(msg.tokens) > 1:
        for handle_id in candidates.values():
            entry = state.entries[handle_id]
            usable = _usable(entry, msg.tokens)
            if usable == 0:
                continue
            if best is None or (usable, -len(entry.tokens), entry.last_used) > (
                best_usable,
                -len(best.tokens),
                best.last_used,
            ):
                best, best_usable = entry, usable
    return best, best_usable


def _new_lease(state: CoreState, lease: Lease) -> str:
    state.lease_seq += 1
    lease_id = f"lease-{state.lease_seq}"
    state.leases[lease_id] = lease
    return lease_id


def _lease_ram(state: CoreState, entry: Entry, usable: int, now: float) -> TakeResult:
    """Lease ``entry`` (deadline ``lease_ttl_s`` after ``now``) and touch it."""
    lease_id = _new_lease(state, Lease(entry.handle, now + state.lease_ttl_s))
    entry.leases += 1
    _touch(state, entry, now)
    return TakeResult(
        lease_id=lease_id,
        handle=entry.handle,
        cached_tokens=usable,
        entry_tokens=len(entry.tokens),
        tier="ram",
    )


def _count_answer(state: CoreState, result: TakeResult) -> None:
    if result.lease_id is None:
        state.misses += 1
    elif result.tier == "ssd":
        state.ssd_hits += 1
        state.ssd_cached_tokens_served += result.cached_tokens
    else:
        state.hits += 1
        state.cached_tokens_served += result.cached_tokens


def take(state: CoreState, msg: Take, now: float = 0.0) -> list[Effect]:
    """Lease the RAM entry with the longest usable prefix of ``msg.tokens`` (or miss).

    The lease ends by ``Release``, or ``state.lease_ttl_s`` after ``now``.
    """
    best, usable = _ram_best(state, msg)
    result = TakeResult() if best is None else _lease_ram(state, best, usable, now)
    _count_answer(state, result)
    return [Reply(result)]


# --- the cold lookup ------------------------------------------------------------------------


def _take_received(state: CoreState, envelope: Envelope, msg: Take, now: float) -> list[Effect]:
    """Answer from RAM at once, or ask the SSD index first when a file could serve more."""
    best, usable = _ram_best(state, msg)
    answerable = isinstance(envelope.body, Request) and bool(envelope.body.reply_to)
    if (
        not state.cold_lookups
        or not answerable
        or usable >= len(msg.tokens) - 1
        or len(state.pending) >= state.max_cold_lookups
    ):
        return take(state, msg, now)
    if len(msg.tokens) - 1 - usable < state.cold_min_gain:
        # NOTE: no file can add cold_min_gain tokens to RAM's (a file serves
        # at most len - 1): the index's answer is known to be a miss. An
        # agent's next turn (RAM holds the conversation so far, a few dozen
        # new tokens) answers here instead of after two more hops.
        state.ssd_lookups_skipped += 1
        return take(state, msg, now)
    ram = TakeResult() if best is None else _lease_ram(state, best, usable, now)
    state.take_seq += 1
    take_id = f"take-{state.take_seq}"
    state.pending[take_id] = PendingTake(
        take_id=take_id,
        request=envelope,
        take=msg,
        ram=ram,
        deadline=now + state.cold_timeout_s,
    )
    state.ssd_lookups += 1
    find = Find(tokens=msg.tokens, namespace=msg.namespace, better_than=usable)
    return [AskCold(take_id, find)]


def _close_ask(state: CoreState, pending: PendingTake) -> None:
    if pending.ask is not None:
        state.asks.pop(pending.ask, None)
        pending.ask = None


def _answer_ram(state: CoreState, pending: PendingTake) -> list[Effect]:
    """End a cold lookup with what RAM had (its lease, if any, goes to the asker)."""
    _close_ask(state, pending)
    del state.pending[pending.take_id]
    _count_answer(state, pending.ram)
    return [Reply(pending.ram, to=pending.request)]


def _answer_ssd(
    state: CoreState, pending: PendingTake, find: FindResult, restored: RestoreResult, now: float
) -> list[Effect]:
    """End a cold lookup with the restored file: a lease on its staged bytes replaces RAM's."""
    assert restored.staging_id is not None
    _close_ask(state, pending)
    del state.pending[pending.take_id]
    effects: list[Effect] = []
    if pending.ram.lease_id is not None:
        effects += release(state, Release(lease_id=pending.ram.lease_id))
    lease = Lease(None, now + state.lease_ttl_s, staging_id=restored.staging_id)
    result = TakeResult(
        lease_id=_new_lease(state, lease),
        staging_id=restored.staging_id,
        cached_tokens=find.cached_tokens,
        entry_tokens=find.entry_tokens,
        tier="ssd",
    )
    _count_answer(state, result)
    return [*effects, Reply(result, to=pending.request)]


def _cold_failed(state: CoreState, pending: PendingTake) -> list[Effect]:
    state.ssd_failures += 1
    return _answer_ram(state, pending)


def _find_answered(state: CoreState, pending: PendingTake, find: FindResult) -> list[Effect]:
    _close_ask(state, pending)
    if pending.phase != "find":
        return []
    if (
        find.choice == "restore"
        and find.path is not None
        and find.cached_tokens > pending.ram.cached_tokens
        and find.cached_tokens < len(pending.take.tokens)
    ):
        pending.phase, pending.find = "restore", find
        restore = Restore(
            path=find.path, namespace=pending.take.namespace, ticket=pending.take_id
        )
        return [AskCold(pending.take_id, restore)]
    if find.choice == "recompute":
        state.ssd_recompute += 1
    return _answer_ram(state, pending)


def _restore_answered(
    state: CoreState, envelope: Envelope, result: RestoreResult, now: float
) -> list[Effect]:
    take_id = result.ticket or state.asks.get(envelope.causation_id or "", "")
    pending = state.pending.get(take_id)
    find = pending.find if pending is not None else None
    if pending is None or find is None or pending.phase != "restore" or result.path != find.path:
        # NOTE: a late answer (its lookup timed out or the cache restarted):
        # nobody will materialize these bytes.
        return [DiscardStaged(result.staging_id)] if result.staging_id else []
    if result.ok and result.staging_id is not None and result.entry_tokens == find.entry_tokens:
        return _answer_ssd(state, pending, find, result, now)
    effects: list[Effect] = [DiscardStaged(result.staging_id)] if result.staging_id else []
    return [*effects, *_cold_failed(state, pending)]


def _expire_lookups(state: CoreState, now: float) -> list[Effect]:
    """Answer every cold lookup past its deadline with what RAM had."""
    effects: list[Effect] = []
    for pending in [p for p in state.pending.values() if p.deadline <= now]:
        state.ssd_timeouts += 1
        effects += _answer_ram(state, pending)
    return effects


def _ask_sent(state: CoreState, event: ColdAskSent) -> list[Effect]:
    pending = state.pending.get(event.take_id)
    if pending is not None:
        pending.ask = event.msg_id
        state.asks[event.msg_id] = event.take_id
    return []


def _ask_undelivered(state: CoreState, event: ColdAskUndelivered) -> list[Effect]:
    pending = state.pending.get(event.take_id)
    return [] if pending is None else _cold_failed(state, pending)


# --- puts, evictions, demotions ------------------------------------------------------------


def _dispose(state: CoreState, handle_id: str, nbytes: int) -> Dispose:
    """Count a disposal (and its arrays, until a drain drops them)."""
    state.disposed += 1
    if state.drain_step is not None:
        state.undrained += 1
        state.undrained_bytes += nbytes
    return Dispose(handle_id)


def _spill(
    state: CoreState,
    handle_id: str,
    namespace: str,
    tokens: tuple[int, ...],
    meta: EntryMeta,
    source: SpillSource = "evict",
) -> Spill:
    state.spilled += 1
    return Spill(
        Enqueue(handle=handle_id, namespace=namespace, tokens=tokens, meta=meta, source=source)
    )


def _finish(state: CoreState, entry: Entry) -> list[Effect]:
    """Dispose or spill an entry that left the index and holds no lease."""
    del state.entries[entry.handle]
    if entry.fate != "dispose" and state.spill_enabled:
        source: SpillSource = "demote" if entry.fate == "demote" else "evict"
        return [_spill(state, entry.handle, entry.namespace, entry.tokens, entry.meta, source)]
    return [_dispose(state, entry.handle, entry.meta.nbytes)]


def _record(state: CoreState, op: Literal["stored", "removed"], entry: Entry) -> None:
    if state.report_tier:
        state.tier_changes.append(TierChange(op=op, namespace=entry.namespace, tokens=entry.tokens))


def _tier_report(state: CoreState) -> list[Effect]:
    """The index changes since the last report, as one :class:`ReportTier` (none: nothing)."""
    if not state.tier_changes:
        return []
    changes, state.tier_changes = tuple(state.tier_changes), []
    return [ReportTier(TierChanged(medium="CPU", changes=changes))]


def _unindex(state: CoreState, entry: Entry, fate: _Fate) -> list[Effect]:
    _record(state, "removed", entry)
    del state.by_namespace[entry.namespace][entry.tokens]
    if not state.by_namespace[entry.namespace]:
        del state.by_namespace[entry.namespace]
    state.indexed_bytes -= entry.meta.nbytes
    entry.indexed = False
    entry.fate = fate
    if entry.leases > 0:
        return []  # NOTE: pinned; disposed or spilled on its last Release.
    return _finish(state, entry)


_RejectReason = Literal["disabled", "too_large", "no_room", "invalid"]


def _reject(state: CoreState, msg: Put, reason: _RejectReason) -> list[Effect]:
    effects: list[Effect]
    if reason in ("too_large", "no_room") and state.spill_enabled:
        # NOTE: the cold tier may still keep what RAM cannot; it owns the handle now.
        effects = [_spill(state, msg.handle, msg.namespace, msg.tokens, msg.meta)]
    elif reason == "invalid" and msg.handle in state.entries:
        effects = []  # NOTE: already ours; disposing it here would double-dispose.
    else:
        effects = [_dispose(state, msg.handle, msg.meta.nbytes)]
    if reason == "too_large":
        state.rejected_too_large += 1
    elif reason == "no_room":
        state.rejected_no_room += 1
    return [*effects, Reply(PutResult(stored=False, reason=reason))]


def pinned_bytes(state: CoreState) -> int:
    """Bytes of entries out of the index that a lease still keeps alive."""
    return sum(e.meta.nbytes for e in state.entries.values() if not e.indexed)


def retained_bytes(state: CoreState) -> int:
    """Every byte the cache retains: indexed entries plus pinned ones (always <= the cap)."""
    return state.indexed_bytes + pinned_bytes(state)


def _displaced(state: CoreState, msg: Put) -> tuple[Entry | None, list[Entry]]:
    """The exact duplicate of ``msg`` and the strict prefix ancestors it supersedes."""
    same_ns = state.by_namespace.get(msg.namespace, {})
    duplicate_id = same_ns.get(msg.tokens)
    duplicate = state.entries[duplicate_id] if duplicate_id is not None else None
    ancestors: list[Entry] = []
    if msg.meta.trimmable:
        # NOTE: a trimmable descendant serves every prompt its ancestor could,
        # provided it may be trimmed down to the ancestor's length; an
        # untrimmable one serves only exact prefixes, so ancestors (the
        # prompt-boundary snapshot) must stay.
        for tokens, handle_id in same_ns.items():
            if (
                len(tokens) < len(msg.tokens)
                and msg.meta.min_reusable_offset <= len(tokens)
                and msg.tokens[: len(tokens)] == tokens
            ):
                ancestors.append(state.entries[handle_id])
    return duplicate, ancestors


def put(state: CoreState, msg: Put, now: float = 0.0) -> list[Effect]:
    """Store ``msg``'s entry: replace a duplicate, supersede ancestors, evict LRU to the cap."""
    state.puts += 1
    if msg.handle in state.entries or len(msg.tokens) != msg.meta.offset or not msg.tokens:
        return _reject(state, msg, "invalid")
    if state.cap_bytes == 0:
        return _reject(state, msg, "disabled")
    if msg.meta.nbytes > state.cap_bytes:
        return _reject(state, msg, "too_large")

    duplicate, ancestors = _displaced(state, msg)
    # NOTE: leased bytes stay retained whatever happens to their entries
    # (a displaced leased entry becomes pinned); only unleased entries can make room.
    unfreeable = sum(
        e.meta.nbytes for e in state.entries.values() if not e.indexed or e.leases > 0
    )
    if unfreeable + msg.meta.nbytes > state.cap_bytes:
        return _reject(state, msg, "no_room")

    effects: list[Effect] = []
    if duplicate is not None:
        effects += _unindex(state, duplicate, "dispose")
    for ancestor in ancestors:
        effects += _unindex(state, ancestor, "dispose")

    entry = Entry(
        handle=msg.handle,
        namespace=msg.namespace,
        tokens=msg.tokens,
        meta=msg.meta,
        last_used=0,
    )
    _touch(state, entry, now)
    state.entries[entry.handle] = entry
    state.by_namespace.setdefault(msg.namespace, {})[msg.tokens] = entry.handle
    state.indexed_bytes += msg.meta.nbytes
    _record(state, "stored", entry)

    evicted = 0
    excess = retained_bytes(state) - state.cap_bytes
    while excess > 0:
        # Terminates: the fit check above left enough unleased bytes to evict.
        victim = min(
            (e for e in state.entries.values() if e.indexed and e.leases == 0 and e is not entry),
            key=lambda e: e.last_used,
        )
        excess -= victim.meta.nbytes
        effects += _unindex(state, victim, "spill")
        evicted += 1

    if state.notify_puts:
        effects.append(NotifyPut(msg.namespace, msg.tokens, msg.handle))
    replaced = int(duplicate is not None)
    state.stored += 1
    state.replaced += replaced
    state.superseded += len(ancestors)
    state.evicted += evicted
    effects.append(
        Reply(
            PutResult(
                stored=True, replaced=replaced, superseded=len(ancestors), evicted=evicted
            )
        )
    )
    return effects


def _demotable(state: CoreState) -> list[Entry]:
    """Indexed entries a demotion may take (no lease), least recently used first."""
    return sorted(
        (e for e in state.entries.values() if e.indexed and e.leases == 0),
        key=lambda e: e.used_at,
    )


def demote_idle(state: CoreState, now: float) -> list[Effect]:
    """Hand entries unused for ``demote_idle_s`` to the cold tier (and drop them from RAM).

    At most ``demote_batch`` per scan and one scan per ``demote_scan_s``, so
    a burst of idle entries reaches the spill queue a few at a time.
    """
    if state.demote_idle_s <= 0 or not state.spill_enabled or now < state.next_demote_scan:
        return []
    idle = [e for e in _demotable(state) if now - e.used_at >= state.demote_idle_s]
    if not idle:
        return []
    state.next_demote_scan = now + state.demote_scan_s
    effects: list[Effect] = []
    for entry in idle[: state.demote_batch]:
        state.demotions += 1
        effects += _unindex(state, entry, "demote")
    return effects


def demote(state: CoreState, msg: Demote, now: float) -> list[Effect]:
    """Hand unleased entries idle for ``msg.idle_s`` to the cold tier now (admin drain, memory relief).

    Least recently used first, until ``msg.max_bytes`` were handed (``None``:
    all). Unlike :func:`demote_idle` there is no batch limit: the asker
    wants them out of RAM now. Without a cold tier they are disposed only
    when ``msg.dispose_without_tier`` says so. Leased entries stay.
    """
    leased = sum(1 for e in state.entries.values() if e.indexed and e.leases > 0)
    to_tier = state.spill_enabled
    effects: list[Effect] = []
    handed = handed_bytes = 0
    if to_tier or msg.dispose_without_tier:
        for entry in _demotable(state):
            if msg.max_bytes is not None and handed_bytes >= msg.max_bytes:
                break
            if now - entry.used_at < msg.idle_s:
                continue
            handed += 1
            handed_bytes += entry.meta.nbytes
            if to_tier:
                state.demotions += 1
            effects += _unindex(state, entry, "demote" if to_tier else "dispose")
    left = [e for e in state.entries.values() if e.indexed]
    result = DemoteResult(
        spilled=handed if to_tier else 0,
        spilled_bytes=handed_bytes if to_tier else 0,
        disposed=0 if to_tier else handed,
        disposed_bytes=0 if to_tier else handed_bytes,
        leased=leased,
        left=len(left),
        left_bytes=sum(e.meta.nbytes for e in left),
    )
    return [*effects, Reply(result)]


# --- leases ------------------------------------------------------------------------------


def release(state: CoreState, msg: Release) -> list[Effect]:
    """End a lease; an entry already out of the index is finished on its last release."""
    lease = state.leases.pop(msg.lease_id, None)
    if lease is None:
        return []  # NOTE: unknown, expired or already released: releasing is idempotent.
    if lease.handle is None:
        # NOTE: a no-op when the holder already took the bytes to materialize them.
        return [DiscardStaged(lease.staging_id)] if lease.staging_id is not None else []
    entry = state.entries[lease.handle]
    entry.leases -= 1
    if entry.leases == 0 and not entry.indexed:
        return _finish(state, entry)
    return []


def expire_leases(state: CoreState, now: float) -> list[Effect]:
    """End every lease whose deadline is ``now`` or earlier (its holder never released it)."""
    expired = [lease_id for lease_id, lease in state.leases.items() if lease.deadline <= now]
    effects: list[Effect] = []
    for lease_id in expired:
        state.leases_expired += 1
        effects += release(state, Release(lease_id=lease_id))
    return effects


def lease_undelivered(state: CoreState, event: LeaseUndelivered) -> list[Effect]:
    """The lease's grant reached nobody, so nobody will release it: end it now."""
    if event.lease_id in state.leases:
        state.leases_undelivered += 1
    return release(state, Release(lease_id=event.lease_id))


def spill_undelivered(state: CoreState, event: SpillUndelivered) -> list[Effect]:
    """The cold tier's queue did not take the entry: ownership stayed here, dispose it."""
    state.spilled -= 1
    state.spills_undelivered += 1
    return [_dispose(state, event.message.handle, event.message.meta.nbytes)]


# --- drains -------------------------------------------------------------------------------


def drain_done(state: CoreState, msg: TurnDone) -> list[Effect]:
    """The gateway answered a drain request: the arrays it covered are gone (if it ran)."""
    if state.drain_in_flight is None or msg.step_id != state.drain_in_flight:
        return []
    state.drain_in_flight = None
    if not msg.ok:
        # NOTE: not re-requested now (turns may be stopped for good); the next
        # disposal asks again, and every request turn drains as well.
        state.drains_refused += 1
        state.undrained += state.draining
        state.undrained_bytes += state.draining_bytes
        state.draining = state.draining_bytes = 0
        return []
    state.draining = state.draining_bytes = 0
    # NOTE: disposals made after the request may have missed the drain that ran.
    return _start_drain(state) if state.undrained else []


def _request_drain(state: CoreState, requested_before: int) -> list[Effect]:
    """Ask for a drain when this message disposed something and none is in flight."""
    if state.drain_in_flight is not None or state.disposed == requested_before:
        return []
    return _start_drain(state) if state.undrained else []


def _start_drain(state: CoreState) -> list[Effect]:
    if state.drain_step is None:
        return []
    state.drains_requested += 1
    step_id = state.drain_step
    state.drain_in_flight = step_id
    state.draining, state.draining_bytes = state.undrained, state.undrained_bytes
    state.undrained = state.undrained_bytes = 0
    return [RequestDrain(step_id)]


# --- time ------------------------------------------------------------------------------------


def next_wake(state: CoreState) -> float | None:
    """When something becomes due without a message: a lookup deadline, a lease
    deadline, the next idle demotion (``None``: nothing)."""
    times = [p.deadline for p in state.pending.values()]
    times += [lease.deadline for lease in state.leases.values()]
    if state.demote_idle_s > 0 and state.spill_enabled:
        oldest = min((e.used_at for e in _demotable(state)), default=None)
        if oldest is not None:
            times.append(max(oldest + state.demote_idle_s, state.next_demote_scan))
    return min(times, default=None)


def _alarm(state: CoreState) -> list[Effect]:
    wake = next_wake(state)
    if wake == state.alarm_at:
        return []
    state.alarm_at = wake
    return [SetAlarm(wake)]


# --- queries, stop, dispatch ---------------------------------------------------------------


def stats(state: CoreState) -> PromptCacheStats:
    """The stats snapshot of ``state``."""
    pinned = [e for e in state.entries.values() if not e.indexed]
    pending = state.undrained + state.draining
    pending_bytes = state.undrained_bytes + state.draining_bytes
    return PromptCacheStats(
        cap_bytes=state.cap_bytes,
        entries=len(state.entries) - len(pinned),
        bytes=state.indexed_bytes,
        pinned_entries=len(pinned),
        pinned_bytes=sum(e.meta.nbytes for e in pinned),
        retained_bytes=state.indexed_bytes + sum(e.meta.nbytes for e in pinned),
        active_leases=len(state.leases),
        hits=state.hits,
        misses=state.misses,
        cached_tokens_served=state.cached_tokens_served,
        puts=state.puts,
        stored=state.stored,
        rejected_too_large=state.rejected_too_large,
        rejected_no_room=state.rejected_no_room,
        replaced=state.replaced,
        superseded=state.superseded,
        evicted=state.evicted,
        spilled=state.spilled,
        disposed=state.disposed,
        pending_disposals=pending,
        pending_disposal_bytes=pending_bytes,
        leases_expired=state.leases_expired,
        leases_undelivered=state.leases_undelivered,
        spills_undelivered=state.spills_undelivered,
        drains_requested=state.drains_requested,
        ssd_hits=state.ssd_hits,
        ssd_cached_tokens_served=state.ssd_cached_tokens_served,
        ssd_lookups=state.ssd_lookups,
        ssd_lookups_skipped=state.ssd_lookups_skipped,
        ssd_recompute=state.ssd_recompute,
        ssd_failures=state.ssd_failures,
        ssd_timeouts=state.ssd_timeouts,
        demotions=state.demotions,
    )


def dispose_all(state: CoreState) -> list[Effect]:
    """Drop every indexed entry (shutdown/clear); leased ones finish on release."""
    effects: list[Effect] = []
    for entry in sorted(
        (e for e in state.entries.values() if e.indexed), key=lambda e: e.last_used
    ):
        effects += _unindex(state, entry, "dispose")
    return effects


def stop(state: CoreState) -> list[Effect]:
    """The actor stops: answer every cold lookup from RAM, then drop every indexed entry."""
    effects: list[Effect] = []
    for pending in list(state.pending.values()):
        effects += _answer_ram(state, pending)
    state.alarm_at = None
    return [*effects, *dispose_all(state), SetAlarm(None)]


def _received(state: CoreState, envelope: Envelope, now: float) -> list[Effect]:
    message = envelope.body
    if isinstance(message, Take):
        return _take_received(state, envelope, message, now)
    if isinstance(message, Put):
        return put(state, message, now)
    if isinstance(message, Release):
        return release(state, message)
    if isinstance(message, PromptCacheStatsRequest):
        return [Reply(stats(state))]
    if isinstance(message, Demote):
        return demote(state, message, now)
    if isinstance(message, TurnDone):
        return drain_done(state, message)
    if isinstance(message, PromptCacheWake):
        # NOTE: the timer fired, so none is set now; what is due runs for
        # every message (see handle), and the next alarm is set again even
        # if the timer fired a little early.
        state.alarm_at = None
        return []
    if isinstance(message, FindResult):
        pending = state.pending.get(state.asks.get(envelope.causation_id or "", ""))
        return [] if pending is None else _find_answered(state, pending, message)
    if isinstance(message, RestoreResult):
        return _restore_answered(state, envelope, message, now)
    if isinstance(message, Failure):
        # NOTE: the SSD index's handler raised on our ask: a miss for the cold tier.
        pending = state.pending.get(state.asks.get(envelope.causation_id or "", ""))
        return [] if pending is None else _cold_failed(state, pending)
    raise UnknownPromptCacheMessage(f"prompt cache has no rule for {message.kind!r}")


def handle(state: CoreState, event: Event) -> tuple[CoreState, list[Effect]]:
    """Apply one event; return the state and the effects to perform, in order.

    Leases and cold lookups past their deadline end first, and idle entries
    are demoted when a scan is due. A message that disposed something ends
    with :class:`RequestDrain` when no drain is in flight (and the state
    names a drain step); a change of the next due time ends with
    :class:`SetAlarm`.
    """
    now = event.now
    before = state.disposed
    effects = expire_leases(state, now)
    effects += _expire_lookups(state, now)
    match event:
        case Received():
            effects += _received(state, event.envelope, now)
        case LeaseUndelivered():
            effects += lease_undelivered(state, event)
        case SpillUndelivered():
            effects += spill_undelivered(state, event)
        case ColdAskSent():
            effects += _ask_sent(state, event)
        case ColdAskUndelivered():
            effects += _ask_undelivered(state, event)
        case DrainUndelivered():
            refused = TurnDone(step_id=event.step_id, ok=False, error_code="undelivered")
            effects += drain_done(state, refused)
        case Started():
            state.alarm_at = None
        case Stopping():
            effects += stop(state)
            return state, [*effects, *_tier_report(state)]
        case _:
            assert_never(event)
    effects += demote_idle(state, now)
    effects += _request_drain(state, before)
    effects += _alarm(state)
    effects += _tier_report(state)
    return state, effects
