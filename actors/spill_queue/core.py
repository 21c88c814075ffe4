"""The spill queue's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

Pure Python over metadata: no arrays, no I/O, no clock (no rule here
depends on time). An event is a message (its :class:`Envelope`) or what the
shell reports: :class:`StoreUnavailable`, :class:`DrainUndelivered`,
:class:`Stopping`. The shell
(``actors/spill_queue/actor.py``) performs the effects: :class:`SendStore`
hands the in-flight item to the SSD writer, :class:`ReleaseHandle` disposes a
handle through the registry, :class:`RequestDrain` asks for the background
turn that frees disposed handles' arrays, :class:`Answer` replies to a
waiting request.

Invariants kept by every function here (``tests/actors/spill_queue`` checks
them on random sequences):

- every accepted handle is released exactly once, on whichever path its item
  settles (stored, failed, dropped, dropped at stop); a handle is never
  released while the writer may still read it, except at stop;
- at most one item is in flight; items start in arrival order;
- after an enqueue, each class's bytes (prompt spills, checkpoints) stay
  within its share of ``cap_bytes`` unless the only queued item of the
  class is the one just enqueued (the soft cap: the newest item is never its
  own victim, and the in-flight item is never a victim); with no
  checkpoints (or ``checkpoint_share`` 0 and none queued) this is
  ``pending_bytes <= cap_bytes``;
- an item dropped over the cap is always the oldest queued one of its class;
- with a ``drain_step``, every release is followed by a drain turn: one is
  asked for after the effects that release, unless one is already asked
  for, and then again when that one is done if more were released since.
  NOTE: the registry only queues a disposal; the arrays stay in memory,
  outside both caps, until a drain runs on the engine thread. Batch steps
  and serial turns drain when they end, but a store finishes in idle
  turns, so without this the entries stored between two waves of requests
  stayed alive into the next wave's prefill (118 MB of them measured over
  the two 0.1 GB caps, docs/benchmarks/batching.md).
- generation checkpoints (``source="checkpoint"``) have their own share of
  the cap (``checkpoint_share``; the design splits the one spill budget
  between prompt spills and checkpoints): each class drops only its own
  oldest queued items over its share, so a long answer's checkpoints never
  push prompt spills out and the reverse; a newer checkpoint of a request
  key supersedes its queued older one (only the newest is worth writing);
  ``RemoveCheckpoints`` drops the key's queued checkpoints and forwards the
  removal to the writer, behind any write of the key already handed over.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import assert_never

from messages import (
    Body,
    CheckpointRecord,
    DrainSpills,
    Enqueue,
    EntryMeta,
    Envelope,
    Failure,
    RemoveCheckpoints,
    SpillOutcome,
    SpillQueueStats,
    SpillQueueStatsRequest,
    SpillsDrained,
    SpillSettled,
    SpillSource,
    StoreResult,
)
from messages.gateway import TurnDone

__all__ = [
    "DEFAULT_CAP_BYTES",
    "Answer",
    "DrainUndelivered",
    "Effect",
    "Event",
    "Item",
    "QueueState",
    "ReleaseHandle",
    "RequestDrain",
    "SendRemoveCheckpoints",
    "SendStore",
    "Stopping",
    "StoreUnavailable",
    "UnknownSpillQueueMessage",
    "drained",
    "handle",
    "pending_bytes",
    "stats",
]

DEFAULT_CAP_BYTES = 2 * 1024**3
"""Default byte cap of the queue (2 GiB; ``EngineConfig.ssd_spill_queue_bytes``)."""


class UnknownSpillQueueMessage(TypeError):
    """A body the spill queue has no rule for."""


@dataclass(frozen=True, slots=True)
class Item:
    """One queued entry; the queue owns ``handle`` until the item settles.

    ``notify`` is the ``Enqueue`` envelope when its sender asked to hear the
    outcome; ``correlation_id`` is the producer's, carried to the writer.
    """

    seq: int
    handle: str
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta
    source: SpillSource
    correlation_id: str
    notify: Envelope | None = None
    checkpoint: CheckpointRecord | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the item pins in memory until it settles."""
        return self.meta.nbytes


# --- events (shell -> core), besides a message's Envelope ------------------


@dataclass(frozen=True, slots=True)
class StoreUnavailable:
    """The writer cannot take or answer the in-flight item ``handle`` (``reason``): it failed."""

    handle: str
    reason: str


@dataclass(frozen=True, slots=True)
class DrainUndelivered:
    """The drain request (:class:`RequestDrain`) could not be sent."""


