"""Ports of the durability coordinator: cloning RAM entries, background steps, the alarm.

- :class:`Cloner`: clones a RAM entry behind a handle (on the engine thread,
  inside a background turn) and disposes clones. :class:`RegistryCloner` is
  the one over ``kernels.CacheRegistry``.
- :class:`CloneSlot`: where one clone step leaves its outcome for the actor;
  it guarantees the clone is disposed exactly once when nobody takes it.
- :class:`StepRegistry`: the turn runner's registry of background step
  callables (callables never travel in messages; the gateway's
  ``RunWhenIdle`` names them by ``step_id``).
- :class:`Alarm`: ONE timer that wakes the actor at a clock time;
  :class:`LoopAlarm` uses the event loop's ``call_later``. Simulated runs
  pass an alarm the scenario fires itself. Both are the runtime's
  (``actors.runtime``), re-exported here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from actors.engine_thread import BackgroundSteps, StepHandle
from actors.runtime import Alarm, LoopAlarm
from kernels.cache import CacheRegistry, UnknownCacheHandle
from messages import EntryMeta

from .core import Cloned, CloneFailed, CloneOutcome, Vanished

__all__ = [
    "Alarm",
    "CloneSlot",
    "Cloner",
    "GatewaySteps",
    "LoopAlarm",
    "RegistryCloner",
    "StepRegistry",
]


class Cloner(Protocol):
    """Clones RAM entries for snapshots, and disposes clones."""

    def clone(self, handle: str) -> tuple[str, EntryMeta] | None:
        """Engine thread: register a copy of ``handle``'s entry; ``None`` if the handle is gone."""
        ...

    def dispose(self, handle: str) -> None:
        """Any thread: give a clone back (``KeyError`` if it is unknown)."""
        ...


class RegistryCloner:
    """:class:`Cloner` over the engine's ``CacheRegistry``.

    NOTE: registered entries are never written (requests get views from
    ``materialize``), so a clone is zero-copy views of the same buffers
    registered under a new handle: it costs no copy, and it keeps the
    buffers alive after the RAM tier disposes the original, until the spill
    queue releases the clone.
    """

    def __init__(self, registry: CacheRegistry) -> None:
        self._registry = registry

    def clone(self, handle: str) -> tuple[str, EntryMeta] | None:
        """See :meth:`Cloner.clone`."""
        try:
            meta = self._registry.meta(handle)
            views = self._registry.materialize(handle, meta.offset)
        except UnknownCacheHandle:
            return None
        kept = self._registry.register(views, offset=meta.offset)
        return kept.handle, kept.meta

    def dispose(self, handle: str) -> None:
        """See :meth:`Cloner.dispose`."""
        self._registry.dispose(handle)


class CloneSlot:
    """The outcome of one clone step, handed from the engine thread to the actor.

    The step (:meth:`run`) leaves its outcome here; the actor takes it
    (:meth:`take`) when the step's ``TurnDone`` arrives, or gives the slot up
    (:meth:`abandon`). Whichever comes second disposes a clone nobody will
    use, so a clone is never leaked and never disposed twice.
    """

    __slots__ = ("_cloner", "_closed", "_handle", "_lock", "_outcome")

    def __init__(self, cloner: Cloner, handle: str) -> None:
        self._cloner = cloner
        self._handle = handle
        self._lock = threading.Lock()
        self._outcome: CloneOutcome | None = None
        self._closed = False

    def run(self) -> None:
        """Engine thread: clone the handle and leave the outcome (the step callable)."""
        outcome: CloneOutcome
        try:
            made = self._cloner.clone(self._handle)
        except Exception as exc:  # noqa: BLE001 - reported as the attempt's outcome, never lost
            outcome = CloneFailed(f"{type(exc).__name__}: {exc}")
        else:
            outcome = Vanished() if made is None else Cloned(made[0], made[1])
        with self._lock:
            if not self._closed:
                self._outcome = outcome
                return
        if isinstance(outcome, Cloned):
            self._cloner.dispose(outcome.handle)

    def take(self) -> CloneOutcome | None:
        """The outcome if the step ran (a clone's ownership passes to the caller); closes the slot."""
        with self._lock:
            self._closed = True
            outcome, self._outcome = self._outcome, None
        return outcome

    def abandon(self) -> None:
        """Nobody will take the outcome: dispose a clone made (or made later)."""
        outcome = self.take()
        if isinstance(outcome, Cloned):
            self._cloner.dispose(outcome.handle)


class StepRegistry(Protocol):
    """The turn runner's background-step registry, as the coordinator uses it."""

    def add(self, step_id: str, fn: Callable[[], Any]) -> object:
        """Register ``fn`` to run on the engine thread when ``RunWhenIdle(step_id)`` is granted."""
        ...

    def discard(self, step_id: str) -> None:
        """Forget ``step_id``: if it has not run yet, it never will (no error if unknown)."""
        ...


class GatewaySteps:
    """:class:`StepRegistry` over the turn runner's ``BackgroundSteps`` (``actors.gateway``)."""

    def __init__(self, steps: BackgroundSteps) -> None:
        self._steps = steps
        self._handles: dict[str, StepHandle[Any]] = {}

    def add(self, step_id: str, fn: Callable[[], Any]) -> object:
        """See :meth:`StepRegistry.add`."""
        handle = self._steps.add(step_id, fn)
        self._handles[step_id] = handle
        return handle

    def discard(self, step_id: str) -> None:
        """See :meth:`StepRegistry.discard`."""
        handle = self._handles.pop(step_id, None)
        if handle is not None:
            handle.withdraw()
