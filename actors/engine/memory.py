"""The readings behind the memory-pressure guard (every function here runs ON the engine thread).

The decision itself is pure (``actors/engine_thread/memory_guard.py``); this
module reads what it needs from the process, MLX and the loaded model: the
memory in use (:class:`ProcessMemory`), the default budget, and the request
footprint's model shape (the KV geometry of one populated prototype cache).

The reading is the process's resident memory (RSS), so the budget bounds
what the operating system sees, not only MLX's arrays:

    reading = max(RSS now, RSS at start + (MLX active + cache now) - (MLX active + cache at start))

The first term is exact where MLX's buffers are host memory (the CPU; Apple
silicon's unified memory mapped into the process). The second keeps the
reading honest where device memory is not part of RSS (a CUDA device): the
host baseline the guard started with plus what MLX has added since. Under
CUDA a third floor is the device's memory in use by every process on it
(total less free, :func:`kernels.device_used_bytes`): the budget there is
the device's memory, and another process on the same card takes from it
what MLX's own counters cannot see. RSS is
read from ``/proc/self/statm`` on Linux and ``task_info`` on macOS (a few
microseconds); elsewhere only the second term is known, and the stated
margin (:func:`actors.engine_thread.memory_guard.stated_margin`) must then also
hold the interpreter and its libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from actors.engine_thread.memory_guard import Footprint

__all__ = [
    "TRIM_AFTER_BYTES",
    "HeapTrim",
    "ProcessMemory",
    "active_memory_bytes",
    "default_budget_bytes",
    "mlx_cache_limit_bytes",
    "mlx_memory_bytes",
    "mlx_memory_parts",
    "model_footprint",
    "release_freed_memory",
    "resident_memory_bytes",
    "settle_memory",
    "trim_host_heap",
]


def active_memory_bytes() -> int:
    """MLX's active memory: bytes held by live arrays (engine thread)."""
    import mlx.core as mx

    return int(mx.get_active_memory())


def mlx_memory_bytes() -> int:
    """MLX's active memory plus its buffer cache (freed buffers kept for reuse; engine thread)."""
    import mlx.core as mx

    return int(mx.get_active_memory()) + int(mx.get_cache_memory())


def mlx_memory_parts() -> tuple[int, int, int]:
    """MLX's active memory, buffer cache and peak memory since start (engine thread)."""
    import mlx.core as mx

    return int(mx.get_active_memory()), int(mx.get_cache_memory()), int(mx.get_peak_memory())


_statm: tuple[int, int] | None = None
"""(pid, descriptor) of this process's open ``/proc/PID/statm``."""


def _statm_rss() -> int:
    global _statm
    # NOTE: kept open and read with pread (3 us, against 22 us to open it each
    # time); opened by pid, and again in a forked child.
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE


class _TimeValue(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_int), ("microseconds", ctypes.c_int)]


class _MachTaskBasicInfo(ctypes.Structure):
    # NOTE: <mach/task_info.h> declares it under #pragma pack(4).
    _pack_ = 4
    _fields_ = [
        ("virtual_size", ctypes.c_uint64),
        ("resident_size", ctypes.c_uint64),
        ("resident_size_max", ctypes.c_uint64),
        ("user_time", _TimeValue),
        ("system_time", _TimeValue),
        ("policy", ctypes.c_int),
        ("suspend_count", ctypes.c_int),
    ]


_MACH_TASK_BASIC_INFO = 20


def _mach_rss_reader() -> Callable[[], int] | None:
    path = ctypes.util.find_library("System")
    if path is None:
        return None
    libc = ctypes.CDLL(path)
    task = ctypes.c_uint32.in_dll(libc, "mach_task_self_").value
    count_words = ctypes.sizeof(_MachTaskBasicInfo) // 4

    def read() -> int:
        info = _MachTaskBasicInfo()
        count = ctypes.c_uint32(count_words)
        status = libc.task_info(task, _MACH_TASK_BASIC_INFO, ctypes.byref(info),
                                ctypes.byref(count))
        if status != 0:
            raise OSError(f"task_info(MACH_TASK_BASIC_INFO) failed: kern_return_t {status}")
        return int(info.resident_size)

    return read


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _rss_reader() -> Callable[[], int] | None:
    if os.path.exists("/proc/self/statm"):
        return _statm_rss
    if sys.platform == "darwin":
        return _mach_rss_reader()
    return None


def resident_memory_bytes() -> int | None:
    """The process's resident set size now (``None`` where the OS gives no cheap reading)."""
    read = _rss_reader()
    return None if read is None else read()


