"""The RAM prompt cache's rules as a sans-IO core: ``handle(state, message, now) -> (state, effects)``.

Pure Python over token tuples and :class:`messages.EntryMeta`; no arrays, no
I/O, no clock (the shell passes ``now`` from the injected clock). The actor
shell (``actors/prompt_cache/actor.py``) performs the effects: :class:`Reply`
answers the request, :class:`Dispose` hands a handle back to the registry,
:class:`Spill` sends the entry to the cold tier's queue (which then owns its
disposal), :class:`RequestDrain` asks the gateway for a background engine
turn that drops disposed arrays. The shell reports what it could not do as
events (:class:`LeaseUndelivered`, :class:`SpillUndelivered`). The rules are
written down in ``docs/prompt-cache.md``.

Invariants kept by every function here:

- the bytes the cache retains never exceed ``cap_bytes``: indexed entries
  plus pinned ones (evicted, replaced or superseded while a lease held them,
  kept until the last ``Release``). NOTE: pinned bytes count because the
  arrays stay alive until the release; a ``Put`` that cannot fit beside the
  leased and pinned bytes is refused (``reason="no_room"``) rather than
  breaking the cap;
- a leased entry is never chosen for eviction (evicting it would free
  nothing until its release);
- a handle is disposed or spilled exactly once, and never while leased;
- entries of different namespaces never serve each other;
- a lease ends exactly once: by ``Release``, when its ``TakeResult`` could
  not be delivered, or when its deadline (``lease_ttl_s`` after the
  ``Take``) has passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from messages import (
    Body,
    EntryMeta,
    PromptCacheStats,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Take,
    TakeResult,
)
from messages.gateway import TurnDone
from messages.spill_queue import Enqueue

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "CoreState",
    "Dispose",
    "Effect",
    "Entry",
    "Event",
    "Lease",
    "LeaseUndelivered",
    "Reply",
    "RequestDrain",
    "Spill",
    "SpillUndelivered",
    "UnknownPromptCacheMessage",
    "common_prefix_len",
    "dispose_all",
    "expire_leases",
    "handle",
    "pinned_bytes",
    "put",
    "release",
    "retained_bytes",
    "stats",
    "take",
]

DEFAULT_LEASE_TTL_S = 300.0
"""How long a lease may live before the cache ends it (see :class:`Lease`)."""


class UnknownPromptCacheMessage(TypeError):
    """A body the prompt cache has no rule for."""


@dataclass(frozen=True)
class Reply:
    """Answer the request being handled with ``body``.

    A ``TakeResult`` holding a lease that cannot be delivered (the asker's
    deadline passed, or the Take was a tell) comes back as :class:`LeaseUndelivered`.
    """

    body: Body


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


Effect = Reply | Dispose | Spill | RequestDrain


@dataclass(frozen=True)
class LeaseUndelivered:
    """Shell event: the ``TakeResult`` granting ``lease_id`` reached nobody."""

    lease_id: str


@dataclass(frozen=True)
class SpillUndelivered:
    """Shell event: the cold tier's queue did not take ``message`` (full, stopped, gone)."""

    message: Enqueue


Event = Body | LeaseUndelivered | SpillUndelivered
"""What :func:`handle` accepts: a message body, or a fact the shell reports."""


@dataclass
class Lease:
    """One lease on an entry. ``deadline``: when the cache ends it if nobody released it.

    NOTE: a lease lives from ``Take`` until the holder materialized its views
    (or failed). A holder that died (its task cancelled, its actor restarted)
    never releases; the deadline bounds how long such a lease pins its entry.
    Ending a lease early is safe: the holder's later ``materialize`` finds
    the handle gone and serves a miss, never wrong KV.
    """

    handle: str
    deadline: float

_Fate = Literal["dispose", "spill"]


@dataclass
class Entry:
    """One stored prefix entry (indexed, or pinned by leases after leaving the index)."""

    handle: str
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta
    last_used: int
    leases: int = 0
    indexed: bool = True
    fate: _Fate = "dispose"
    """What happens once an unindexed entry's last lease is released."""


@dataclass
class CoreState:
    """Everything the rules know (mutated in place and returned by :func:`handle`).

    ``spill_enabled``: a cold tier's queue receives spills (else they are
    disposed). ``drain_step``: the background step that drops disposed
    arrays (``None``: no drain is requested; the engine drains at its next
    turn). ``lease_ttl_s``: how long a lease may live.
    """

    cap_bytes: int
    spill_enabled: bool = False
    drain_step: str | None = None
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    entries: dict[str, Entry] = field(default_factory=dict)
    by_namespace: dict[str, dict[tuple[int, ...], str]] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    indexed_bytes: int = 0
    tick: int = 0
    lease_seq: int = 0
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


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples.

    NOTE: binary search over slice equality keeps the element comparisons in
    C; a Python loop over 3k-token prompts per entry would stall the loop.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
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


