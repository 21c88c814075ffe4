"""How many BLAS threads the batch lane's decode steps use, chosen by measuring them.

On a CPU, MLX runs every matrix product through the process's BLAS
(OpenBLAS, when preloaded). Its pthread build splits each product over its
threads and keeps them spinning between calls, so a decode step (about 200
small products, memory-bound) costs ~1.5x the CPU with 2 threads than with
one, and on a shared CPU (more runnable threads than cores) a descheduled
helper thread stalls every split product: measured on the 2-core benchmark
box at load average 5-6, a step of 4 rows took 188 ms with one thread and
253 ms with two (8 rows: 120 vs 148 ms); on a quiet box two threads win
(60 vs 93 ms for one row). Neither count is right everywhere, so the batch
lane measures: :class:`ThreadChooser` (pure: no clock, no BLAS) compares
the step times of the current count with short trials of the other one and
keeps the faster; :class:`BlasTuning` is the engine thread's shell (the
clock, the OpenBLAS calls, the synchronisation before a change).

NOTE: a product's low bits depend on the thread count for some shapes:
a prefill (many rows through OpenBLAS) of the default model with 1 thread
differs from 2 threads by up to 1.5e-5 in its KV, and on the tests' tiny
Llama by 2e-6 in a logprob. The default model's decode steps are bitwise
the same with 1 or 2 threads (measured over 40 steps: tokens and KV; the
projections go through the few-row product, which computes every output
alone, and the attention products split their outputs), so there only a
prefill under a tuned count can differ. The chosen count stays set between batch steps
(changing it costs a synchronisation), so the serial lane would otherwise
run under whatever count the batch lane chose last, and a request (a
resumed generation checkpoint, a grammar request) would not repeat its
answer bit for bit. :func:`serial_threads` gives the serial lane the
process's default count before each of its steps (the serial backend calls
it); a tuning made by :func:`make_blas_tuning` is tracked for it.
"""

from __future__ import annotations

import ctypes
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from kernels._device import generation_stream
from kernels._env import env_switch

__all__ = [
    "BLAS_TUNE_ENV",
    "BUSY_FRACTION",
    "BlasTuning",
    "OpenBlas",
    "StepTuning",
    "ThreadChooser",
    "blas_tune_enabled",
    "find_openblas",
    "make_blas_tuning",
    "serial_threads",
    "track_tuning",
]


BUSY_FRACTION = 0.8
"""CPU seconds per wall second, as a fraction of the thread count, above which the threads had their cores."""

_BACKOFF_MAX = 8
"""A lost trial doubles the interval to the next one, up to this many times ``explore_every``."""


