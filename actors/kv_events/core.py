"""The KV-event publisher's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

Input: what the tiers report (``messages.TierChanged``: entries that
entered or left the RAM index, medium ``CPU``, or the SSD index, ``DISK``),
replay requests, statistics asks; each event carries the wall-clock time
the shell read (the batch's ``ts``). Output: ZMQ frames to publish, replay
answers, replies. The shell (``actors/kv_events/actor.py``) owns the
sockets.

Invariants kept here:

- the published block index (every ``BlockStored`` minus every later
  ``BlockRemoved`` of the same medium, from the last ``AllBlocksCleared``
  on) equals, per medium, the union of the full-block chains of the
  entries that tier holds: a block is announced when the first entry
  holding it arrives and removed when the last one leaves (a count per
  block and medium);
- within one ``TierChanged`` only the net change is published: a block
  that left and came back (an SSD file replaced by a rewrite of the same
  tokens) is not announced twice;
- the first batch of a process is ``AllBlocksCleared`` (seq 0): a
  subscriber drops whatever an earlier run of this endpoint announced,
  and the SSD tier's startup scan then announces the restored blocks;
- sequence numbers increase by one per batch; the last ``buffer_steps``
  batches are kept for replay, nothing else grows without bound except
  the block counts, which the tiers' own caps bound.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import assert_never

from messages import Body
from messages.kv_events import (
    BlockIndex,
    BlockIndexRequest,
    KvEventsReplay,
    KvEventsStats,
    KvEventsStatsRequest,
    Medium,
    TierChanged,
)

from .block_hash import BLOCK_SIZE, HASH_SCHEME, block_digests, external_hash, namespace_root
from .wire import (
    END_SEQ,
    AllCleared,
    Removed,
    Stored,
    WireEvent,
    WireFormat,
    encode_batch,
    seq_bytes,
)

__all__ = [
    "DEFAULT_BUFFER_STEPS",
    "MAX_EVENTS_PER_BATCH",
    "CoreState",
    "Effect",
    "Event",
    "Publish",
    "Received",
    "Reply",
    "SendFailed",
    "SendReplay",
    "Started",
    "UnknownKvEventsMessage",
    "block_index",
    "handle",
    "stats",
]

DEFAULT_BUFFER_STEPS = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps`` default)."""

MAX_EVENTS_PER_BATCH = 256
"""Most events in one batch (a large startup scan goes out as several batches)."""

MAX_HASHES_PER_EVENT = 1024
"""Most block hashes in one ``BlockStored``/``BlockRemoved``."""

_ROOTS_KEPT = 4096


class UnknownKvEventsMessage(TypeError):
    """A body the publisher has no rule for."""


# --- effects ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Publish:
    """Send ``[topic, seq, payload]`` on the PUB socket (never waiting); report a refusal."""

    seq: int
    frames: tuple[bytes, bytes, bytes]


