"""The event-driven router's rules, sans I/O: a block index per replica and the routing choice.

:class:`BlockIndex` applies decoded vLLM ``KVEventBatch`` payloads (both
the ``array`` and the ``map`` encodings kvtier's ``--kv-events-format``
sends) and answers how many leading blocks of a request it holds.
:class:`Predicted` holds the chains this router sent to a replica that its
events have not announced yet (in flight, then ``ttl`` seconds more).
:func:`choose` picks the replica with the longest cached prefix of the
request (the fewest blocks to compute there; rule ``prefix``, the default),
or, with rule ``prefill``, the least prefill work before the first token
(those blocks plus the uncached blocks of the requests in flight to it); a
tie goes to the least loaded (fewest requests in flight through this
router), a further tie to the next replica in turn. With sglang-router's
balance thresholds set (:func:`imbalanced`), an imbalanced load leaves only
the least loaded replicas as candidates.

NOTE: kvtier's block hashes are chained (block ``i`` hashes block ``i-1``)
and every announced chain starts at the namespace root, so a replica that
holds block ``i`` of a request holds blocks ``0..i`` too: the longest cached
prefix is the last request block found in the index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RULES", "BlockIndex", "Choice", "Predicted", "choose", "decode_payload", "imbalanced"]

RULES = ("prefix", "prefill")
"""The choice rules of :func:`choose`."""


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


@dataclass
class Predicted:
    """Chains routed to one replica that its events may not have announced yet.

    NOTE: a replica announces a prompt's blocks when its prompt cache stores
    the entry (at the end of the request), so a conversation's next turn, or
    a second request with the same new prefix sent while the first is
    still running, would otherwise see no cached prefix anywhere and land on
    another replica. A routed chain counts as held while its request is in
    flight (``until`` infinite) and ``ttl`` seconds after it ends, by
    which time the events have confirmed it (or the replica did not store it).
    Chains are prefix-closed (block ``i`` implies ``0..i``), as in the index.
    """

    until: dict[int, float] = field(default_factory=dict)

    def add(self, hashes: Sequence[int]) -> None:
        """A request with this chain was sent to the replica: held while in flight."""
        for h in hashes:
            self.until[h] = math.inf

    def settle(self, hashes: Sequence[int], until: float) -> None:
        """The request ended: its chain stays predicted until ``until`` (monotonic seconds).

        NOTE: a block shared with another request still in flight (a common
        system prompt) gets the finite deadline too; the ended request stored
        it, so the replica's events confirm it within the deadline.
        """
        for h in hashes:
            if h in self.until:
                self.until[h] = until

    def expire(self, now: float) -> None:
        """Forget the chains whose deadline passed."""
        for h in [h for h, t in self.until.items() if t < now]:
            del self.until[h]

    def cached_blocks(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` are predicted at ``now``."""
        for i in range(len(hashes) - 1, -1, -1):
            if self.until.get(hashes[i], -math.inf) >= now:
                return i + 1
        return 0


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes, and why."""

    replica: int
    cached_blocks: int
    """The chosen replica's cached prefix of the request, in blocks."""
    reason: str
    """``cost`` (the least cost won alone), ``load`` (a tie broken by load), ``turn``,
    or ``balance`` (the load was imbalanced: among the least loaded)."""


def imbalanced(in_flight: Sequence[int], abs_threshold: float, rel_threshold: float) -> bool:
    """sglang-router's load-imbalance test, the same numbers meaning the same thing.

    Balancing is on when ``max - min > abs_threshold`` and
    ``max > min * rel_threshold`` over the replicas' requests in flight
    (sglang-router 0.3's ``--balance-abs-threshold`` / ``--balance-rel-threshold``).
    """
    if not in_flight:
        return False
    hi, lo = max(in_flight), min(in_flight)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


def choose(blocks: int, cached: Sequence[int], queued: Sequence[int],
           in_flight: Sequence[int], turn: int, *, abs_threshold: float = math.inf,
           rel_threshold: float = 1.5, rule: str = "prefix") -> Choice:
    """The replica with the longest cached prefix (``prefix``) or the least prefill (``prefill``).

    A request of ``blocks`` blocks costs ``blocks - cached[i]`` on replica
    ``i`` under rule ``prefix``: the blocks it would compute there, so the
    longest cached prefix wins, as in sglang-router's ``cache_aware``, and
    load enters only through the balance rule below. Under rule ``prefill``
    the cost adds ``queued[i]``, the uncached blocks of the requests already
    in flight to ``i`` (its queue of prefill work), so a longer cached prefix
    wins only until the replica holding it has more queued work than the
    prefix saves. A tie goes to the fewest requests in flight, then to the
    next replica in ``turn`` (so equal replicas share new work).

    NOTE: ``prefill`` treats every replica as compute of its own: it spreads
    cold requests sharing a prefix (an agent fleet's system prompt) over
    idle replicas, computing that prefix on each. Where replicas share
    cores (4 replicas on the 2-core benchmark box) that only splits the
    same cores more ways and loses the shared prefix's hits, and it is a
    second load rule beside the balance thresholds, which ``cache_aware``
    does not have; hence ``prefix`` by default (docs/benchmarks/cluster.md).

    When the requests in flight are imbalanced by sglang-router's rule
    (:func:`imbalanced` with ``abs_threshold`` / ``rel_threshold``; off by
    default) only the least loaded replicas are candidates, and among them
    the same cost decides (reason ``balance``): a router with the same
    thresholds as ``cache_aware`` balances when it does, but still keeps
    what it can of the cached prefix.
    """
    n = len(cached)
    if not n or len(queued) != n or len(in_flight) != n:
        raise ValueError("one cached count, one queue and one load per replica")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r} (one of {', '.join(RULES)})")
    weight = 1 if rule == "prefill" else 0
    cost = [max(0, blocks - cached[i]) + weight * queued[i] for i in range(n)]
    candidates = list(range(n))
    balancing = imbalanced(in_flight, abs_threshold, rel_threshold)
    if balancing:
        least_loaded = min(in_flight)
        candidates = [i for i in candidates if in_flight[i] == least_loaded]
    best = min(cost[i] for i in candidates)
    tied = [i for i in candidates if cost[i] == best]
    if len(tied) == 1:
        return Choice(tied[0], cached[tied[0]], "balance" if balancing else "cost")
    least = min(in_flight[i] for i in tied)
    idle = [i for i in tied if in_flight[i] == least]
    if len(idle) == 1:
        return Choice(idle[0], cached[idle[0]], "balance" if balancing else "load")
    pick = idle[turn % len(idle)]
    return Choice(pick, cached[pick], "balance" if balancing else "turn")
