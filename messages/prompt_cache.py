"""Messages of the RAM prompt cache (``actors.prompt_cache.PromptCache``).

Tensors never travel here: an entry's KV lives in the engine thread's
``kernels.CacheRegistry`` and messages carry its opaque ``handle`` id plus the
facts the rules need (:class:`EntryMeta`). Token sequences travel as tuples of
ids so a trace replays without a tokenizer.

Protocol (the full walk-through is ``docs/prompt-cache.md``):

1. ``Take`` (ask) before prefill -> ``TakeResult``. On a hit the reply names a
   ``handle`` and a ``lease_id``; the gateway materializes zero-copy views of
   the first ``cached_tokens`` tokens on the engine thread and forwards only
   the rest of the prompt.
2. ``Release(lease_id)`` (tell) once the views were materialized (or the
   request failed before that). Every hit must be released exactly once.
3. ``Put`` (tell, or ask for a ``PutResult``) with a handle registered on the
   engine thread: after completion (prompt + reply) and, for chat requests,
   the prompt-boundary snapshot after prefill. Ownership of the handle passes
   to the cache with the ``Put``: the caller must not dispose it afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ._base import Body, Request

__all__ = [
    "CACHE_SALT_MAX_CHARS",
    "Demote",
    "DemoteResult",
    "EntryMeta",
    "EntryRole",
    "PromptCacheStats",
    "PromptCacheStatsRequest",
    "PromptCacheWake",
    "Put",
    "PutResult",
    "Release",
    "Take",
    "TakeResult",
    "cache_namespace",
]

CACHE_SALT_MAX_CHARS = 256
"""Longest ``cache_salt`` (and ``cache_scope``) a request may carry, in characters."""

_NAMESPACE_DOMAIN = b"kvtier.cache-namespace.v1\x00"
_ISOLATION_MARK = "#iso:"


def _part(value: str | None) -> bytes:
    """One length-prefixed field of the namespace digest (``None`` differs from every string)."""
    if value is None:
        return b"\x00"
    # NOTE: surrogatepass: an embedder's string may hold a lone surrogate
    # (JSON bodies cannot); the encoding stays one-to-one and never raises.
    raw = value.encode("utf-8", "surrogatepass")
    return b"\x01" + len(raw).to_bytes(4, "big") + raw


def cache_namespace(salt: str | None = None, scope: str | None = None, *, base: str = "") -> str:
    """The prompt-cache namespace of a request: cached KV is shared only inside one namespace.

    ``base`` keeps KV of different adapters apart (``""``: the base model).
    ``salt`` is the request's ``cache_salt``; ``scope`` is set by the server,
    not the client (``--cache-namespace api-key``: a digest of the request's
    API key). Without either the namespace is ``base`` (every client shares
    it); with either it is ``base`` plus ``#iso:`` and a 128-bit SHA-256
    digest of both, so requests share cached prefixes only when base, scope
    and salt all match, and a salt given under one scope never meets the same
    salt under another.

    NOTE: a digest, never the salt or key itself: the namespace is written
    into every SSD file's header and travels in traced messages. Fields are
    length-prefixed and ``None`` is encoded apart from every string, so no
    two different (scope, salt) pairs give the same digest input.
    """
    if salt is None and scope is None:
        return base
    digest = hashlib.sha256(_NAMESPACE_DOMAIN + _part(scope) + _part(salt)).hexdigest()[:32]
    return f"{base}{_ISOLATION_MARK}{digest}"

EntryRole = Literal["completion", "snapshot"]
"""``completion``: prompt + generated tokens, put when a request finishes;
``snapshot``: the prompt-only entry put after prefill (chat requests)."""


class EntryMeta(BaseModel):
    """What the rules need to know about a registered cache (made on the engine thread).

    ``offset``: tokens the cache covers (every layer agrees). ``nbytes``: bytes
    the entry really retains (whole buffers behind any views).
    ``trimmable``: every layer can drop trailing tokens.
    ``min_reusable_offset``: the shortest prefix the entry may be trimmed to
    (the maximum over layers; equals ``offset`` for recurrent state).
    ``signatures``: per-layer cache signatures (``kv:plain``, ``ssm``, ...).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    trimmable: bool
    min_reusable_offset: int = Field(ge=0)
    signatures: tuple[str, ...] = ()