@dataclass(frozen=True, slots=True)
class SendReplay:
    """Send each ``[client, b"", seq, payload]`` and then the end marker on the replay socket."""

    client: bytes
    frames: tuple[tuple[bytes, bytes, bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the request being handled with ``body``."""

    body: Body


Effect = Publish | SendReplay | Reply


# --- events -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """The actor started at wall-clock time ``ts`` (its sockets are bound)."""

    ts: float


@dataclass(frozen=True, slots=True)
class Received:
    """A message body from the mailbox, handled at wall-clock time ``ts``."""

    body: Body
    ts: float


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The PUB socket did not take batch ``seq`` (it stays buffered for replay)."""

    seq: int


Event = Started | Received | SendFailed


# --- state ------------------------------------------------------------------------


@dataclass
class CoreState:
    """Everything the rules know (mutated in place and returned by :func:`handle`).

    ``model``/``kv_scheme``: the model fingerprint and the KV scheme's cache
    key, two of the three parts of every block hash's namespace (the third
    is the entry's cache namespace). ``topic``: the PUB topic frame.
    """

    model: str
    kv_scheme: str
    block_size: int = BLOCK_SIZE
    wire_format: WireFormat = "array"
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    topic: bytes = b""
    data_parallel_rank: int = 0
    endpoint: str = ""
    replay_endpoint: str | None = None
    refs: dict[Medium, dict[bytes, int]] = field(
        default_factory=lambda: {"CPU": {}, "DISK": {}}
    )
    roots: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    buffer: deque[tuple[int, bytes]] = field(default_factory=deque)
    next_seq: int = 0
    started: bool = False
    events: int = 0
    replays: int = 0
    send_failures: int = 0
    invalid_entries: int = 0

    def __post_init__(self) -> None:
        if self.buffer_steps < 1 or self.block_size < 1:
            raise ValueError("buffer_steps and block_size must be >= 1")
        self.buffer = deque(self.buffer, maxlen=self.buffer_steps)


def _root(state: CoreState, namespace: str) -> bytes:
    root = state.roots.get(namespace)
    if root is None:
        root = namespace_root(model=state.model, kv_scheme=state.kv_scheme, namespace=namespace)
        state.roots[namespace] = root
        if len(state.roots) > _ROOTS_KEPT:
            state.roots.popitem(last=False)
    else:
        state.roots.move_to_end(namespace)
    return root


# --- tier changes -------------------------------------------------------------------


@dataclass(slots=True)
class _Touched:
    present_before: bool
    parent: bytes | None = None
    tokens: tuple[int, ...] = ()


def _chunks(items: list[int]) -> list[tuple[int, ...]]:
    return [tuple(items[i : i + MAX_HASHES_PER_EVENT])
            for i in range(0, len(items), MAX_HASHES_PER_EVENT)]


def tier_changed(state: CoreState, msg: TierChanged) -> list[WireEvent]:
    """Apply one tier's entry changes to the block counts; the events of the net change.

    Removals come first (one ``BlockRemoved`` per up to 1024 hashes), then
    each new chain as one ``BlockStored`` whose ``parent_block_hash`` is the
    block before it (``None`` at the start of a namespace).
    """
    refs = state.refs[msg.medium]
    size = state.block_size
    touched: dict[bytes, _Touched] = {}
    for change in msg.changes:
        try:
            digests = block_digests(_root(state, change.namespace), change.tokens, block_size=size)
        except ValueError:
            state.invalid_entries += 1
            continue
        stored = change.op == "stored"
        for i, digest in enumerate(digests):
            count = refs.get(digest, 0)
            seen = touched.get(digest)
            if seen is None:
                seen = touched[digest] = _Touched(present_before=count > 0)
            if stored:
                refs[digest] = count + 1
                if count == 0:
                    seen.parent = digests[i - 1] if i > 0 else None
                    seen.tokens = tuple(change.tokens[i * size : (i + 1) * size])
            elif count > 1:
                refs[digest] = count - 1
            elif count == 1:
                del refs[digest]
            # NOTE: a removal of a block never stored (count 0) changes nothing.
    removed = [external_hash(d) for d, t in touched.items() if t.present_before and d not in refs]
    events: list[WireEvent] = [Removed(chunk, msg.medium) for chunk in _chunks(removed)]
    run: list[bytes] = []
    run_tokens: list[int] = []

    def flush() -> None:
        if run:
            parent = touched[run[0]].parent
            events.append(
                Stored(
                    block_hashes=tuple(external_hash(d) for d in run),
                    parent_block_hash=None if parent is None else external_hash(parent),
                    token_ids=tuple(run_tokens),
                    block_size=size,
                    medium=msg.medium,
                )
            )
            run.clear()
            run_tokens.clear()

    for digest, t in touched.items():
        if t.present_before or digest not in refs:
            continue
        # NOTE: a chain continues while each block's parent is the block before it.
        if run and (t.parent != run[-1] or len(run) >= MAX_HASHES_PER_EVENT):
            flush()
        run.append(digest)
        run_tokens.extend(t.tokens)
    flush()
    return events


# --- batches ------------------------------------------------------------------------


def _publish(state: CoreState, events: list[WireEvent], ts: float) -> list[Effect]:
    effects: list[Effect] = []
    for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
        batch = events[i : i + MAX_EVENTS_PER_BATCH]
        payload = encode_batch(
            ts, batch, data_parallel_rank=state.data_parallel_rank, fmt=state.wire_format
        )
        seq = state.next_seq
        state.next_seq += 1
        state.events += len(batch)
        state.buffer.append((seq, payload))
        effects.append(Publish(seq, (state.topic, seq_bytes(seq), payload)))
    return effects


def replay(state: CoreState, msg: KvEventsReplay) -> SendReplay:
    """Every buffered batch from ``msg.start_seq`` on, then the end marker."""
    state.replays += 1
    client = bytes.fromhex(msg.client)
    frames = [(client, b"", seq_bytes(seq), payload)
              for seq, payload in state.buffer if seq >= msg.start_seq]
    frames.append((client, b"", END_SEQ, b""))
    return SendReplay(client, tuple(frames))


def stats(state: CoreState) -> KvEventsStats:
    """The statistics snapshot of ``state``."""
    return KvEventsStats(
        next_seq=state.next_seq,
        events=state.events,
        buffered=len(state.buffer),
        buffer_steps=state.buffer_steps,
        blocks_cpu=len(state.refs["CPU"]),
        blocks_disk=len(state.refs["DISK"]),
        replays=state.replays,
        send_failures=state.send_failures,
        invalid_entries=state.invalid_entries,
        endpoint=state.endpoint,
        replay_endpoint=state.replay_endpoint,
        wire_format=state.wire_format,
        block_size=state.block_size,
        hash_scheme=HASH_SCHEME,
        model_fingerprint=state.model,
        kv_scheme=state.kv_scheme,
    )


def block_index(state: CoreState) -> BlockIndex:
    """The published hashes of the blocks each tier holds now."""
    return BlockIndex(
        cpu=tuple(sorted(external_hash(d) for d in state.refs["CPU"])),
        disk=tuple(sorted(external_hash(d) for d in state.refs["DISK"])),
    )


def handle(state: CoreState, event: Event) -> tuple[CoreState, list[Effect]]:
    """Apply one event; return the state and the effects to perform, in order."""
    match event:
        case Started(ts=ts):
            if state.started:
                return state, []  # NOTE: a restarted shell keeps the stream going.
            state.started = True
            return state, _publish(state, [AllCleared()], ts)
        case SendFailed():
            state.send_failures += 1
            return state, []
        case Received(body=body, ts=ts):
            if isinstance(body, TierChanged):
                return state, _publish(state, tier_changed(state, body), ts)
            if isinstance(body, KvEventsReplay):
                return state, [replay(state, body)]
            if isinstance(body, KvEventsStatsRequest):
                return state, [Reply(stats(state))]
            if isinstance(body, BlockIndexRequest):
                return state, [Reply(block_index(state))]
            raise UnknownKvEventsMessage(f"kv events have no rule for {body.kind!r}")
        case _:
            assert_never(event)
