"""Messages of the KV-event publisher (``actors.kv_events.KvEvents``).

The RAM tier (``actors.prompt_cache``) and the SSD index
(``actors.ssd_writer``) tell the publisher what entered and left their
indexes (:class:`TierChanged`: namespace + exact tokens per entry, medium
``CPU`` for RAM, ``DISK`` for SSD); the publisher maps each entry to its
chain of full blocks (``actors.kv_events.block_hash``), counts how many
entries hold each block, and publishes vLLM's ``BlockStored`` /
``BlockRemoved`` events when a block appears in or disappears from a tier.
A late subscriber's replay request arrives as :class:`KvEventsReplay`.
The walk-through is ``docs/scale-out.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ._base import Body, Request

__all__ = [
    "BlockIndex",
    "BlockIndexRequest",
    "KvEventsReplay",
    "KvEventsStats",
    "KvEventsStatsRequest",
    "Medium",
    "TierChange",
    "TierChanged",
]

Medium = Literal["CPU", "DISK"]
"""Where a block lives, as vLLM tags it: ``CPU`` (the RAM prompt cache), ``DISK`` (the SSD tier)."""


class TierChange(BaseModel):
    """One entry that entered (``stored``) or left (``removed``) a tier's index."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["stored", "removed"]
    namespace: str
    tokens: tuple[int, ...]


class TierChanged(Body):
    """Entries of one tier that entered or left its index, in the order it happened (tell)."""

    kind: Literal["kv_events.tier_changed"] = "kv_events.tier_changed"
    medium: Medium
    changes: tuple[TierChange, ...]


class KvEventsReplay(Body):
    """A subscriber on the replay socket asked for every buffered batch from ``start_seq`` on.

    ``client`` is the ROUTER identity of the asker, hex-encoded.
    """

    kind: Literal["kv_events.replay"] = "kv_events.replay"
    client: str
    start_seq: int = Field(ge=0)


class KvEventsStatsRequest(Request):
    """Ask for :class:`KvEventsStats`."""

    kind: Literal["kv_events.stats_request"] = "kv_events.stats_request"


class KvEventsStats(Body):
    """Counters of the publisher.

    ``next_seq``: the sequence number the next batch gets (batches sent so
    far). ``buffered``: batches kept for replay (at most ``buffer_steps``).
    ``blocks_cpu``/``blocks_disk``: blocks each tier holds now.
    ``send_failures``: batches the PUB socket did not take (the subscriber
    side is behind by a whole high-water mark); a replay recovers them while
    they are buffered. ``invalid_entries``: tier entries whose token ids do
    not fit a block hash (never announced). The rest says how to read the
    stream and recompute its hashes: the endpoints, the wire format, the
    block size, the hash definition's name and the namespace parts
    (``actors.kv_events.block_hash``).
    """

    kind: Literal["kv_events.stats"] = "kv_events.stats"
    next_seq: int
    events: int
    buffered: int
    buffer_steps: int
    blocks_cpu: int
    blocks_disk: int
    replays: int
    send_failures: int = 0
    invalid_entries: int = 0
    endpoint: str = ""
    replay_endpoint: str | None = None
    wire_format: str = "array"
    block_size: int = 16
    hash_scheme: str = ""
    model_fingerprint: str = ""
    kv_scheme: str = ""


class BlockIndexRequest(Request):
    """Ask for the publisher's block index (:class:`BlockIndex`), as its subscribers should see it."""

    kind: Literal["kv_events.block_index_request"] = "kv_events.block_index_request"


class BlockIndex(Body):
    """The published hashes of the blocks each tier holds now (sorted)."""

    kind: Literal["kv_events.block_index"] = "kv_events.block_index"
    cpu: tuple[int, ...]
    disk: tuple[int, ...]