class Take(Request):
    """Ask for the longest usable cached prefix of ``tokens`` in ``namespace``.

    ``namespace`` (:func:`cache_namespace`) keeps KV of different adapters and
    different ``cache_salt``/API-key scopes apart (``""`` = the base model,
    shared by every client): entries of one namespace never serve another's
    prompts. The reply is a :class:`TakeResult`.
    """

    kind: Literal["prompt_cache.take"] = "prompt_cache.take"
    tokens: tuple[int, ...]
    namespace: str = ""


class TakeResult(Body):
    """The answer to :class:`Take`.

    On a miss ``lease_id``, ``handle`` and ``staging_id`` are ``None`` and
    ``cached_tokens`` is 0. On a hit ``cached_tokens`` (>= 1, <= len(prompt) - 1)
    is the prefix length to reuse; ``entry_tokens`` is the stored entry's
    length (> ``cached_tokens`` means a trim). ``tier`` says where it came from:

    - ``ram``: materialize views of ``handle``
      (``registry.materialize(handle, cached_tokens)``);
    - ``ssd``: the cold tier read the entry's file into host memory, where it
      waits under ``staging_id`` (``actors.ssd_writer.HostStaging``) to be
      materialized into MLX arrays and trimmed in the request's first turn.

    Either way the hit holds a lease: release it once (after materializing,
    or on any failure before). Releasing an ``ssd`` lease drops the staged
    bytes if nobody took them.
    """

    kind: Literal["prompt_cache.take_result"] = "prompt_cache.take_result"
    lease_id: str | None = None
    handle: str | None = None
    cached_tokens: int = Field(default=0, ge=0)
    entry_tokens: int = Field(default=0, ge=0)
    staging_id: str | None = None
    tier: Literal["ram", "ssd"] | None = None


class Release(Body):
    """End a lease from a hit; the leased entry may be disposed only after this."""

    kind: Literal["prompt_cache.release"] = "prompt_cache.release"
    lease_id: str


class Put(Request):
    """Hand a registered cache to the prompt cache under ``tokens`` in ``namespace``.

    ``tokens`` must have exactly ``meta.offset`` ids. Tell it (``reply_to``
    empty) in serving; ask it to get a :class:`PutResult`.
    """

    kind: Literal["prompt_cache.put"] = "prompt_cache.put"
    tokens: tuple[int, ...]
    namespace: str = ""
    handle: str
    meta: EntryMeta
    role: EntryRole = "completion"


class PutResult(Body):
    """What a :class:`Put` did: stored or why not, and what it displaced.

    ``too_large``: the entry alone exceeds the cap. ``no_room``: it would fit
    the cap, but not beside the bytes that leases keep alive (leased and
    pinned entries cannot be evicted to make room).
    """

    kind: Literal["prompt_cache.put_result"] = "prompt_cache.put_result"
    stored: bool
    reason: Literal["stored", "disabled", "too_large", "no_room", "invalid"] = "stored"
    replaced: int = Field(default=0, ge=0)
    superseded: int = Field(default=0, ge=0)
    evicted: int = Field(default=0, ge=0)


class PromptCacheStatsRequest(Request):
    """Ask for :class:`PromptCacheStats`."""

    kind: Literal["prompt_cache.stats_request"] = "prompt_cache.stats_request"