@dataclass(frozen=True, slots=True)
class Stopping:
    """The queue stops."""


Event = Envelope | StoreUnavailable | DrainUndelivered | Stopping


# --- effects (core -> shell) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class SendStore:
    """Hand ``item`` to the SSD writer (``Store``, answered to this queue)."""

    item: Item


@dataclass(frozen=True, slots=True)
class ReleaseHandle:
    """Dispose ``handle`` (the queue owned it; nothing reads it any more)."""

    handle: str


@dataclass(frozen=True, slots=True)
class RequestDrain:
    """Ask the gateway for the ``step_id`` background turn (the registry's drain); ``TurnDone`` comes back."""

    step_id: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply ``body`` to the waiting ``request``."""

    request: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class SendRemoveCheckpoints:
    """Tell the SSD writer to remove every checkpoint file of ``request_key``."""

    request_key: str


Effect = SendStore | ReleaseHandle | RequestDrain | Answer | SendRemoveCheckpoints


@dataclass
class QueueState:
    """Everything the rules know (mutated in place and returned by :func:`handle`)."""

    cap_bytes: int = DEFAULT_CAP_BYTES
    queued: deque[Item] = field(default_factory=deque)
    queued_bytes: int = 0
    in_flight: Item | None = None
    stopping: bool = False
    drain_waiters: list[Envelope] = field(default_factory=list)
    seq: int = 0
    enqueued: int = 0
    stored: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    failed: int = 0
    refused: int = 0
    drain_step: str | None = None
    drain_in_flight: bool = False
    undrained: int = 0
    drains_requested: int = 0
    checkpoint_share: float = 0.0
    checkpoints_enqueued: int = 0
    checkpoints_superseded: int = 0
    checkpoints_removed: int = 0
    checkpoints_lost: int = 0

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError("cap_bytes cannot be negative")
        if not 0.0 <= self.checkpoint_share <= 1.0:
            raise ValueError("checkpoint_share must lie in [0, 1]")


def _is_ckpt(item: Item) -> bool:
    return item.checkpoint is not None


def class_cap(state: QueueState, checkpoint: bool) -> int:
    """The byte share of one item class: checkpoints get ``checkpoint_share`` of the cap."""
    ckpt = int(state.cap_bytes * state.checkpoint_share)
    return ckpt if checkpoint else state.cap_bytes - ckpt


def class_bytes(state: QueueState, checkpoint: bool) -> int:
    """Bytes pinned by queued and in-flight items of one class."""
    items = list(state.queued) + ([state.in_flight] if state.in_flight is not None else [])
    return sum(i.nbytes for i in items if _is_ckpt(i) == checkpoint)


def pending_bytes(state: QueueState) -> int:
    """Bytes pinned by queued items plus the in-flight one."""
    flying = state.in_flight.nbytes if state.in_flight is not None else 0
    return state.queued_bytes + flying


def _owned(state: QueueState, handle_id: str) -> bool:
    if state.in_flight is not None and state.in_flight.handle == handle_id:
        return True
    return any(item.handle == handle_id for item in state.queued)


def _item(envelope: Envelope, msg: Enqueue, seq: int) -> Item:
    """``msg`` as the queue holds it (``notify`` set when its sender asked to hear the outcome)."""
    return Item(
        seq=seq,
        handle=msg.handle,
        namespace=msg.namespace,
        tokens=msg.tokens,
        meta=msg.meta,
        source=msg.source,
        correlation_id=envelope.correlation_id,
        notify=envelope if msg.reply_to else None,
        checkpoint=msg.checkpoint,
    )


def _notify(item: Item, outcome: SpillOutcome, reason: str) -> list[Effect]:
    """Tell ``item``'s producer how it ended (nothing when it did not ask)."""
    if item.notify is None:
        return []
    settled = SpillSettled(
        handle=item.handle,
        source=item.source,
        outcome=outcome,
        reason=reason,
        tokens=len(item.tokens),
        namespace=item.namespace,
    )
    return [Answer(item.notify, settled)]


def _settle(state: QueueState, item: Item, outcome: SpillOutcome, reason: str) -> list[Effect]:
    """Release ``item``'s handle and tell its producer how it ended."""
    if item.checkpoint is not None and outcome != "stored" \
            and reason not in ("superseded", "completed"):
        state.checkpoints_lost += 1
    return [ReleaseHandle(item.handle), *_notify(item, outcome, reason)]


