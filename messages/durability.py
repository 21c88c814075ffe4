"""Messages of the durability coordinator (``actors.durability``).

The coordinator turns RAM-tier puts into a state machine whose question is
"is it on disk now?". Every put becomes a *dirty record* keyed by its
namespace and EXACT token sequence; write-behind snapshots it to the SSD tier
after a debounce, and a flush forces every dirty record to a durable
boundary and says, with evidence, whether it got there. The walk-through is
``docs/durability.md``.

Public protocol:

- ``Schedule`` (tell, never dropped: send it with a waiting ``tell``): a
  put stored the RAM entry behind ``handle`` under ``tokens``.
- ``Flush`` (ask) -> ``FlushResult``.
- ``FlushAll`` (ask) -> ``FlushResult``: the whole sequence behind
  ``Engine.flush`` and shutdown: a barrier through the prompt cache, the
  flush, the spill queue's drain.
- ``DurabilityStatsRequest`` (ask) -> ``DurabilityStats``.

Internal: ``Wake`` (the coordinator's alarm, sent to itself).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request

__all__ = [
    "DurabilityStats",
    "DurabilityStatsRequest",
    "Flush",
    "FlushAll",
    "FlushResult",
    "Schedule",
    "Wake",
]


class Schedule(Body):
    """A put stored ``handle``'s entry under ``tokens`` in ``namespace``: that prefix is dirty.

    ``handle`` is the RAM tier's handle (owned by the prompt cache; the
    coordinator only clones it in an engine turn, never disposes it). A
    second ``Schedule`` of the same (namespace, tokens) replaces the record's
    handle and makes it a new version; the same tokens in another namespace,
    or other tokens of the same length, are another record.
    """

    kind: Literal["durability.schedule"] = "durability.schedule"
    namespace: str = ""
    tokens: tuple[int, ...] = Field(min_length=1)
    handle: str = Field(min_length=1)


class Flush(Request):
    """Force every dirty record to the SSD tier and report whether the state is durable."""

    kind: Literal["durability.flush"] = "durability.flush"


class FlushAll(Request):
    """Flush every put the RAM tier has handled so far, then wait until the spill queue is empty.

    The coordinator first asks the prompt cache for its statistics (a
    barrier: the cache tells ``Schedule`` while it handles a ``Put``, so
    once it answers, every put it received before this message has its
    ``Schedule`` queued here), then runs a :class:`Flush`, then asks the
    spill queue to drain (evictions and demotions queued meanwhile reach
    the writer too). Answered with the flush's :class:`FlushResult`; a
    barrier or drain that fails or times out is skipped, never fatal.
    """

    kind: Literal["durability.flush_all"] = "durability.flush_all"


class FlushResult(Body):
    """The evidence of one flush (answer to :class:`Flush`).

    The flush's *scope* is the records dirty when it began (a put that lands
    while it runs joins it only as a new version of a record in scope).

    - ``durable``: every prefix in scope was found on disk when the flush
      ended or was evicted unwritten (below), no write of this flush was
      dropped or failed, and no record RAM held was given up (``lost``)
      since the previous flush. In words: every prefix the tiers hold, and
      every put since the last durable flush that is still cached, is on
      disk.
    - ``pending``: prefixes in scope still dirty although RAM holds them (a
      write failed or was dropped, no engine turn came); a later flush can
      still write them.
    - ``uncovered``: prefixes in scope that a write of this flush (or an
      earlier one) stored but that no committed file covers when verified
      (the SSD tier's cap evicted the file meanwhile).
    - ``evicted_unwritten``: prefixes evicted from RAM before any write of
      them reached disk (write-behind had no turn, the eviction spill was
      dropped or failed), found uncovered after the spill queue drained;
      each is reported once, here, then forgotten: it does not make the
      flush not durable (no tier holds it any more).
    - ``dropped`` / ``failed``: writes of this flush dropped by the spill
      queue (over its cap, or it was stopping) / not stored by the writer
      (an fsync that failed counts here: it is never a stored file).
    - ``lost``: records given up over the coordinator's record cap since the
      previous flush.
    - ``entries`` / ``longest_durable_prefix_tokens``: committed files in the
      SSD index and the longest token sequence one of them holds, when the
      flush ended (``None``: the index did not answer).
    - ``scope``, ``written``, ``covered``: records in scope, snapshots this
      flush handed to the spill queue, prefixes in scope verified on disk.
    - ``dirty_after``: every dirty record when the flush ended (in scope or
      put while it ran).
    - ``started_at`` / ``finished_at``: the coordinator's clock.
    """

    kind: Literal["durability.flush_result"] = "durability.flush_result"
    durable: bool
    pending: int = Field(ge=0)
    dropped: int = Field(ge=0)
    failed: int = Field(ge=0)
    uncovered: int = Field(ge=0)
    lost: int = Field(default=0, ge=0)
    evicted_unwritten: int = Field(default=0, ge=0)
    entries: int | None = Field(default=None, ge=0)
    longest_durable_prefix_tokens: int | None = Field(default=None, ge=0)
    scope: int = Field(default=0, ge=0)
    written: int = Field(default=0, ge=0)
    covered: int = Field(default=0, ge=0)
    dirty_after: int = Field(default=0, ge=0)
    started_at: float = 0.0
    finished_at: float = 0.0
    checkpoints_lost: int = Field(default=0, ge=0)
    """Generation checkpoint writes that failed or were dropped since the previous flush
    (they do not make a flush not durable: a checkpoint is a restart point, not a prefix)."""


class DurabilityStatsRequest(Request):
    """Ask for :class:`DurabilityStats`."""

    kind: Literal["durability.stats_request"] = "durability.stats_request"


class DurabilityStats(Body):
    """Gauges and lifetime counters of the durability coordinator.

    Gauges: ``dirty`` (every record not known to be on disk),
    ``pending_snapshots`` (dirty records RAM still holds: a debounce or
    re-arm timer is armed, an attempt runs, or a flush will force them),
    ``missing`` (dirty records gone from RAM and not covered on disk),
    ``in_flight`` (attempts running), ``flushing``.
    Counters: ``scheduled`` (``Schedule`` messages), ``attempts``,
    ``written`` (snapshots handed to the spill queue), ``stored``,
    ``already_covered`` (attempts that found the prefix on disk and wrote
    nothing), ``vanished`` (snapshots whose RAM entry was gone),
    ``busy_rearms`` (attempts put back because the engine was busy),
    ``dropped``, ``failed``, ``timeouts`` (replies that never came),
    ``lost`` (records RAM held, given up over the record cap),
    ``evicted_unwritten`` (prefixes evicted from RAM before any write of
    them reached disk, each counted once when given up), ``flushes``.
    ``last_flush`` is the latest :class:`FlushResult`.
    """

    kind: Literal["durability.stats"] = "durability.stats"
    dirty: int = Field(ge=0)
    pending_snapshots: int = Field(ge=0)
    missing: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    flushing: bool
    scheduled: int = Field(ge=0)
    attempts: int = Field(ge=0)
    written: int = Field(ge=0)
    stored: int = Field(ge=0)
    already_covered: int = Field(ge=0)
    vanished: int = Field(ge=0)
    busy_rearms: int = Field(ge=0)
    dropped: int = Field(ge=0)
    failed: int = Field(ge=0)
    timeouts: int = Field(ge=0)
    lost: int = Field(ge=0)
    evicted_unwritten: int = Field(default=0, ge=0)
    flushes: int = Field(ge=0)
    last_flush: FlushResult | None = None


class Wake(Body):
    """The coordinator's alarm went off (sent to itself; carries nothing: time comes from the clock)."""

    kind: Literal["durability.wake"] = "durability.wake"