class PromptCacheStats(Body):
    """Counters and gauges of the RAM tier.

    ``bytes`` counts indexed entries; ``pinned_bytes`` counts entries already
    evicted or replaced but still held by a lease (they are disposed on
    ``Release``); ``retained_bytes`` is their sum, which never exceeds
    ``cap_bytes``. ``hits``/``misses`` count ``Take`` answers.

    ``pending_disposals``/``pending_disposal_bytes``: entries the cache gave
    up whose arrays no confirmed engine turn has dropped yet (outside the
    cap; a drain turn is asked for at once and confirmed by the next request
    or batch turn granted after the ask, or by an idle turn: under load it
    holds at most the disposals of about two turns (step chains, seconds
    long), and it returns to 0 on an idle server). ``leases_expired``: leases ended by their deadline;
    ``leases_undelivered``: leases whose ``TakeResult`` reached nobody (both
    would otherwise pin their entry forever). ``spills_undelivered``: spills
    the cold tier's queue could not take (disposed instead).

    With a cold tier: ``hits``/``cached_tokens_served`` count the RAM tier's
    hits, ``ssd_hits``/``ssd_cached_tokens_served`` the ones served by a file
    (``misses``: neither). ``ssd_lookups``: takes that asked the SSD index;
    ``ssd_lookups_skipped``: takes that did not, because the prompt's rest
    past RAM's hit was shorter than any file the index offers may add;
    ``ssd_recompute``: a longer file existed but prefilling was predicted
    faster; ``ssd_failures``: a restore that failed (corrupt file, I/O error,
    tier gone) and was served as a miss; ``ssd_timeouts``: lookups that ran
    past their deadline (also served from RAM or as a miss). ``demotions``:
    RAM entries idle for ``ssd_demote_idle`` seconds handed to the cold tier.
    """

    kind: Literal["prompt_cache.stats"] = "prompt_cache.stats"
    cap_bytes: int
    entries: int
    bytes: int
    pinned_entries: int
    pinned_bytes: int
    retained_bytes: int
    active_leases: int
    hits: int
    misses: int
    cached_tokens_served: int
    puts: int
    stored: int
    rejected_too_large: int
    rejected_no_room: int
    replaced: int
    superseded: int
    evicted: int
    spilled: int
    disposed: int
    pending_disposals: int = 0
    pending_disposal_bytes: int = 0
    leases_expired: int = 0
    leases_undelivered: int = 0
    spills_undelivered: int = 0
    drains_requested: int = 0
    ssd_hits: int = 0
    ssd_cached_tokens_served: int = 0
    ssd_lookups: int = 0
    ssd_lookups_skipped: int = 0
    ssd_recompute: int = 0
    ssd_failures: int = 0
    ssd_timeouts: int = 0
    demotions: int = 0


class Demote(Request):
    """Hand unleased RAM entries to the cold tier NOW, least recently used first (ask).

    Entries unused for at least ``idle_s`` seconds qualify (0: every unleased
    entry); ``max_bytes`` stops once that many bytes were handed (``None``:
    no limit). With a cold tier each one leaves RAM as a spill
    (``source="demote"``) and the spill queue owns it from then on. Without
    one, ``dispose_without_tier`` drops them instead (memory-pressure
    relief); otherwise nothing moves. Answered with :class:`DemoteResult`.
    """

    kind: Literal["prompt_cache.demote"] = "prompt_cache.demote"
    idle_s: float = Field(default=0.0, ge=0)
    max_bytes: int | None = Field(default=None, ge=0)
    dispose_without_tier: bool = False


class DemoteResult(Body):
    """What a :class:`Demote` did: entries handed to the cold tier, or dropped without one.

    ``spilled``/``spilled_bytes``: sent to the spill queue; ``disposed``/
    ``disposed_bytes``: dropped without a tier; ``leased``: entries skipped
    because a request holds them; ``left``/``left_bytes``: indexed entries
    still in RAM afterwards.
    """

    kind: Literal["prompt_cache.demote_result"] = "prompt_cache.demote_result"
    spilled: int = Field(default=0, ge=0)
    spilled_bytes: int = Field(default=0, ge=0)
    disposed: int = Field(default=0, ge=0)
    disposed_bytes: int = Field(default=0, ge=0)
    leased: int = Field(default=0, ge=0)
    left: int = Field(default=0, ge=0)
    left_bytes: int = Field(default=0, ge=0)


class PromptCacheWake(Body):
    """The prompt cache's alarm went off (sent to itself): idle demotions and lookup deadlines are due."""

    kind: Literal["prompt_cache.wake"] = "prompt_cache.wake"