def _refuse(
    state: QueueState, envelope: Envelope, msg: Enqueue, reason: str, *, release: bool
) -> list[Effect]:
    state.refused += 1
    effects: list[Effect] = [ReleaseHandle(msg.handle)] if release else []
    return effects + _notify(_item(envelope, msg, seq=-1), "refused", reason)


def _drained_body(state: QueueState) -> SpillsDrained:
    return SpillsDrained(
        enqueued=state.enqueued,
        stored=state.stored,
        dropped=state.dropped,
        failed=state.failed,
        refused=state.refused,
        checkpoints_lost=state.checkpoints_lost,
    )


def drained(state: QueueState) -> bool:
    """Nothing queued and nothing in flight."""
    return state.in_flight is None and not state.queued


def _after_settle(state: QueueState) -> list[Effect]:
    """Start the next item, or answer drain waiters once idle."""
    if state.in_flight is None and state.queued and not state.stopping:
        item = state.queued.popleft()
        state.queued_bytes -= item.nbytes
        state.in_flight = item
        return [SendStore(item)]
    if drained(state) and state.drain_waiters:
        body = _drained_body(state)
        waiters, state.drain_waiters = state.drain_waiters, []
        return [Answer(w, body) for w in waiters]
    return []


def enqueue(state: QueueState, envelope: Envelope, msg: Enqueue) -> list[Effect]:
    """Accept ``msg``'s item; drop the oldest queued items while over the cap; start if idle."""
    if _owned(state, msg.handle):
        # NOTE: already ours; releasing it again would double-dispose it.
        return _refuse(state, envelope, msg, "duplicate_handle", release=False)
    if state.stopping:
        return _refuse(state, envelope, msg, "stopping", release=True)
    if not msg.tokens or len(msg.tokens) != msg.meta.offset:
        state.enqueued += 1
        state.failed += 1
        return _settle(state, _item(envelope, msg, seq=-1), "failed", "invalid")
    if (msg.checkpoint is None) != (msg.source != "checkpoint"):
        state.enqueued += 1
        state.failed += 1
        return _settle(state, _item(envelope, msg, seq=-1), "failed", "invalid")
    state.seq += 1
    state.enqueued += 1
    item = _item(envelope, msg, state.seq)
    effects: list[Effect] = []
    ckpt = item.checkpoint
    if ckpt is not None:
        state.checkpoints_enqueued += 1
        # NOTE: only the newest checkpoint of a key is worth writing; an
        # older one still queued is dropped (the in-flight one is left).
        for old in [q for q in state.queued
                    if q.checkpoint is not None and q.checkpoint.request_key == ckpt.request_key]:
            effects += _drop(state, old, "superseded")
            state.checkpoints_superseded += 1
    state.queued.append(item)
    state.queued_bytes += item.nbytes
    # NOTE: the class's own oldest queued items go first, never the item just
    # enqueued (always the last) nor the in-flight one (not in ``queued``).
    cls = _is_ckpt(item)
    while class_bytes(state, cls) > class_cap(state, cls):
        victims = [q for q in state.queued if _is_ckpt(q) == cls and q is not item]
        if not victims:
            break
        effects += _drop(state, victims[0], "over_cap")
    effects += _after_settle(state)
    return effects


def _drop(state: QueueState, victim: Item, reason: str) -> list[Effect]:
    state.queued.remove(victim)
    state.queued_bytes -= victim.nbytes
    state.dropped += 1
    state.dropped_bytes += victim.nbytes
    return _settle(state, victim, "dropped", reason)


def remove_checkpoints(state: QueueState, msg: RemoveCheckpoints) -> list[Effect]:
    """A finished answer: drop its queued checkpoints, then have the writer remove its files."""
    effects: list[Effect] = []
    for old in [q for q in state.queued
                if q.checkpoint is not None and q.checkpoint.request_key == msg.request_key]:
        effects += _drop(state, old, "completed")
    state.checkpoints_removed += 1
    return [*effects, SendRemoveCheckpoints(msg.request_key)]


def store_result(state: QueueState, msg: StoreResult) -> list[Effect]:
    """Settle the in-flight item with the writer's answer and start the next."""
    item = state.in_flight
    if item is None or item.handle != msg.handle:
        return []  # NOTE: a stale answer for an item already settled otherwise.
    state.in_flight = None
    if msg.stored:
        state.stored += 1
        effects = _settle(state, item, "stored", "")
    else:
        state.failed += 1
        effects = _settle(state, item, "failed", msg.reason)
    return effects + _after_settle(state)


