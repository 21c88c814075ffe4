"""Messages of the spill queue (``actors.spill_queue.SpillQueue``).

The spill queue is the one serial, byte-capped intake of the SSD cold tier.
Three producers use it: eviction spills from the RAM tier, idle demotions and
write-behind snapshots. Each item carries a cache handle (an opaque id into
the engine thread's ``kernels.CacheRegistry``) and with it the OWNERSHIP of
that handle: from the moment the queue accepts an :class:`Enqueue`, the queue
alone disposes the handle, exactly once, on whatever path the item settles
(stored, failed, dropped over the cap, refused at shutdown).

Protocol (the walk-through is ``docs/cold-tier.md``):

1. ``Enqueue`` (tell; or a request with ``reply_to`` set to hear the
   outcome as a :class:`SpillSettled`). Never refused while the queue runs;
   over the cap the OLDEST item that is not in flight is dropped, never the
   item just enqueued.
2. The queue hands one item at a time to the SSD writer (``ssd_writer.Store``)
   and waits for its ``StoreResult``.
3. ``DrainSpills`` (ask) is answered with :class:`SpillsDrained` once nothing
   is queued or in flight (flush, shutdown).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request
from .prompt_cache import EntryMeta

__all__ = [
    "DrainSpills",
    "Enqueue",
    "SpillOutcome",
    "SpillQueueStats",
    "SpillQueueStatsRequest",
    "SpillSettled",
    "SpillSource",
    "SpillsDrained",
]

SpillSource = Literal["evict", "demote", "snapshot"]
"""Which producer made the item: RAM eviction, idle demotion, write-behind snapshot."""

SpillOutcome = Literal["stored", "failed", "dropped", "refused"]
"""How an item settled. ``stored``: the writer committed the file; ``failed``:
the writer did not store it (a soft failure, or a rule such as ``too_large``);
``dropped``: evicted from the queue over its byte cap; ``refused``: the queue
was stopping when it arrived."""


class Enqueue(Request):
    """Hand an entry (and its handle's ownership) to the cold tier's queue.

    ``tokens`` has exactly ``meta.offset`` ids; ``meta.nbytes`` is what the
    item pins in memory until it settles (the byte cap counts it). A tell
    (``reply_to`` empty) gets no answer; with ``reply_to`` set the queue sends
    one :class:`SpillSettled` when the item settles.
    """

    kind: Literal["spill_queue.enqueue"] = "spill_queue.enqueue"
    handle: str
    namespace: str = ""
    tokens: tuple[int, ...]
    meta: EntryMeta
    source: SpillSource = "evict"


class SpillSettled(Body):
    """How one enqueued item ended; sent only when its ``Enqueue`` carried ``reply_to``.

    ``reason`` is the writer's (``disk_full``, ``too_large``, ...) for
    ``failed``, ``over_cap`` for ``dropped``, ``stopping`` for ``refused``.
    """

    kind: Literal["spill_queue.settled"] = "spill_queue.settled"
    handle: str
    source: SpillSource
    outcome: SpillOutcome
    reason: str = ""
    tokens: int = Field(default=0, ge=0)
    namespace: str = ""


class DrainSpills(Request):
    """Ask to be answered once the queue is empty and nothing is in flight."""

    kind: Literal["spill_queue.drain"] = "spill_queue.drain"


class SpillsDrained(Body):
    """Answer to :class:`DrainSpills`: the queue is idle; lifetime counters at that moment.

    A flush compares ``dropped`` and ``failed`` with the values it saw before
    it started to learn whether anything was lost meanwhile.
    """

    kind: Literal["spill_queue.drained"] = "spill_queue.drained"
    enqueued: int = Field(ge=0)
    stored: int = Field(ge=0)
    dropped: int = Field(ge=0)
    failed: int = Field(ge=0)
    refused: int = Field(ge=0)


class SpillQueueStatsRequest(Request):
    """Ask for :class:`SpillQueueStats`."""

    kind: Literal["spill_queue.stats_request"] = "spill_queue.stats_request"


class SpillQueueStats(Body):
    """Gauges and lifetime counters of the spill queue.

    ``pending`` / ``pending_bytes`` count queued items plus the one in flight
    (every one of them pins its handle's memory); ``cap_bytes`` bounds
    ``pending_bytes`` except for the newest item and the in-flight one.
    """

    kind: Literal["spill_queue.stats"] = "spill_queue.stats"
    cap_bytes: int = Field(ge=0)
    pending: int = Field(ge=0)
    pending_bytes: int = Field(ge=0)
    in_flight: bool
    in_flight_bytes: int = Field(ge=0)
    enqueued: int = Field(ge=0)
    stored: int = Field(ge=0)
    dropped: int = Field(ge=0)
    dropped_bytes: int = Field(ge=0)
    failed: int = Field(ge=0)
    refused: int = Field(ge=0)