def _touch(state: CoreState, entry: Entry) -> None:
    state.tick += 1
    entry.last_used = state.tick


def take(state: CoreState, msg: Take, now: float = 0.0) -> list[Effect]:
    """Lease the entry with the longest usable prefix of ``msg.tokens`` (or miss).

    The lease ends by ``Release``, or ``state.lease_ttl_s`` after ``now``.
    """
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
    if best is None:
        state.misses += 1
        return [Reply(TakeResult())]
    state.hits += 1
    state.cached_tokens_served += best_usable
    state.lease_seq += 1
    lease_id = f"lease-{state.lease_seq}"
    state.leases[lease_id] = Lease(best.handle, now + state.lease_ttl_s)
    best.leases += 1
    _touch(state, best)
    return [
        Reply(
            TakeResult(
                lease_id=lease_id,
                handle=best.handle,
                cached_tokens=best_usable,
                entry_tokens=len(best.tokens),
            )
        )
    ]


def _dispose(state: CoreState, handle_id: str, nbytes: int) -> Dispose:
    """Count a disposal (and its arrays, until a drain drops them)."""
    state.disposed += 1
    if state.drain_step is not None:
        state.undrained += 1
        state.undrained_bytes += nbytes
    return Dispose(handle_id)


def _spill(
    state: CoreState, handle_id: str, namespace: str, tokens: tuple[int, ...], meta: EntryMeta
) -> Spill:
    state.spilled += 1
    return Spill(
        Enqueue(handle=handle_id, namespace=namespace, tokens=tokens, meta=meta, source="evict")
    )


def _finish(state: CoreState, entry: Entry) -> list[Effect]:
    """Dispose or spill an entry that left the index and holds no lease."""
    del state.entries[entry.handle]
    if entry.fate == "spill" and state.spill_enabled:
        return [_spill(state, entry.handle, entry.namespace, entry.tokens, entry.meta)]
    return [_dispose(state, entry.handle, entry.meta.nbytes)]


def _unindex(state: CoreState, entry: Entry, fate: _Fate) -> list[Effect]:
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


def put(state: CoreState, msg: Put) -> list[Effect]:
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
    _touch(state, entry)
    state.entries[entry.handle] = entry
    state.by_namespace.setdefault(msg.namespace, {})[msg.tokens] = entry.handle
    state.indexed_bytes += msg.meta.nbytes

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


def release(state: CoreState, msg: Release) -> list[Effect]:
    """End a lease; an entry already out of the index is finished on its last release."""
    lease = state.leases.pop(msg.lease_id, None)
    if lease is None:
        return []  # NOTE: unknown, expired or already released: releasing is idempotent.
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
    )


def dispose_all(state: CoreState) -> list[Effect]:
    """Drop every indexed entry (shutdown/clear); leased ones finish on release."""
    effects: list[Effect] = []
    for entry in sorted(
        (e for e in state.entries.values() if e.indexed), key=lambda e: e.last_used
    ):
        effects += _unindex(state, entry, "dispose")
    return effects


def handle(state: CoreState, message: Event, now: float) -> tuple[CoreState, list[Effect]]:
    """Apply one message (or shell event) at time ``now``; return the state and effects, in order.

    Leases past their deadline end first. A message that disposed something
    ends with :class:`RequestDrain` when no drain is in flight (and the
    state names a drain step), so disposed arrays do not wait for a request.
    """
    before = state.disposed
    effects = expire_leases(state, now)
    if isinstance(message, Take):
        effects += take(state, message, now)
    elif isinstance(message, Put):
        effects += put(state, message)
    elif isinstance(message, Release):
        effects += release(state, message)
    elif isinstance(message, PromptCacheStatsRequest):
        effects.append(Reply(stats(state)))
    elif isinstance(message, TurnDone):
        effects += drain_done(state, message)
    elif isinstance(message, LeaseUndelivered):
        effects += lease_undelivered(state, message)
    elif isinstance(message, SpillUndelivered):
        effects += spill_undelivered(state, message)
    else:
        raise UnknownPromptCacheMessage(f"prompt cache has no rule for {message.kind!r}")
    effects += _request_drain(state, before)
    return state, effects
