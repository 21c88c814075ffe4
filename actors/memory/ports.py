"""What the memory actor's shell reads: the engine thread's memory gauges, and its alarm.

:class:`GuardGauges` reads, without waiting, the figures the engine thread
writes: the guard's gauge (replaced whole after every engine job, behind its
lock), the in-turn guard's counters, the reading's parts
(``actors.engine.memory.ProcessMemory``) and the C-heap trims
(``actors.engine.memory.HeapTrim``). NOTE: plain int reads of objects the
engine thread owns, like ``kernels.EngineThread.statistics()``; a reading
may be one job old, and memory freed between jobs makes it high, never low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from actors.engine_thread.memory_guard import MemoryGuard
from actors.runtime import Alarm, LoopAlarm
from messages.memory import AdmitMemory

from .core import Gauges, MemoryConfig, fits_now

__all__ = [
    "AdmissionCheck",
    "Alarm",
    "GaugePort",
    "GuardGauges",
    "HeapTrims",
    "LoopAlarm",
    "Reading",
]


class GaugePort(Protocol):
    """Where the shell reads :class:`~actors.memory.core.Gauges` (any thread, no waiting)."""

    def read(self) -> Gauges:
        """The figures now."""
        ...


class Reading(Protocol):
    """The last reading's parts (``actors.engine.memory.ProcessMemory``)."""

    resident: int | None
    mlx: int
    resident_at_start: int | None
    mlx_parts: tuple[int, int, int] | None
    device_used: int | None

    def resident_now(self) -> int | None:
        """The process's RSS now (any thread, no MLX call; ``None`` where unreadable)."""
        ...


class HeapTrims(Protocol):
    """The C-heap trims' counters (``actors.engine.memory.HeapTrim``)."""

    trims: int
    trim_s: float


class GuardGauges:
    """:class:`GaugePort` over the guard, its reading and the heap trims (each optional).

    ``active`` is the larger of the guard's latest reading and the process's
    RSS now (``Reading.resident_now``). NOTE: the latest reading is taken
    when an engine job ends, so the job running now has grown memory it
    does not show: a batch chain streams a row's last token before it ends,
    and that row's client may ask again at once. Admitted at once on that
    stale figure (by :class:`AdmissionCheck` or by the actor), such a
    request met the in-turn check (fresh, and unable to relieve: it runs
    inside a turn) and was refused although moving cached entries out would
    have made room (``tests/e2e/test_memory_guard_rss.py``, batch lane).
    RSS now covers what the running job has allocated so far; where MLX's
    memory is not resident memory (CUDA) it adds nothing. ``ahead`` is the
    guard's growth ledger (``MemoryGuard.ahead``), by lane: what the running
    requests may still add, published by each lane after every step.
    """

    def __init__(
        self,
        guard: MemoryGuard | None,
        reading: Reading | None = None,
        heap: HeapTrims | None = None,
    ) -> None:
        self._guard = guard
        self._reading = reading
        self._heap = heap

    def read(self) -> Gauges:
        """See :meth:`GaugePort.read`."""
        guard, reading, heap = self._guard, self._reading, self._heap
        if guard is None:
            return Gauges()
        ahead = tuple(sorted(guard.ahead.snapshot().items()))
        if reading is None:
            return Gauges(
                active=guard.gauge.active_bytes, ahead=ahead, samples=guard.gauge.samples,
                checks=guard.checks, refused=guard.refused, settled=guard.settled,
                refused_before_prefill=guard.refused_before_prefill,
            )
        return Gauges(
            active=max(guard.gauge.active_bytes, reading.resident_now() or 0),
            ahead=ahead,
            samples=guard.gauge.samples,
            checks=guard.checks,
            refused=guard.refused,
            refused_before_prefill=guard.refused_before_prefill,
            settled=guard.settled,
            resident=reading.resident,
            mlx=reading.mlx,
            resident_at_start=reading.resident_at_start,
            mlx_parts=reading.mlx_parts,
            device_used=reading.device_used,
            heap_trims=None if heap is None else heap.trims,
            heap_trim_s=None if heap is None else heap.trim_s,
        )


@dataclass(frozen=True, slots=True)
class AdmissionCheck:
    """The memory actor's "fits at once" rule over the same gauges, for the asker's fast path.

    ``Engine`` calls :meth:`fits` before it asks ``AdmitMemory``: a request
    that fits the latest reading needs no relief, so it is admitted without
    a round trip through the actor (measured: about 50-170 us per ask);
    only one that does not fit is asked, and the actor decides again on its
    own reading. NOTE: immutable; the gauge reads are thread-safe.
    """

    config: MemoryConfig
    gauges: GaugePort

    def fits(self, ask: AdmitMemory) -> bool:
        """Whether ``ask`` fits the budget now with nothing moved out (:func:`core.fits_now`)."""
        return fits_now(self.config, self.gauges.read(), ask)
