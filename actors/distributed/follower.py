"""A rank other than 0 under tensor parallelism: apply rank 0's commands to this rank's backend.

:class:`Follower` keeps this rank's generations by rank 0's ids and its
prompt-cache entries by rank 0's handles, and applies each command
(``protocol.Op``) to its own ``MlxBackend``: the same forwards in the same
order as rank 0 (their ``all_sum`` meet), the same entries kept and dropped.
It decides nothing; it has no HTTP, no actors, no event loop.

NOTE: a command that cannot be applied the way rank 0 applied it (an entry
this rank does not hold, a reuse that fell back to a cold prefill here but
not on rank 0) means the ranks' KV have parted: the next forward would mix
shards of different sequences. That is :class:`OutOfStep`, raised and fatal
for this rank; ``mlx.launch`` then stops the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import structlog

from kernels.distributed import Command

from .protocol import Op, decode_handles, decode_open

__all__ = ["Follower", "OutOfStep", "Receiver", "follow"]

_log = structlog.get_logger("kvtier.distributed")


class OutOfStep(RuntimeError):
    """This rank cannot do what rank 0 did: the ranks' KV caches would no longer match."""


class Receiver(Protocol):
    """Where rank 0's commands come from (``kernels.distributed.Channel``; a scripted fake in tests)."""

    def receive(self) -> Command:
        """The next command (blocks until rank 0 sends one)."""
        ...


class Follower:
    """Applies rank 0's commands to ``backend`` (this rank's ``MlxBackend``), engine thread only.

    ``registry`` is the backend's ``CacheRegistry`` (``None``: no prompt
    cache), where entries rank 0 disposed are disposed here too.
    """

    def __init__(self, backend: Any, registry: Any = None) -> None:
        self._backend = backend
        self._registry = registry
        self._gens: dict[int, Any] = {}
        self._handles: dict[str, str] = {}
        self.applied = 0
        self.steps = 0

    @property
    def open_generations(self) -> int:
        """Generations opened and not yet ended."""
        return len(self._gens)

    @property
    def entries(self) -> dict[str, str]:
        """Rank 0's handle -> this rank's handle, for every entry kept (a copy)."""
        return dict(self._handles)

    def apply(self, command: Command) -> bool:
        """Apply one command; ``False`` once rank 0 said ``STOP``."""
        op = Op(command.op)
        backend = self._backend
        try:
            match op:
                case Op.STOP:
                    return False
                case Op.OPEN:
                    self._open(command)
                case Op.STEP:
                    backend.step(self._gen(command.gen))
                    self.steps += 1
                case Op.SNAPSHOT:
                    self._keep(command, backend.snapshot(self._gen(command.gen)))
                case Op.REGISTER:
                    self._keep(command, backend.register(self._end(command.gen)))
                case Op.DISCARD:
                    backend.discard(self._end(command.gen))
                case Op.DISPOSE:
                    for handle in decode_handles(command.payload):
                        local = self._handles.pop(handle, None)
                        if local is None:
                            raise OutOfStep(f"rank 0 disposed {handle}, which this rank does not hold")
                        if self._registry is not None:
                            self._registry.dispose(local)
        finally:
            backend.end_turn()
        self.applied += 1
        return True

    def _gen(self, gid: int) -> Any:
        gen = self._gens.get(gid)
        if gen is None:
            raise OutOfStep(f"generation {gid} is not open on this rank")
        return gen

    def _end(self, gid: int) -> Any:
        gen = self._gen(gid)
        del self._gens[gid]
        return gen

    def _open(self, command: Command) -> None:
        if command.gen in self._gens:
            raise OutOfStep(f"generation {command.gen} is already open on this rank")
        request, handle, cached = decode_open(command.payload)
        local: str | None = None
        if handle is not None:
            local = self._handles.get(handle)
            if local is None:
                raise OutOfStep(f"rank 0 reused {handle}, which this rank does not hold")
        gen = self._backend.open(request, local, cached if local is not None else 0)
        if int(gen.cached_tokens) != (cached if local is not None else 0):
            raise OutOfStep(
                f"rank 0 reused {cached} tokens of {handle}; this rank reused {gen.cached_tokens}"
            )
        self._gens[command.gen] = gen

    def _keep(self, command: Command, reg: Any) -> None:
        (handle,) = decode_handles(command.payload)
        if reg is None:
            raise OutOfStep(f"rank 0 kept {handle}; this rank's backend refused the entry")
        self._handles[handle] = reg.handle


def follow(receiver: Receiver, follower: Follower, *, on_command: Callable[[Command], None] | None = None) -> int:
    """Apply rank 0's commands until ``STOP``; returns how many were applied (engine thread)."""
    while True:
        command = receiver.receive()
        if on_command is not None:
            on_command(command)
        if not follower.apply(command):
            _log.info("tp.follower_stopped", applied=follower.applied, steps=follower.steps)
            return follower.applied