class ProcessMemory:
    """The guard's reading of the memory in use; construct and call ON the engine thread.

    ``read()`` returns ``max(RSS, RSS at start + MLX growth since start)``
    (module docstring); ``resident`` and ``mlx`` keep the last components
    (``resident`` is ``None`` where RSS cannot be read). With ``parts``
    (:func:`mlx_memory_parts`) the MLX figure is its active + cache memory
    and ``mlx_parts`` keeps (active, cache, peak) for ``/stats``. With
    ``device`` (:func:`kernels.device_used_bytes`, under CUDA) the device's
    memory in use by every process on it is one more floor, kept in
    ``device_used``.
    """

    def __init__(self, rss: Callable[[], int | None] = resident_memory_bytes,
                 mlx: Callable[[], int] = mlx_memory_bytes,
                 parts: Callable[[], tuple[int, int, int]] | None = None,
                 device: Callable[[], int | None] | None = None) -> None:
        self._rss = rss
        self._parts = parts
        self._device = device
        self.device_used: int | None = None
        self._mlx = mlx if parts is None else functools.partial(self._from_parts, parts)
        self.mlx_parts: tuple[int, int, int] | None = None
        self.mlx_at_start = self._mlx()
        self.resident_at_start = rss()
        self.resident: int | None = self.resident_at_start
        self.mlx = self.mlx_at_start

    def _from_parts(self, parts: Callable[[], tuple[int, int, int]]) -> int:
        self.mlx_parts = parts()
        return self.mlx_parts[0] + self.mlx_parts[1]

    def resident_now(self) -> int | None:
        """The process's RSS now (any thread: a procfs or Mach read, no MLX call; ``None`` where unreadable)."""
        return self._rss()

    def read(self) -> int:
        """The reading now (engine thread)."""
        mlx = self._mlx()
        resident = self._rss()
        device = None if self._device is None else self._device()
        self.mlx, self.resident, self.device_used = mlx, resident, device
        base = self.resident_at_start or 0
        grown = base + mlx - self.mlx_at_start
        return max(resident or 0, grown, mlx, device or 0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def trim_host_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); True if it did.

    NOTE: glibc raises its mmap threshold to the size of each mapped chunk
    freed (up to 32 MiB); afterwards buffers that size come from the heap and
    stay resident once freed. Measured with a 64 KiB-per-token model, RSS
    grew 37 MiB more than MLX's active and cached memory over one
    700-token request and did not come back until trimmed. Pinning the
    threshold instead (mallopt) cost 6 % more CPU on the default model's
    prefill (every large buffer faulted in again), so the guard trims only
    where a reading decides something: before it refuses or relieves.
    Other C libraries (macOS maps large allocations) are left alone.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))


def settle_memory() -> None:
    """Empty MLX's buffer cache and trim the C heap, so RSS holds live memory only (engine thread).

    The guard calls it before a reading that could refuse a request or move
    cached entries out: freed buffers are reusable, not in use. Cost: the
    heap trim, about 0.2 ms (no garbage collection: a full one took 100 ms
    and freed nothing the guard's scenarios needed).

    NOTE: under CUDA the buffers ``clear_cache`` frees are back on the device
    at once, where the reading's device figure (total less free) sees them:
    measured on an H100 (MLX 0.32.4), 4 GiB freed raised the free figure by 4
    GiB before any synchronization (``tools/bench/cuda_memory_guard.py``).
    """
    import mlx.core as mx

    mx.clear_cache()
    trim_host_heap()


TRIM_AFTER_BYTES = 32 * 1024**2
"""Resident memory that neither MLX nor the last trim's reading accounts for, after which
:class:`HeapTrim` trims the C heap."""


