"""Landing: file bytes straight into MLX memory (engine thread + landing workers).

:func:`land_entry` allocates every array at its final capacity on the engine
thread and has :class:`LandingPool` threads read the file's ranges into them
(and hash them); the fill-stream and landing-thread counts are sized here.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import mlx.core as mx
import xxhash

from kernels._env import env_text

from ._file_port import FilePort, ShortRead
from ._kv_format import (
    _DTYPES,
    _READ_CHUNK,
    CacheFileCorrupt,
    LayerRecord,
    TensorRecord,
)
from ._kv_header import (
    _check_same,
)
from ._kv_reader import (
    OpenEntry,
)
from ._kv_restore import (
    _build,
)

__all__ = [
    "FILL_STREAMS_ENV",
    "FILL_STREAMS_MAX",
    "LANDING_THREADS_ENV",
    "LandingPool",
    "default_fill_streams",
    "fill_stream_count",
    "land_entry",
    "landing_thread_count",
    "usable_cpus",
]


# --- landing: file bytes straight into MLX memory (engine thread + landing workers) ---------

_MAX_IOV_PER_READ: Final = 512
"""Buffers per scatter read (below Linux's ``IOV_MAX`` of 1024)."""

_Job = Callable[[], None]


class LandingPool:
    """A few threads that read file ranges into buffers the engine thread hands them, and hash them.

    NOTE: the workers never call MLX. The engine thread allocates and
    evaluates each destination array and takes its ``memoryview``; a worker
    only fills that memory (``preadv``) and hashes it (xxh3), both of which
    release the GIL. A worker drops every reference to a job before it
    reports the job done, so the last reference to a view (and so to its
    array) is always the engine thread's.
    """

    def __init__(self, threads: int = 2, *, name: str = "kvtier-land") -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._jobs: queue.SimpleQueue[tuple[_Job, queue.SimpleQueue[BaseException | None]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        self._closed = False
        self._lock = threading.Lock()
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, done = item
            del item
            error: BaseException | None = None
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - NOTE: handed to the engine thread as is.
                error = exc
            del job
            done.put(error)
            del error, done

    def submit(self, job: _Job, done: queue.SimpleQueue[BaseException | None]) -> None:
        """Queue ``job``; its outcome (``None`` or the exception) is put on ``done``.

        ``RuntimeError`` once the pool is closed. NOTE: under the lock that
        :meth:`close` takes, so no job is queued behind the workers' stop
        marks (it would never run, and its waiter would wait forever).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("landing pool is closed")
            self._jobs.put((job, done))

    def post(self, job: _Job) -> None:
        """Queue ``job`` with nobody waiting for it (closing files); its outcome is dropped.

        A job posted this way must handle its own errors.
        """
        self.submit(job, queue.SimpleQueue())

    def close(self) -> None:
        """Stop the workers once the queued jobs ran (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
        for t in self._threads:
            t.join()


def _destinations(
    layers: Sequence[LayerRecord], step: int
) -> Iterator[tuple[TensorRecord, int | None]]:
    """Each tensor in file order with its landing capacity (token axis), ``None``: exact shape."""
    for layer in layers:
        capacity = -(-(layer.offset + 1) // step) * step
        for t in layer.tensors:
            yield t, capacity if layer.kind in ("kv", "quantized") else None
        yield from _destinations(layer.children, step)


def _rows(view: memoryview, rec: TensorRecord, capacity: int | None) -> list[memoryview]:
    """Where the file's bytes of ``rec`` go in its destination ``view``, in file order.

    A ``[B, H, T, ...]`` tensor landing in a ``[B, H, C, ...]`` buffer (C >=
    T, slack after each row) is ``B * H`` rows of ``T * ...`` elements, one
    every ``C * ...`` elements; without slack it is one contiguous range.
    """
    if capacity is None or capacity == rec.shape[2] or rec.nbytes == 0:
        return [view[: rec.nbytes]] if rec.nbytes else []
    rows = rec.shape[0] * rec.shape[1]
    row = rec.nbytes // rows
    stride = row // rec.shape[2] * capacity
    return [view[i * stride : i * stride + row] for i in range(rows)]


def _fill(
    port: FilePort, fd: int, index: int, rec: TensorRecord, rows: list[memoryview], verify: bool
) -> None:
    """Read ``rec``'s file range into ``rows`` (scatter reads of about 4 MiB), hashing as it goes."""
    hasher = xxhash.xxh3_64() if verify else None
    pieces: list[memoryview] = []
    for r in rows:
        pieces.extend(r[i : i + _READ_CHUNK] for i in range(0, len(r), _READ_CHUNK))
    offset = rec.offset
    try:
        start = 0
        while start < len(pieces):
            end, size = start, 0
            while end < len(pieces) and end - start < _MAX_IOV_PER_READ and size < _READ_CHUNK:
                size += len(pieces[end])
                end += 1
            batch = pieces[start:end]
            port.preadv_into(fd, batch, offset)
            if hasher is not None:
                for b in batch:
                    hasher.update(b)
            offset += size
            start = end
    except ShortRead as exc:
        raise CacheFileCorrupt(f"file truncated inside tensor {index}") from exc
    if hasher is not None and hasher.intdigest() != rec.hash:
        raise CacheFileCorrupt(f"tensor {index} ({rec.name}) hash mismatch")


def _fill_behind(
    entry: OpenEntry,
    port: FilePort,
    fd: int,
    index: int,
    rec: TensorRecord,
    rows: list[memoryview],
    verify: bool,
) -> None:
    """:func:`_fill` once the reader's pass went past tensor ``index`` (at once when it ended)."""
    entry.wait_passed(index)
    _fill(port, fd, index, rec, rows, verify)


FILL_STREAMS_MAX: Final = 8
"""The most fill streams the product chooses by itself."""

FILL_STREAMS_ENV: Final = "KVTIER_LANDING_FILL_STREAMS"
"""Environment override of the fill-stream count (an integer from 1 to 8)."""

LANDING_THREADS_ENV: Final = "KVTIER_LANDING_THREADS"
"""Environment override of the landing-thread count (an integer from 1 to 16)."""


def _override(value: str | None, most: int) -> int | None:
    if value is not None and value.strip().isdigit() and 1 <= int(value) <= most:
        return int(value)
    return None


def fill_stream_count(cpus: int, override: str | None = None) -> int:
    """How many CPU streams a landing allocates (zero-fills) its arrays on.

    One per 2 usable CPUs, at least 2 and at most :data:`FILL_STREAMS_MAX`;
    1 on a single CPU. NOTE: measured with ``tools/bench/cold_tier_io.py
    --restore-only`` and probes of 1-8 streams (2026-12-01): on the 16-core
    H200 host the fill of fresh memory bounds a restore from the page cache;
    the fill alone ran 2.2 / 3.7 / 5.1 / 6.6 / 7.6 GB/s on 1 / 2 / 4 / 6 /
    8 streams, and 8 streams with 4 landing threads restored 1 GiB at 6.8
    GB/s, 0.98 of ``dd`` (4 streams: 4.9), while a restore from the disk
    stayed at the disk's speed. On the 2-core VM two streams restored
    1.06-1.26x (cold) and 1.19-1.34x (warm) faster than one over three
    runs, once the reader's pass stopped hashing (before, 0.92-1.12x).
    ``override`` (the :data:`FILL_STREAMS_ENV` value) wins when it is an
    integer from 1 to 8; any other value is ignored.
    """
    chosen = _override(override, 8)
    if chosen is not None:
        return chosen
    if cpus < 2:
        return 1
    return min(FILL_STREAMS_MAX, max(2, cpus // 2))


def landing_thread_count(cpus: int, override: str | None = None) -> int:
    """How many landing threads (reads and hashes of a landing) a restore uses.

    2, or 4 from 8 usable CPUs. NOTE: on the 16-core H200 host, with 8 fill
    streams, 2 / 4 / 6 landing threads restored 1 GiB from the page cache
    at 5.5 / 6.8 / 6.7 GB/s; with 4 fill streams the count did not matter
    (4.8-4.9). ``override`` (the :data:`LANDING_THREADS_ENV` value) wins
    when it is an integer from 1 to 16.
    """
    chosen = _override(override, 16)
    if chosen is not None:
        return chosen
    return 4 if cpus >= 8 else 2


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


_FILL_STREAMS = threading.local()


def default_fill_streams() -> list[Any]:
    """The calling thread's fill streams for :func:`land_entry` (engine thread).

    NOTE: made once per thread and kept: each extra MLX CPU stream owns a
    worker thread for the life of the process, and a stream is used only by
    the thread that made it.
    """
    streams: list[Any] | None = getattr(_FILL_STREAMS, "streams", None)
    if streams is None:
        count = fill_stream_count(usable_cpus(), env_text(FILL_STREAMS_ENV))
        streams = [mx.cpu, *(mx.new_stream(mx.cpu) for _ in range(count - 1))]
        _FILL_STREAMS.streams = streams
    return streams


def _allocate(
    dests: Sequence[tuple[TensorRecord, int | None]], streams: Sequence[Any]
) -> list[Any]:
    """Allocate and evaluate the destinations of ``dests``, the i-th on ``streams[i]`` (engine thread).

    NOTE: every stream is a CPU stream, so the pages the landing writes are
    host pages; on CUDA (managed memory) a GPU-side fill would migrate them
    to the device, and the writes back, page by page. MLX zero-fills each
    new array on its stream's thread inside this ``mx.eval``: that fill is
    the first touch of the array's fresh pages (the landing's floor on a
    CPU device), before Python can see the array's address. So no
    huge-page advice (``madvise``) can reach an array's pages before they
    are faulted in 4 KiB at a time; glibc's process-wide
    ``glibc.malloc.hugetlb=1`` tunable can, and lost on the VM once freed
    memory had gone back to the host (docs/benchmarks/cold_tier.md,
    "Landing memory").
    """
    group = [
        mx.zeros(
            rec.shape if capacity is None else (*rec.shape[:2], capacity, *rec.shape[3:]),
            dtype=_DTYPES[rec.dtype],
            stream=stream,
        )
        for (rec, capacity), stream in zip(dests, streams, strict=False)
    ]
    mx.eval(*group)
    return group


def land_entry(
    entry: OpenEntry,
    *,
    step: int = 256,
    pool: LandingPool | None = None,
    streams: Sequence[Any] | None = None,
) -> list[Any]:
    """Build the cache objects by reading the file straight into MLX memory (engine thread).

    Each destination array is allocated at its final size (plain and
    quantized KV with capacity ``ceil((offset + 1) / step) * step`` so the
    next decode step writes in place; everything else exactly) and
    evaluated here; then the file's bytes are read into it, row by row for a
    buffer with slack, and hashed again in the same pass when the entry was
    opened with ``verify`` (the bytes checked are the bytes the model will
    read). With ``pool`` the reads and hashes of a tensor run on its workers
    while this thread allocates the next tensor; without, inline.

    When the entry's pass (:meth:`OpenEntry.pass_over`) is still running,
    each tensor is read once the pass went past it (with ``pool``, its
    worker waits; without, this thread), so the landing overlaps the pass.

    ``streams``: CPU streams to allocate the arrays on, the next
    ``len(streams)`` tensors at once, one per stream, each zero-filled
    (page-faulted) on its stream's thread; made on the calling thread, the
    only one that may use them. Default: :func:`default_fill_streams` (one
    per 2 usable CPUs, from 2 up to 8; :func:`fill_stream_count` says why).

    Peak memory is the restored entry itself: no host copy. The entry stays
    open (its holder closes it). Raises :class:`CacheFileCorrupt` when the
    file changed, is truncated, or a hash disagrees, :class:`PassFailed`
    when the pass failed or was cancelled; no array escapes then.
    """
    if step < 1:
        raise ValueError("step must be positive")
    header = entry.header
    port, fd, verify = entry.port, entry.fileno(), entry.verify
    dests = list(_destinations(header.layers, step))
    arrays: list[Any] = []
    views: list[memoryview] = []
    done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    checked: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    checking = False
    pending = 0
    errors: list[BaseException] = []
    try:
        # NOTE: with a pool even this check runs on a worker (no file call on
        # the engine thread); its failure fails the landing like a bad hash.
        check = functools.partial(_check_same, port, fd, header)
        if pool is None:
            check()
        else:
            pool.submit(check, checked)
            checking = True
        fill = list(streams) if streams else default_fill_streams()
        ready: list[Any] = []
        for index, (rec, capacity) in enumerate(dests):
            if not ready:
                ready = _allocate(dests[index : index + len(fill)], fill)
            a = ready.pop(0)
            arrays.append(a)
            if rec.nbytes == 0 and not verify and entry.passed:
                # NOTE: while the pass runs, even an empty tensor's job waits
                # for it: the landing ends after the pass, never cancels it.
                continue
            view = None if a.nbytes == 0 else _writable_view(a)
            if view is not None:
                rows = _rows(view, rec, capacity)
            elif a.nbytes == 0:
                rows = []
            else:
                # NOTE: a backend whose arrays lend no writable host buffer:
                # this tensor is read into host bytes laid out at its final
                # capacity (slack left zero) and copied ONCE into an MLX
                # array of that shape, before the next tensor: at most one
                # tensor's host bytes exist at a time, and no exact-size
                # copy is padded by concatenation (which held the tensor
                # twice, plus every other tensor's host bytes).
                arrays[-1] = None
                del a
                arrays[-1] = _land_through_host(entry, pool, index, rec, capacity)
                continue
            if view is not None:
                views.append(view)
            job = functools.partial(_fill_behind, entry, port, fd, index, rec, rows, verify)
            del rows
            if pool is None:
                job()
            else:
                pool.submit(job, done)
                pending += 1
            del job
            while pending:
                # NOTE: a failed job ends the landing early (no more
                # allocations for arrays that will be thrown away).
                try:
                    outcome = done.get_nowait()
                except queue.Empty:
                    break
                pending -= 1
                if outcome is not None:
                    errors.append(outcome)
            if errors:
                break
    finally:
        # NOTE: every submitted job is waited for, even on failure, so no
        # worker still writes into (or references) memory this thread drops.
        while pending:
            outcome = done.get()
            pending -= 1
            if outcome is not None:
                errors.append(outcome)
        if checking:
            # NOTE: a changed file is reported as such, before whatever a
            # read of it ran into meanwhile (a short read, a bad hash).
            outcome = checked.get()
            if outcome is not None:
                errors.insert(0, outcome)
    if errors:
        raise errors[0]
    del views
    it = iter(arrays)
    caches = [_build(layer, it, step) for layer in header.layers]
    return caches


def _land_through_host(
    entry: OpenEntry, pool: LandingPool | None, index: int, rec: TensorRecord, capacity: int | None
) -> Any:
    """Tensor ``index`` read into host bytes at its landing shape, then one evaluated MLX copy.

    The fallback for arrays that lend no writable buffer (engine thread).
    NOTE: with ``pool`` the read runs on a worker (no file call on this
    thread) and this thread waits for it; the host bytes are dropped as soon
    as MLX owns its copy, so the landing's extra memory is one tensor.
    """
    dtype = _DTYPES[rec.dtype]
    shape = rec.shape if capacity is None else (*rec.shape[:2], capacity, *rec.shape[3:])
    host = bytearray(math.prod(shape) * dtype.size)
    view = memoryview(host)
    rows = _rows(view, rec, capacity)
    job = functools.partial(_fill_behind, entry, entry.port, entry.fileno(), index, rec, rows,
                            entry.verify)
    try:
        if pool is None:
            job()
        else:
            done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
            pool.submit(job, done)
            outcome = done.get()
            if outcome is not None:
                raise outcome
    finally:
        # NOTE: the job holds row views of ``host``; dropped here, so the
        # host bytes go as soon as the copy below exists.
        del job, rows
        view.release()
    src: Any = memoryview(host)
    landed = mx.array(src).view(dtype).reshape(shape) if host else mx.zeros(shape, dtype=dtype)
    mx.eval(landed)
    del host
    return landed


def _writable_view(a: Any) -> memoryview | None:
    """A writable, contiguous byte view of evaluated array ``a`` (``None``: it lends none)."""
    buffer: Any = a
    try:
        view = memoryview(buffer)
    except (TypeError, ValueError, BufferError):
        return None
    if view.readonly or not view.c_contiguous or view.nbytes != a.nbytes:
        view.release()
        return None
    return view.cast("B")
