"""What the serving path needs of generation checkpoints (docs/cold-tier.md, "Generation checkpoints").

:class:`CheckpointPort` is built once by the engine's wiring when
``generation_checkpoint`` > 0 and the SSD tier is on. The turn runner asks it
for a request's key at admission (:meth:`CheckpointPort.key_of`), looks the
key up on a worker thread (:meth:`CheckpointPort.load`: the newest valid
file, read into host memory with every tensor hash checked; the gateway and
the batch scheduler start it with :meth:`CheckpointPort.load_soon`, whose
answer comes back on the event loop, see ``loads.CheckpointLoads``), and hands the
owned snapshots :class:`Captured` on the engine thread to the spill queue.
Lookups run on the port's own bounded pool (``LOOKUP_THREADS`` threads).
The serial lane's gateway loads a request's checkpoint beside its
prompt-cache ``Take`` and hands the found one to the turn runner by handle
(:meth:`CheckpointPort.hand_over` ... :meth:`CheckpointPort.claim`), so the
first turn never waits for a file lookup.

:class:`Captured` and :class:`ResumeFrom` cross from the engine thread to the
loop and back; both are immutable apart from ``ResumeFrom.host``, which the
engine thread alone consumes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import structlog

from kernels.cache import (
    CacheFileCorrupt,
    CacheFileIncompatible,
    FilePort,
    HostEntry,
    KvFileHeader,
    read_tensors,
)
from messages import CheckpointRecord, Enqueue, EntryMeta
from messages.gateway import Generate

from .counters import CheckpointCounters
from .key import checkpoint_refusal, request_key
from .store import find_checkpoint

__all__ = [
    "LOOKUP_THREADS",
    "Captured",
    "CheckpointBackend",
    "CheckpointHandoff",
    "CheckpointPort",
    "ResumeFrom",
]

LOOKUP_THREADS = 2
"""Checkpoint lookups one port runs at once (its own bounded pool, not the loop's default executor)."""

_log = structlog.get_logger("kvtier.checkpoints")


@runtime_checkable
class CheckpointBackend(Protocol):
    """What a backend offers to checkpoint and resume its generations (engine thread)."""

    def capture_checkpoint(self, gen: Any) -> tuple[Any, Any] | None:
        """``(CheckpointPoint, Registered)`` of an owned snapshot at the boundary, or ``None``."""
        ...

    def resume(self, request: Generate, header: KvFileHeader, host: Any) -> Any:
        """A generation resumed from a checkpoint file (raises when it does not fit)."""
        ...

    def forget_staged(self, staging_id: str) -> None:
        """Close a restored SSD entry a resumed request does not use."""
        ...


@dataclass(frozen=True, slots=True)
class Captured:
    """An owned snapshot of a row's caches at a checkpoint boundary (made on the engine thread).

    ``handle`` (a registry entry covering ``tokens`` = prompt + emitted)
    belongs to whoever holds this object until the spill queue accepts it.
    """

    handle: str
    meta: EntryMeta
    tokens: tuple[int, ...]
    prompt_len: int
    pending_token: int
    rng_key: tuple[int, int] | None
    writer: str = ""
    """The request it belongs to (its id; a checkpoint delta builds only on the same request's file)."""

    @property
    def sample_index(self) -> int:
        """Tokens emitted before the pending one."""
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True)
class ResumeFrom:
    """A found checkpoint, validated and read into host memory (worker thread)."""

    path: str
    header: KvFileHeader
    host: HostEntry

    @property
    def emitted(self) -> int:
        """Tokens the checkpoint replays."""
        ck = self.header.checkpoint
        return 0 if ck is None else ck.sample_index