class ThreadChooser:
    """Keep the faster of two thread counts for steps of the same shape (pure state machine).

    Samples are step durations in seconds of *clean* steps (decode only, the
    same rows before and after). The chooser runs ``current``; once it has
    ``window`` samples and then every ``explore_every`` samples (doubling
    after each trial the current count wins, up to 8x), it asks for a
    trial of ``window`` samples with the other count, and switches when the
    trial's median is below ``(1 - margin)`` times the median of the last
    ``window`` samples with the current count. The first sample after any
    change of count is dropped (that step only built the graph: the forward
    it waits for ran before the change). A change in the number of decoding
    rows starts the comparison afresh (ends a trial unjudged); the cadence
    of trials is kept. ``trials`` and ``switches`` count what it did.
    """

    def __init__(
        self,
        default: int,
        other: int = 1,
        *,
        window: int = 6,
        explore_every: int = 32,
        margin: float = 0.05,
        busy: float = BUSY_FRACTION,
    ) -> None:
        if default < 1 or other < 1:
            raise ValueError("thread counts must be >= 1")
        if window < 1 or explore_every < 1:
            raise ValueError("window and explore_every must be >= 1")
        self.current = default
        self.other = other
        self._window = window
        self._every = explore_every
        self._margin = margin
        self._base: list[float] = []
        self._trial: list[float] | None = None
        self._interval = explore_every
        self._since = explore_every
        self._rows = 0
        self._skip = 0
        self._busy = busy
        self._use: list[float] = []
        self.trials = 0
        self.skipped = 0
        self.switches = 0

    @property
    def threads(self) -> int:
        """The thread count the next step should run with."""
        return self.other if self._trial is not None else self.current

    def changed(self) -> None:
        """The thread count was just changed: the next sample does not measure it."""
        self._skip = 1

    def observe(self, rows: int, seconds: float, cpu_seconds: float | None = None) -> None:
        """A clean step of ``rows`` decoding rows took ``seconds`` with :attr:`threads` threads.

        ``cpu_seconds``: the process's CPU time over the same step, when known.
        While the larger count runs and its threads get their cores (the
        median of ``cpu_seconds / seconds`` over the window is at least
        ``busy`` x the count), a due trial of the smaller count is skipped
        (counted in :attr:`skipped`): fewer threads can only win when the
        ones running are kept waiting for a core, and on a free machine a
        trial costs its steps (measured: 5 % of a benchmark's throughput).
        """
        if rows != self._rows:
            # NOTE: the cadence of trials goes on (a batch whose rows change
            # every few steps must not pay a trial each time); only samples of
            # the same shape are compared.
            abandoned = self._trial is not None
            self._rows = rows
            self._base = []
            self._trial = None
            if abandoned:
                return  # NOTE: measured with the trial's count; the base is the current one's.
        if self._skip:
            self._skip -= 1
            return
        if self._trial is None:
            self._base = (
                [*self._base[-(self._window - 1) :], seconds] if self._window > 1 else [seconds]
            )
            if cpu_seconds is not None and seconds > 0:
                self._use = [*self._use[-(self._window - 1) :], cpu_seconds / seconds]
            self._since += 1
            if len(self._base) >= self._window and self._since >= self._interval:
                if self._free():
                    self.skipped += 1
                    self._since = 0
                    return
                self._trial = []
                self.trials += 1
            return
        self._trial.append(seconds)
        if len(self._trial) < self._window:
            return
        if statistics.median(self._trial) < statistics.median(self._base) * (1 - self._margin):
            self.current, self.other = self.other, self.current
            self._base = self._trial
            self.switches += 1
            self._interval = self._every
        else:
            # NOTE: back off while the current count keeps winning: a trial of
            # the slower count costs its steps.
            self._interval = min(self._interval * 2, self._every * _BACKOFF_MAX)
        self._trial = None
        self._since = 0

    def _free(self) -> bool:
        """The larger count runs and its threads got their cores over the window."""
        if self.current <= self.other or len(self._use) < self._window:
            return False
        return statistics.median(self._use) >= self._busy * self.current


class ThreadsPort(Protocol):
    """Set the BLAS library's thread count (process-wide)."""

    def set_threads(self, n: int) -> None:
        """Use ``n`` threads for the next products."""


class StepTuning(Protocol):
    """What :class:`kernels.engine.BatchGeneration` calls around each step (engine thread)."""

    def before_step(self) -> None:
        """Set the thread count the step should use (synchronising first when it changes)."""

    def after_step(self, rows: int, clean: bool) -> None:
        """The step is over: ``rows`` rows decoded; ``clean``: decode only, no row joined or left."""

    def release(self) -> None:
        """The batch is idle: give the process its default thread count back."""


