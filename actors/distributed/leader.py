"""Rank 0's backend under tensor parallelism: every engine-thread call is first told to the other ranks.

:class:`LeaderBackend` wraps rank 0's ``MlxBackend``. Each call that runs a
forward (``step``) or changes what a rank's KV holds (``open``, ``snapshot``,
``register``, ``discard``, and the prompt cache's disposals) sends its
command (``protocol.Op``) before or after doing the same on rank 0, so the
other ranks run the same sharded forwards in the same order (their layers
``all_sum`` with rank 0's) and keep the same prompt-cache entries.

NOTE: ``open`` and ``snapshot``/``register`` run no collective, so their
command goes AFTER rank 0's call and carries its outcome (the tokens rank 0
really reused, the handle it registered): the other ranks copy outcomes and
never decide anything themselves. ``step`` goes BEFORE: the forward on rank 0
waits in its first ``all_sum`` for the others to join.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from actors.engine_thread.ports import Registered, StepResult
from kernels.distributed import Command
from messages.gateway import Generate

from .protocol import Op, encode_handles, encode_open

__all__ = ["LeaderBackend", "Sender", "TensorParallelUnsupported", "seeded"]


class TensorParallelUnsupported(RuntimeError):
    """A request needs something tensor-parallel serving does not do (e.g. restoring an SSD entry)."""


class Sender(Protocol):
    """Where rank 0's commands go (``kernels.distributed.Channel``; a recording fake in tests)."""

    def send(self, command: Command) -> None:
        """Deliver ``command`` to every other rank, in order."""
        ...


class HandleSource(Protocol):
    """Rank 0's cache registry, read for the handles it still holds (``kernels.CacheRegistry``)."""

    def entries(self) -> dict[str, Any]:
        """Every live handle (with its metadata)."""
        ...


def seeded(request: Generate, draw: Callable[[], int]) -> Generate:
    """``request`` with a seed of its own when it samples without one.

    NOTE: an unseeded request draws from the process's global MLX key, which
    differs per rank; a rank that samples another token writes other KV and
    the ranks' forwards part ways. A seed drawn here and sent with the
    request makes every rank draw the same tokens.
    """
    params = request.params
    if params.greedy or params.seed is not None:
        return request
    return request.model_copy(update={"params": params.model_copy(update={"seed": draw()})})


def _draw_seed() -> int:
    return secrets.randbelow(2**63)


class LeaderBackend:
    """Rank 0's ``Backend``: ``inner``'s calls, each mirrored to the other ranks through ``sender``.

    ``registry`` (rank 0's ``CacheRegistry``, or ``None`` without a prompt
    cache) is read at the end of each turn: handles the other ranks hold and
    rank 0 no longer does were disposed, and are sent as one ``DISPOSE``.
    """

    def __init__(
        self,
        inner: Any,
        sender: Sender,
        registry: HandleSource | None,
        *,
        draw_seed: Callable[[], int] = _draw_seed,
    ) -> None:
        self._inner = inner
        self._sender = sender
        self._registry = registry
        self._draw = draw_seed
        self._next = 1
        self._ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._told: set[str] = set()
        # NOTE: a generation rank 0 drops without register/discard (a failed
        # turn) must still end on the other ranks; its id lands here when the
        # object dies (any thread: a lock), and the next turn's end sends it.
        self._lock = threading.Lock()
        self._dead: list[int] = []
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self.commands = 0

    def _send(self, command: Command) -> None:
        self._sender.send(command)
        self.commands += 1

    def _id(self, gen: Any) -> int:
        gid = self._ids.get(gen)
        if gid is None:
            raise KeyError("a generation this backend did not open")
        return gid

    def _ended(self, gen: Any) -> int:
        gid = self._id(gen)
        del self._ids[gen]
        finalizer = self._finalizers.pop(gid, None)
        if finalizer is not None:
            finalizer.detach()
        return gid

    def _on_dead(self, gid: int) -> None:
        with self._lock:
            self._dead.append(gid)

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> Any:
        """Open on rank 0, then tell the others the request and the prefix rank 0 really reused."""
        if staging_id is not None:
            raise TensorParallelUnsupported("restoring an SSD entry under tensor parallelism")
        request = seeded(request, self._draw)
        gen = self._inner.open(request, handle, cached_tokens)
        gid = self._next
        self._next += 1
        self._ids[gen] = gid
        used = int(gen.cached_tokens)
        self._finalizers[gid] = weakref.finalize(gen, self._on_dead, gid)
        self._send(encode_open(gid, request, handle if used else None, used))
        return gen

    def step(self, gen: Any) -> StepResult:
        """Tell the others to step, then step rank 0 (its forward meets theirs in each ``all_sum``)."""
        self._send(Command(Op.STEP, self._id(gen)))
        result: StepResult = self._inner.step(gen)
        return result

    def snapshot(self, gen: Any) -> Registered | None:
        """Snapshot on rank 0; the others register theirs under rank 0's handle."""
        reg: Registered | None = self._inner.snapshot(gen)
        if reg is not None:
            self._send(encode_handles(Op.SNAPSHOT, self._id(gen), [reg.handle]))
            self._told.add(reg.handle)
        return reg

    def register(self, gen: Any) -> Registered | None:
        """Register on rank 0 (the generation ends); the others keep theirs under rank 0's handle."""
        reg: Registered | None = self._inner.register(gen)
        gid = self._ended(gen)
        if reg is None:
            self._send(Command(Op.DISCARD, gid))
        else:
            self._send(encode_handles(Op.REGISTER, gid, [reg.handle]))
            self._told.add(reg.handle)
        return reg

    def discard(self, gen: Any) -> None:
        """End the generation on every rank without keeping its cache."""
        self._send(Command(Op.DISCARD, self._ended(gen)))
        self._inner.discard(gen)

    def end_turn(self) -> None:
        """Rank 0's housekeeping; the others forget what rank 0's prompt cache disposed."""
        with self._lock:
            dead, self._dead = self._dead, []
        for gid in dead:
            self._finalizers.pop(gid, None)
            self._send(Command(Op.DISCARD, gid))
        if self._registry is not None and self._told:
            gone = self._told.difference(self._registry.entries())
            if gone:
                self._send(encode_handles(Op.DISPOSE, 0, sorted(gone)))
                self._told.difference_update(gone)
        self._inner.end_turn()

    def stop(self) -> None:
        """Tell the other ranks that rank 0 stopped serving (engine thread, once, at shutdown)."""
        self._send(Command(Op.STOP, 0))