class CheckpointHandoff:
    """Loaded checkpoints on their way from the gateway to the lane that runs the request (a loop-only port).

    The gateway loads a request's checkpoint at admission and puts it here
    under the handle its ``RunTurn`` carries; the turn runner or the batch
    lane takes it in the request's first turn. Shared by their
    :class:`CheckpointPort` objects as a loop-only port: :meth:`put` and
    :meth:`take` run on the event loop, each one synchronous dict operation
    with no ``await``, so two actors' calls never interleave.
    NOTE: the thread that builds it owns it; a call from any other thread
    raises instead of racing.
    """

    def __init__(self) -> None:
        self._held: dict[str, ResumeFrom] = {}
        self._owner = threading.get_ident()

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("CheckpointHandoff is loop-only: used from another thread")

    def put(self, handle: str, found: ResumeFrom) -> None:
        """Hold ``found`` under ``handle`` until it is taken."""
        self._check_thread()
        self._held[handle] = found

    def take(self, handle: str) -> ResumeFrom | None:
        """Take what ``handle`` holds (``None``: unknown or already taken)."""
        self._check_thread()
        return self._held.pop(handle, None)

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class CheckpointPort:
    """The checkpoint settings and figures the turn runner works with.

    ``every``: emitted tokens between checkpoints. ``directory``: the
    checkpoint directory of ``fingerprint`` (the SSD tier's). ``spill_queue``:
    where snapshots go. ``dispose``: releases a snapshot's registry handle
    that never reached the queue.
    """

    every: int
    directory: str
    fingerprint: str
    port: FilePort
    spill_queue: str
    dispose: Any
    counters: CheckpointCounters
    verify: bool = True
    handed: CheckpointHandoff = field(default_factory=CheckpointHandoff, repr=False)
    """Checkpoints handed over and not yet claimed (shared by the gateway's and the runner's ports)."""
    lookups: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=LOOKUP_THREADS, thread_name_prefix="kvtier-ckpt-lookup"),
        repr=False, compare=False)
    """Where :meth:`load_soon` runs lookups: ``LOOKUP_THREADS`` threads, started on first use,
    ended when the port is garbage-collected (a burst of admissions queues here instead of
    taking the loop's default executor)."""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError("every must be > 0")

    def hand_over(self, request_id: str, found: ResumeFrom) -> str:
        """Hold ``found`` for ``request_id``'s first turn; the handle its ``RunTurn`` carries (event loop only)."""
        handle = f"ckpt:{request_id}"
        self.handed.put(handle, found)
        return handle

    def claim(self, handle: str) -> ResumeFrom | None:
        """Take the checkpoint held under ``handle`` (``None``: unknown or already claimed)."""
        return self.handed.take(handle)

    def key_of(self, request: Generate) -> str | None:
        """``request``'s checkpoint key, or ``None`` (counted) when v1 does not checkpoint it."""
        reason = checkpoint_refusal(request.params)
        if reason is not None:
            self.counters.refuse(reason)
            return None
        return request_key(request.prompt_tokens, request.params,
                           namespace=request.namespace, fingerprint=self.fingerprint)

    def load(self, key: str, namespace: str, prompt: tuple[int, ...]) -> ResumeFrom | None:
        """The newest valid checkpoint of ``key`` read into host memory (worker thread; ``None``: none).

        A file whose prompt is not ``prompt`` or whose tensors fail their
        hashes is not used (a fresh run follows).
        """
        found = find_checkpoint(self.port, self.directory, key,
                                fingerprint=self.fingerprint, namespace=namespace)
        if found is None:
            return None
        ck = found.header.checkpoint
        if ck is None or found.header.tokens[:ck.prompt_len] != prompt \
                or ck.prompt_len != len(prompt):
            return None
        try:
            host = read_tensors(self.port, found.path, found.header, verify=self.verify)
        except (CacheFileCorrupt, CacheFileIncompatible, OSError):
            return None
        return ResumeFrom(found.path, found.header, host)

    def load_soon(
        self,
        key: str,
        namespace: str,
        prompt: tuple[int, ...],
        on_loaded: Callable[[ResumeFrom | None], object],
        *,
        request_id: str = "",
    ) -> None:
        """Run :meth:`load` on the port's bounded pool; ``on_loaded(found)`` runs on the event loop when it ends.

        Called on the event loop; never waits. A lookup that raises (or is
        cancelled) answers ``None``, logged with ``request_id``.
        """
        loop = asyncio.get_running_loop()

        def done(future: asyncio.Future[ResumeFrom | None]) -> None:
            exc = None if future.cancelled() else future.exception()
            if exc is not None:
                # NOTE: a lookup that fails is a fresh run, never a failed request.
                _log.warning("checkpoint.lookup_failed", request_id=request_id, error=repr(exc))
            on_loaded(None if future.cancelled() or exc is not None else future.result())

        future = loop.run_in_executor(self.lookups, self.load, key, namespace, prompt)
        future.add_done_callback(done)

    def enqueue(self, key: str, namespace: str, cap: Captured) -> Enqueue:
        """The spill-queue item of ``cap`` (the queue owns its handle once it accepts it)."""
        record = CheckpointRecord(request_key=key, prompt_len=cap.prompt_len,
                                  pending_token=cap.pending_token,
                                  sample_index=cap.sample_index, rng_key=cap.rng_key,
                                  writer=cap.writer)
        return Enqueue(handle=cap.handle, namespace=namespace, tokens=cap.tokens, meta=cap.meta,
                       source="checkpoint", checkpoint=record)