class HeapTrim:
    """Trims the C heap after an engine job once RSS holds ``threshold`` bytes more than MLX explains (engine thread).

    Why: MLX allocates its buffers with ``malloc``. Once a freed mapped
    chunk has raised glibc's mmap threshold (up to 32 MiB), KV buffers,
    registry entries and prefill activations come from the glibc arena of
    the thread that evaluates them, and a freed one stays resident: glibc
    gives a non-main arena's pages back only from its top, never from the
    holes between live buffers, and a new buffer that does not fit a hole
    grows the arena. MLX's own figures stay flat while that happens (what
    it frees it allocates again elsewhere), so the rule watches RSS, not
    MLX: with 8 batch rows and the RAM tier and the spill queue turning
    over, that arena held 589-707 MB of which 245-273 MB were in use, and
    peak RSS grew 1.6 x the two caps over 200 requests
    (docs/benchmarks/batching.md, "Memory with rows active"). A trim
    (glibc ``malloc_trim(0)``) hands every free page of every arena back.

    The rule: the excess is RSS minus MLX's active and cached memory (what
    the process holds besides MLX's live and cached buffers); ``floor`` is
    the lowest excess seen since the last trim, starting at the excess right
    after it. After a job (the engine's executor) or a batch step (a chain
    of steps is one job: ``run_chain``'s ``after_step``, after each step
    that changed the batch and each ``HEAP_CHECK_EVERY``-th plain decode
    step, since the RSS reading costs up to a millisecond while the step's
    threads fault pages in) that leaves the
    excess ``threshold`` or more above ``floor``, trim and read the floor
    again. So between jobs at most
    about ``threshold`` bytes of freed heap stay resident, and a trim runs
    only after that much piled up: measured 2-30 ms each (the walk over the
    free chunks and their ``madvise``), against batch steps and prefills of
    tens of milliseconds to seconds. ``trims`` and ``trim_s`` count the
    trims and their time. Where RSS cannot be read, or the C library has no
    trim (not glibc), it never trims. NOTE: on a CUDA device MLX's memory is
    not in RSS, so device memory MLX frees raises the excess too; a trim
    that then gives nothing back only resets the floor (one walk of the
    heap per 32 MiB freed, not one per job). Not measured on a GPU yet.
    """

    def __init__(
        self,
        *,
        threshold: int = TRIM_AFTER_BYTES,
        rss: Callable[[], int | None] = resident_memory_bytes,
        mlx: Callable[[], int] = mlx_memory_bytes,
        trim: Callable[[], bool] = trim_host_heap,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if threshold <= 0:
            raise ValueError("threshold must be > 0")
        self.threshold = threshold
        self._rss = rss
        self._mlx = mlx
        self._trim = trim
        self._clock = clock
        self._floor: int | None = None
        self.trims = 0
        self.trim_s = 0.0

    def _excess(self) -> int | None:
        resident = self._rss()
        return None if resident is None else resident - self._mlx()

    def after_job(self) -> bool:
        """Trim when the excess is ``threshold`` above its floor (engine thread); returns whether it trimmed."""
        excess = self._excess()
        if excess is None:
            return False
        if self._floor is None or excess < self._floor:
            self._floor = excess
        if excess - self._floor < self.threshold:
            return False
        start = self._clock()
        trimmed = self._trim()
        self.trim_s += self._clock() - start
        if not trimmed:
            # NOTE: nothing came back (or no trim here): what piled up is live; start from it.
            self._floor = excess
            return False
        self.trims += 1
        self._floor = self._excess()
        return True


def release_freed_memory(drain: Callable[[], object]) -> None:
    """Run ``drain`` (it drops released arrays), then :func:`settle_memory` (engine thread).

    NOTE: without it the freed arrays stay in MLX's cache (up to its limit)
    and in the C heap, so in RSS: a relief would hand entries back and the
    reading would not fall.
    """
    drain()
    settle_memory()


def mlx_cache_limit_bytes() -> int:
    """MLX's buffer-cache limit in force (engine thread; read by setting it back unchanged)."""
    import mlx.core as mx

    limit = int(mx.set_cache_limit(0))
    mx.set_cache_limit(limit)
    return limit


def default_budget_bytes() -> int:
    """The smaller of usable RAM and the device's memory (engine thread, at start).

    Usable RAM: what the system still has available plus what the process
    already holds (its RSS, at least MLX's active and cached memory: the
    weights are read before this is called). The device's memory: Metal's
    ``max_recommended_working_set_size``; under CUDA the GPU's total memory,
    where MLX's arrays live (a 24 GiB card in a 64 GiB host must not be
    budgeted the host's RAM); the CPU reports none.
    """
    import mlx.core as mx

    from kernels import available_memory_bytes, device_memory_bytes

    held = max(resident_memory_bytes() or 0, mlx_memory_bytes())
    usable = available_memory_bytes() + held
    info = mx.device_info()
    working = info.get("max_recommended_working_set_size") if isinstance(info, dict) else None
    if isinstance(working, int) and working > 0:
        usable = min(usable, working)
    device = device_memory_bytes()
    if device > 0:
        usable = min(usable, device)
    return usable


def model_footprint(model: Any, scheme: Any, chunk: int) -> Footprint:
    """The request footprint of ``model`` under KV ``scheme`` with prefill chunks of ``chunk`` tokens.

    Runs one token through a fresh cache to read the KV geometry (engine
    thread; a few milliseconds), then drops it.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kernels import KvGeometry

    args = getattr(model, "args", None)
    if args is None:
        # NOTE: not an mlx-lm model (a wrapper): its shape is unknown, and
        # a probing forward could change what it does next.
        raise ValueError("the model has no ModelArgs; its footprint is unknown")
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    geometry = KvGeometry.from_caches(caches)
    del caches
    kv_scheme = scheme if scheme is not None and getattr(scheme, "quantized", False) else None
    hidden = _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    intermediate = _int(args, "intermediate_size") or 4 * hidden
    dtype_bytes = _compute_dtype_bytes(model)
    return Footprint(
        # NOTE: cached: asked per running request before every prefill (their
        # growth), always at multiples of the KV buffers' 256-token step.
        kv_bytes_at=functools.lru_cache(maxsize=4096)(
            functools.partial(geometry.bytes_at, scheme=kv_scheme)),
        chunk=chunk,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        dtype_bytes=dtype_bytes,
    )


def _int(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return value if isinstance(value, int) and value > 0 else 0


def _compute_dtype_bytes(model: Any) -> int:
    """Bytes per element of the model's first floating-point parameter (its compute dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # NOTE: quantized weights are integers; their scales and the norms keep
    # the compute dtype, so the first float parameter tells it.
    flat: Any = tree_flatten(model.parameters())
    for _, value in flat:
        if mx.issubdtype(value.dtype, mx.floating):
            return int(value.dtype.size)
    return 2
