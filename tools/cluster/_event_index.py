"""The event-driven router's rules, sans I/O: a block index per replica and the routing choice.

:class:`BlockIndex` applies decoded vLLM ``KVEventBatch`` payloads (both
the ``array`` and the ``map`` encodings kvtier's ``--kv-events-format``
sends) and answers how many leading blocks of a request it holds.
:func:`choose` picks the replica with the longest cached prefix, a tie
going to the least loaded (fewest requests in flight through this router),
a further tie to the next replica in turn.

NOTE: kvtier's block hashes are chained (block ``i`` hashes block ``i-1``)
and every announced chain starts at the namespace root, so a replica that
holds block ``i`` of a request holds blocks ``0..i`` too: the longest cached
prefix is the last request block found in the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BlockIndex", "Choice", "choose", "decode_payload"]


def decode_payload(payload: bytes) -> list[Any]:
    """The events of one msgpack ``KVEventBatch`` (array or map encoding), undecoded structs."""
    import msgspec  # NOTE: lazy: the cluster extra.

    batch = msgspec.msgpack.decode(payload)
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise ValueError("not a KVEventBatch")
    if not isinstance(events, list):
        raise ValueError("KVEventBatch without an event list")
    return events


def _fields(event: Any) -> tuple[str, list[int], str | None]:
    """(tag, block hashes, medium) of one event in either encoding."""
    if isinstance(event, dict):
        tag = event.get("type")
        hashes = event.get("block_hashes") or []
        medium = event.get("medium")
    elif isinstance(event, list) and event:
        tag = event[0]
        hashes = event[1] if len(event) > 1 else []
        # NOTE: array layout: BlockStored [tag, hashes, parent, tokens, size, lora_id,
        # medium, lora_name]; BlockRemoved [tag, hashes, medium].
        medium = event[6] if tag == "BlockStored" and len(event) > 6 else (
            event[2] if tag == "BlockRemoved" and len(event) > 2 else None)
    else:
        raise ValueError("not a KV event")
    if not isinstance(tag, str) or not isinstance(hashes, list):
        raise ValueError("malformed KV event")
    return tag, [int(h) for h in hashes], medium if isinstance(medium, str) else None


@dataclass
class BlockIndex:
    """The blocks one replica announced, each with the media (``CPU``, ``DISK``) holding it."""

    held: dict[int, set[str]] = field(default_factory=dict)
    batches: int = 0
    clears: int = 0

    def apply(self, events: Sequence[Any]) -> None:
        """Apply one batch's events in order."""
        for event in events:
            tag, hashes, medium = _fields(event)
            where = medium or "?"
            if tag == "BlockStored":
                for h in hashes:
                    self.held.setdefault(h, set()).add(where)
            elif tag == "BlockRemoved":
                for h in hashes:
                    media = self.held.get(h)
                    if media is not None:
                        media.discard(where)
                        if not media:
                            del self.held[h]
            elif tag == "AllBlocksCleared":
                self.held.clear()
                self.clears += 1
        self.batches += 1

    def reset(self) -> None:
        """Forget everything (the publisher restarted: its seq went back to 0)."""
        self.held.clear()

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (a request's chain) this replica holds."""
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.held:
                return i + 1
        return 0


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes, and why."""

    replica: int
    cached_blocks: int
    """The chosen replica's cached prefix of the request, in blocks."""
    reason: str
    """``prefix`` (a longest prefix won alone), ``load`` (a tie broken by load), ``turn``."""


def choose(cached: Sequence[int], in_flight: Sequence[int], turn: int) -> Choice:
    """The replica with the most cached blocks; tie -> fewest in flight; tie -> the next in turn.

    ``turn`` rotates the last tie-break so equal replicas share new work.
    """
    if not cached or len(cached) != len(in_flight):
        raise ValueError("one cached count and one load per replica")
    best = max(cached)
    tied = [i for i, c in enumerate(cached) if c == best]
    if len(tied) == 1:
        return Choice(tied[0], best, "prefix")
    least = min(in_flight[i] for i in tied)
    idle = [i for i in tied if in_flight[i] == least]
    if len(idle) == 1:
        return Choice(idle[0], best, "load")
    pick = idle[turn % len(idle)]
    return Choice(pick, best, "turn")
