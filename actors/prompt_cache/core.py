"""The RAM prompt cache's rules as a sans-IO core: state + message -> effects.

Pure Python over token tuples and :class:`messages.EntryMeta`; no arrays, no
I/O, no clock. The actor shell (``actors/prompt_cache.py``) performs the
effects: :class:`Reply` answers the request, :class:`Dispose` hands a handle
back to the registry, :class:`Spill` hands it to the cold tier (which then
owns its disposal). The rules are written down in ``docs/prompt-cache.md``.

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
- entries of different namespaces never serve each other.
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

__all__ = [
    "CoreState",
    "Dispose",
    "Effect",
    "Entry",
    "Reply",
    "Spill",
    "UnknownPromptCacheMessage",
    "common_prefix_len",
    "dispose_all",
    "handle",
    "pinned_bytes",
    "put",
    "release",
    "retained_bytes",
    "stats",
    "take",
]


class UnknownPromptCacheMessage(TypeError):
    """A body the prompt cache has no rule for."""


@dataclass(frozen=True)
class Reply:
    """Answer the request being handled with ``body`` (dropped when it was a tell)."""

    body: Body


@dataclass(frozen=True)
class Dispose:
    """Give ``handle``'s arrays back (``CacheRegistry.dispose``)."""

    handle: str


@dataclass(frozen=True)
class Spill:
    """Hand an evicted entry to the cold tier, which now owns ``handle``'s disposal."""

    handle: str
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta


Effect = Reply | Dispose | Spill

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
    """Everything the rules know. ``spill_enabled``: a cold tier is attached."""

    cap_bytes: int
    spill_enabled: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)
    by_namespace: dict[str, dict[tuple[int, ...], str]] = field(default_factory=dict)
    leases: dict[str, str] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError("cap_bytes cannot be negative")


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


def take(state: CoreState, msg: Take) -> list[Effect]:
    """Lease the entry with the longest usable prefix of ``msg.tokens`` (or miss)."""
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
    state.leases[lease_id] = best.handle
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


def _finish(state: CoreState, entry: Entry) -> list[Effect]:
    """Dispose or spill an entry that left the index and holds no lease."""
    del state.entries[entry.handle]
    if entry.fate == "spill" and state.spill_enabled:
        state.spilled += 1
        return [Spill(entry.handle, entry.namespace, entry.tokens, entry.meta)]
    state.disposed += 1
    return [Dispose(entry.handle)]


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
        state.spilled += 1
        effects = [Spill(msg.handle, msg.namespace, msg.tokens, msg.meta)]
    elif reason == "invalid" and msg.handle in state.entries:
        effects = []  # NOTE: already ours; disposing it here would double-dispose.
    else:
        state.disposed += 1
        effects = [Dispose(msg.handle)]
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
    handle_id = state.leases.pop(msg.lease_id, None)
    if handle_id is None:
        return []  # NOTE: unknown or already released: releasing is idempotent.
    entry = state.entries[handle_id]
    entry.leases -= 1
    if entry.leases == 0 and not entry.indexed:
        return _finish(state, entry)
    return []


def stats(state: CoreState) -> PromptCacheStats:
    """The stats snapshot of ``state``."""
    pinned = [e for e in state.entries.values() if not e.indexed]
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
    )


def dispose_all(state: CoreState) -> list[Effect]:
    """Drop every indexed entry (shutdown/clear); leased ones finish on release."""
    effects: list[Effect] = []
    for entry in sorted(
        (e for e in state.entries.values() if e.indexed), key=lambda e: e.last_used
    ):
        effects += _unindex(state, entry, "dispose")
    return effects


def handle(state: CoreState, body: Body) -> list[Effect]:
    """Apply one message to ``state`` and return the effects to perform, in order."""
    if isinstance(body, Take):
        return take(state, body)
    if isinstance(body, Put):
        return put(state, body)
    if isinstance(body, Release):
        return release(state, body)
    if isinstance(body, PromptCacheStatsRequest):
        return [Reply(stats(state))]
    raise UnknownPromptCacheMessage(f"prompt cache has no rule for {body.kind!r}")