def _store_unavailable(state: QueueState, handle_id: str, reason: str) -> list[Effect]:
    """The writer cannot take or answer the in-flight item: it failed."""
    item = state.in_flight
    if item is None or item.handle != handle_id:
        return []
    state.in_flight = None
    state.failed += 1
    # NOTE: no drain request here: ``handle`` adds it once for every event
    # (counting this release twice would leave a phantom undrained handle).
    return _settle(state, item, "failed", reason) + _after_settle(state)


def _stop(state: QueueState) -> list[Effect]:
    """The queue stops: release every item (queued and in flight), answer drain waiters.

    NOTE: the in-flight item is released too: a writer still reading it then
    fails that store (its handle is gone), which is a miss, never a wrong file.
    Flush before stopping to keep queued work.
    """
    state.stopping = True
    effects: list[Effect] = []
    while state.queued:
        item = state.queued.popleft()
        state.queued_bytes -= item.nbytes
        state.dropped += 1
        state.dropped_bytes += item.nbytes
        effects += _settle(state, item, "dropped", "stopping")
    if state.in_flight is not None:
        item, state.in_flight = state.in_flight, None
        state.failed += 1
        effects += _settle(state, item, "failed", "stopping")
    if state.drain_waiters:
        body = _drained_body(state)
        waiters, state.drain_waiters = state.drain_waiters, []
        effects += [Answer(w, body) for w in waiters]
    return effects


def stats(state: QueueState) -> SpillQueueStats:
    """The stats snapshot of ``state``."""
    flying = state.in_flight.nbytes if state.in_flight is not None else 0
    return SpillQueueStats(
        cap_bytes=state.cap_bytes,
        pending=len(state.queued) + (state.in_flight is not None),
        pending_bytes=state.queued_bytes + flying,
        in_flight=state.in_flight is not None,
        in_flight_bytes=flying,
        enqueued=state.enqueued,
        stored=state.stored,
        dropped=state.dropped,
        dropped_bytes=state.dropped_bytes,
        failed=state.failed,
        refused=state.refused,
        pending_checkpoints=sum(i.checkpoint is not None for i in state.queued)
        + (state.in_flight is not None and state.in_flight.checkpoint is not None),
    )


def _with_drain(state: QueueState, effects: list[Effect]) -> list[Effect]:
    """``effects``, then a drain request when they release handles and none is in flight."""
    released = sum(isinstance(e, ReleaseHandle) for e in effects)
    state.undrained += released
    if state.drain_step is None or state.drain_in_flight or state.undrained == 0:
        return effects
    state.drain_in_flight = True
    state.undrained = 0
    state.drains_requested += 1
    return [*effects, RequestDrain(state.drain_step)]


def handle(state: QueueState, event: Event) -> tuple[QueueState, list[Effect]]:
    """Apply one event to ``state``; return it with the effects to perform, in order."""
    match event:
        case Envelope():
            state, effects = _handle(state, event)
            return state, _with_drain(state, effects)
        case StoreUnavailable(handle=handle_id, reason=reason):
            return state, _with_drain(state, _store_unavailable(state, handle_id, reason))
        case DrainUndelivered():
            # NOTE: nothing is in flight; the next release asks again.
            state.drain_in_flight = False
            state.undrained += 1
            return state, []
        case Stopping():
            return state, _stop(state)
        case _:
            assert_never(event)


def _handle(state: QueueState, envelope: Envelope) -> tuple[QueueState, list[Effect]]:
    body = envelope.body
    if isinstance(body, TurnDone):
        if state.drain_step is not None and body.step_id == state.drain_step:
            # NOTE: ok or refused (the gateway stopping), the drain is no longer in flight;
            # releases since it was asked for ask again (in ``handle``).
            state.drain_in_flight = False
        return state, []
    if isinstance(body, Enqueue):
        return state, enqueue(state, envelope, body)
    if isinstance(body, RemoveCheckpoints):
        return state, remove_checkpoints(state, body)
    if isinstance(body, StoreResult):
        return state, store_result(state, body)
    if isinstance(body, Failure):
        # NOTE: the runtime answers a Store whose handler raised with a Failure;
        # only one Store is ever outstanding, so it is the in-flight item's.
        if state.in_flight is None:
            return state, []
        return state, _store_unavailable(state, state.in_flight.handle, "writer_failed")
    if isinstance(body, DrainSpills):
        if drained(state):
            return state, [Answer(envelope, _drained_body(state))]
        state.drain_waiters.append(envelope)
        return state, []
    if isinstance(body, SpillQueueStatsRequest):
        return state, [Answer(envelope, stats(state))]
    raise UnknownSpillQueueMessage(f"spill queue has no rule for {body.kind!r}")
