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

from pydantic import BaseModel, ConfigDict, Field

from ._base import Body, Request
from .prompt_cache import EntryMeta

__all__ = [
    "CheckpointRecord",
    "DrainSpills",
    "Enqueue",
    "RemoveCheckpoints",
    "SpillOutcome",
    "SpillQueueStats",
    "SpillQueueStatsRequest",
    "SpillSettled",
    "SpillSource",
    "SpillsDrained",
]

SpillSource = Literal["evict", "demote", "snapshot", "checkpoint"]
"""Which producer made the item: RAM eviction, idle demotion, write-behind snapshot,
generation checkpoint."""


class CheckpointRecord(BaseModel):
    """The generation state a checkpoint item carries beside its caches (docs/cold-tier.md).

    The item's ``tokens`` are the prompt (first ``prompt_len``) and every
    emitted token; ``pending_token`` was sampled but not emitted;
    ``rng_key`` is the PRNG key after its draw (``None``: greedy).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_key: str = Field(pattern=r"^[0-9a-f]{32}$")
    prompt_len: int = Field(gt=0)
    pending_token: int = Field(ge=0, lt=1 << 32)
    sample_index: int = Field(ge=0)
    rng_key: tuple[int, int] | None = None
    writer: str = Field(default="", max_length=256)
    """The request that took it (its id): a checkpoint delta builds only on a file of the same
    request written by this process ("": never a delta base)."""

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
    checkpoint: CheckpointRecord | None = None
    """Set exactly for ``source="checkpoint"``: the item is written as a checkpoint file."""


class RemoveCheckpoints(Body):
    """A finished answer's checkpoints are void: drop its queued ones, remove its files (tell).

    The queue forwards it to the SSD writer, whose store worker runs it after
    any checkpoint write of the key already handed over (one mailbox, in order).
    """

    kind: Literal["spill_queue.remove_checkpoints"] = "spill_queue.remove_checkpoints"
    request_key: str = Field(pattern=r"^[0-9a-f]{32}$")


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
    checkpoints_lost: int = Field(default=0, ge=0)
    """Generation checkpoints not written (failed, or dropped other than superseded), lifetime."""


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
    pending_checkpoints: int = Field(default=0, ge=0)
    """Generation checkpoints queued or in flight (part of ``pending``)."""