class OpenBlas:
    """OpenBLAS's ``openblas_set_num_threads`` / ``openblas_get_num_threads`` through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._set = lib.openblas_set_num_threads
        self._set.argtypes = [ctypes.c_int]
        self._set.restype = None
        self._get = lib.openblas_get_num_threads
        self._get.argtypes = []
        self._get.restype = ctypes.c_int

    def get_threads(self) -> int:
        """The thread count OpenBLAS uses now."""
        return int(self._get())

    def set_threads(self, n: int) -> None:
        """Use ``n`` threads (never more than OpenBLAS started with; see :class:`BlasTuning`)."""
        self._set(n)


def find_openblas() -> OpenBlas | None:
    """The OpenBLAS this process has loaded (preloaded or a dependency), or ``None``."""
    # NOTE: None is the process's global namespace (a preloaded OpenBLAS);
    # a BLAS loaded as an extension's dependency is found by its mapped path.
    candidates: list[str | None] = [None]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        mapped = line.split()[-1] if line.split() else ""
        if mapped.startswith("/") and "blas" in Path(mapped).name and mapped not in candidates:
            candidates.append(mapped)
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        if hasattr(lib, "openblas_set_num_threads") and hasattr(lib, "openblas_get_num_threads"):
            return OpenBlas(lib)
    return None


class BlasTuning:
    """The engine thread's shell around a :class:`ThreadChooser` (implements :class:`StepTuning`).

    ``sync`` must wait until no matrix product of the lane is in flight (the
    kernel passes ``mx.synchronize`` of its stream): OpenBLAS's thread count
    is process-wide and must not change under a running product. Only counts
    up to ``default`` (what OpenBLAS started with) are used, so no thread is
    ever created. Engine thread only.
    """

    def __init__(
        self,
        port: ThreadsPort,
        default: int,
        sync: Callable[[], None],
        *,
        chooser: ThreadChooser | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        self.chooser = chooser if chooser is not None else ThreadChooser(default, 1)
        self._port = port
        self._default = default
        self._sync = sync
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._set = default
        self._start = 0.0
        self._cpu_start = 0.0

    def _apply(self, n: int) -> bool:
        if n == self._set:
            return False
        self._sync()
        self._port.set_threads(n)
        self._set = n
        return True

    def before_step(self) -> None:
        """Set the chooser's count (after a synchronisation when it changes); start the step's clock."""
        if self._apply(self.chooser.threads):
            self.chooser.changed()
        self._start = self._clock()
        if self._cpu_clock is not None:
            self._cpu_start = self._cpu_clock()

    def after_step(self, rows: int, clean: bool) -> None:
        """Hand a clean step's duration (and the process's CPU time over it, when clocked) to the chooser."""
        if clean and rows > 0:
            cpu = None if self._cpu_clock is None else self._cpu_clock() - self._cpu_start
            self.chooser.observe(rows, self._clock() - self._start, cpu)

    def release(self) -> None:
        """Back to the process's default count (the serial lane runs with it)."""
        if self._apply(self._default):
            self.chooser.changed()

    @property
    def threads(self) -> int:
        """The count set now."""
        return self._set

    @property
    def default(self) -> int:
        """The process's default count (the serial lane's)."""
        return self._default


_TRACKED: weakref.WeakSet[BlasTuning] = weakref.WeakSet()
"""The tunings that may hold a count other than the default (OpenBLAS's count is process-wide)."""


def track_tuning(tuning: BlasTuning) -> BlasTuning:
    """Let :func:`serial_threads` give ``tuning``'s threads back before serial work; returns it."""
    _TRACKED.add(tuning)
    return tuning


def serial_threads() -> int:
    """Put every tracked tuning back on the default count before a serial step (engine thread).

    Returns how many tunings changed the count (each after a synchronisation,
    so no product in flight sees the change). The batch lane's next step
    sets its chosen count again. NOTE: a no-op while no batch row runs (the
    lane releases when idle), so the serial lane alone pays nothing.
    """
    changed = 0
    for tuning in list(_TRACKED):
        if tuning.threads != tuning.default:
            tuning.release()
            changed += 1
    return changed


BLAS_TUNE_ENV = "KVTIER_BATCH_BLAS_TUNE"
"""Environment switch: ``0`` keeps the batch lane on the process's BLAS thread count."""


def blas_tune_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``KVTIER_BATCH_BLAS_TUNE`` is ``0``/``false``/``off``/``no`` (default: enabled)."""
    return env_switch(BLAS_TUNE_ENV, env)


def make_blas_tuning() -> BlasTuning | None:
    """The batch lane's tuning on a CPU device with OpenBLAS of 2+ threads, else ``None`` (engine thread)."""
    import mlx.core as mx
    if mx.default_device() != mx.cpu:
        return None  # NOTE: products run on the GPU, not through BLAS.
    blas = find_openblas()
    if blas is None:
        return None
    default = blas.get_threads()
    if default < 2:
        return None
    stream = generation_stream()
    # NOTE: process CPU time (every thread): with OpenBLAS's threads spinning
    # inside products, a free machine shows close to ``default`` CPU seconds
    # per wall second over a step; a contended one much less.
    return track_tuning(
        BlasTuning(
            blas,
            default,
            lambda: mx.synchronize(stream),
            cpu_clock=time.process_time,
        )
    )
