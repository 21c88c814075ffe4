"""The MLX streams a restore's landing allocates its arrays on (engine thread).

A landing (:func:`kernels.cache.land_entry`) allocates every destination
array at its final size before the file's bytes are read into it. On a CPU
device that allocation is the landing's floor: MLX's CPU allocator takes
fresh memory from ``malloc`` (``mmap`` for large buffers) and MLX zero-fills
each new array on its stream's thread, so every page of the restored entry
is faulted in there, one 4 KiB page at a time (0.85-2.4 GB/s on the 2-core
VM, against 7-14 GB/s for ``dd`` copying cached pages into one reused
buffer). Two CPU streams fault two arrays' pages at once (each stream has
its own thread): the fill alone ran 1.55x as fast on 2 cores
(docs/benchmarks/cold_tier.md, "Landing memory").

NOTE: no huge-page advice (``madvise(MADV_HUGEPAGE)``) on the arrays:
MLX zero-fills an array inside the ``mx.eval`` that allocates it, before
Python can see its address, so advice on the array's range would come
after its pages were faulted and change nothing. The only earlier hook is
glibc's process-wide ``glibc.malloc.hugetlb=1`` tunable (set before the
process starts); measured on the VM it made the fill 2.5-3.5x slower once
freed memory had been handed back to the host (free page reporting), so it
is documented for operators (docs/operations.md) and not used here.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import mlx.core as mx

__all__ = ["FILL_STREAMS", "landing_streams"]

FILL_STREAMS: Final = 2
"""CPU streams a landing fills its new arrays on, on a CPU device (one per landing thread)."""

_local = threading.local()


def landing_streams(device: Any | None = None) -> list[Any]:
    """The streams a landing allocates its arrays on, round robin (call on the engine thread).

    On a CPU device (``device``, default ``mx.default_device()``): the
    calling thread's default CPU stream plus ``FILL_STREAMS - 1`` more,
    made once per thread (an MLX stream is usable only on the thread that
    made it). On any other device (CUDA, Metal) only ``mx.cpu``: the
    landing there is unchanged (its arrays come from the GPU backend's
    allocator, where the CPU page-fault floor is not what was measured).
    """
    dev = mx.default_device() if device is None else device
    if dev.type != mx.DeviceType.cpu:
        return [mx.cpu]
    extra: list[Any] | None = getattr(_local, "streams", None)
    if extra is None:
        extra = [mx.new_stream(mx.cpu) for _ in range(FILL_STREAMS - 1)]
        _local.streams = extra
    return [mx.cpu, *extra]
