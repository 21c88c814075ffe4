"""Cold-tier file throughput: the real codec and file port against ``dd`` on the same file system.

A synthetic entry of ``--layers`` ``KVCache`` layers, keys and values of
shape ``[1, heads, tokens, head_dim]`` in bf16 filled with random values
(default: the Llama-3-8B shape at 8,192 tokens, 32 layers, exactly 1 GiB
of tensor bytes), goes through what the SSD writer and reader run:

- store: ``plan_entry``, then per tensor ``tensor_bytes`` and
  ``KvFileWriter.write_tensor`` (xxh3 + positional write), then ``commit``
  (header, fsync, rename, directory fsync), timed from ``begin`` to the end
  of ``commit``; against ``dd if=/dev/zero oflag=direct conv=fsync`` writing
  the same number of bytes into the same directory;
- restore, measured to usable MLX caches, two paths side by side:

  * restore (the product as a request sees it): ``read_header`` +
    ``open_file``, then the reader's pass (``OpenEntry.pass_over``: every
    tensor read through one reused buffer, page cache warmed; none when the
    page cache already holds every tensor) started on a worker thread and
    the turn granted at once: ``land_entry`` (each destination allocated at
    its final size in MLX memory on the product's fill streams, the file's
    bytes read straight into it on the product's landing threads right
    behind the pass and hashed there);
  * sequential (the same code, a late turn): the whole pass first, then
    the landing (what the product did before the overlap);
  * what-ifs: the pass checking the hashes too (the product before
    2026-12-01), and the landing on one fill stream;
  * what-if, verify off only: no pass, ``posix_fadvise(WILLNEED)`` on the
    open file, then the landing at once;
  * old path (before #8, kept for comparison): ``read_header`` +
    ``read_tensors(verify=True)`` into fresh host buffers, then
    ``materialize(consume=True)`` copying them into MLX arrays;

  each against ``dd of=/dev/null`` reading the same file, all after
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file (page cache dropped)
  and all again with the file in the page cache (warm). ``mx.clear_cache()``
  and ``malloc_trim(0)`` run before each restore and each floor, so each
  one lands in fresh memory (no pages a previous run freed and the
  allocator kept);
- the fresh-memory floors: a fresh ``bytearray`` per tensor (what the old
  reader allocated) and ``mx.zeros`` + ``mx.eval`` of every destination
  (what a landing allocates), on one CPU stream and on two (each stream
  zero-fills, so page-faults, its arrays on its own thread): no restore
  into new memory beats its floor;
- the landing-memory variants: 1 GiB of fresh anonymous ``mmap`` memory
  written in 4 MiB copies plain, after ``madvise(MADV_HUGEPAGE)``, and
  after ``MADV_HUGEPAGE`` + ``MADV_POPULATE_WRITE`` (memory a landing could
  advise only if it allocated it itself: MLX zero-fills its arrays as it
  allocates them). MLX's own memory on huge pages is the process-wide glibc
  tunable: run the whole benchmark with
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (printed with the figures).

``--restore-only`` writes the entry once and times only the restores, the
dd reads and the floors; ``--settle S`` sleeps S seconds before every timed
restore and floor, after freeing the previous one's memory (on a VM with
free page reporting that memory is handed back to the host meanwhile, as
it is before a restore that comes after an idle spell).

Rounds interleave ours and dd; medians and min..max are printed, with the
ratios the targets name (store >= 0.80 x dd, restore >= 0.85 x dd). Run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/cold_tier_io.py [--rounds 5] [--json out.json] \\
        [--restore-only] [--settle S]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, loadavg, machine

sys.path.insert(0, str(REPO))

_DD_RATE = re.compile(r"copied, ([0-9.]+) s")

_SETTLE_S = [0.0]
"""Seconds :func:`fresh_memory` waits after freeing (``--settle``)."""

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23


class TimedPort:
    """``OsFilePort`` with the time spent in each system call family summed (seconds)."""

    def __init__(self, *, early_writeback: bool = True) -> None:
        from kernels.cache import OsFilePort

        # NOTE: early_writeback=False is the port before it started each
        # range's writeback (sync_file_range), kept as a comparison.
        self._inner = OsFilePort() if early_writeback else OsFilePort(writeback=None)
        self.spent: dict[str, float] = {}
        # NOTE: the landing threads call the port concurrently.
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget the sums."""
        self.spent = {}

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        """The inner port's page-cache probe, timed.

        NOTE: named here, not only reached through ``__getattr__``: from
        Python 3.12 ``isinstance`` against a runtime-checkable protocol
        looks attributes up statically, so a port that only forwards
        dynamically would not count as a ``PageCacheProbe`` there.
        """
        timed: Callable[..., bool] = self.__getattr__("all_cached")
        return timed(fd, size, ranges)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                with self._lock:
                    self.spent[name] = self.spent.get(name, 0.0) + took

        return timed


class DirectPort(TimedPort):
    """A what-if port, for this benchmark only: temp files opened ``O_DIRECT``.

    Writes go through one reused page-aligned bounce buffer (O_DIRECT needs
    aligned memory, offsets and lengths), padded with zeros to 4 KiB; the
    file is cut back to its planned size before the fsync. Not the product's
    port: it measures what skipping the page cache would give the real
    ``KvFileWriter`` on this file system.
    """

    _BLOCK = 4096

    def __init__(self) -> None:
        super().__init__()
        import mmap

        self._bounce = mmap.mmap(-1, 16 << 20)
        self._sizes: dict[int, int] = {}

    def open_temp(self, path: str) -> int:
        """``OsFilePort.open_temp`` plus ``O_DIRECT``."""
        t0 = time.perf_counter()
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
        fd = os.open(path, flags, 0o600)
        self.spent["open_temp"] = self.spent.get("open_temp", 0.0) + time.perf_counter() - t0
        return fd

    def truncate(self, fd: int, size: int) -> None:
        """Remember the planned size (the padded last write may pass it)."""
        self._sizes[fd] = size
        os.ftruncate(fd, size)

    def pwrite_all(self, fd: int, data: Any, offset: int) -> None:
        """Copy through the bounce buffer, write block-aligned chunks."""
        t0 = time.perf_counter()
        view = memoryview(data).cast("B")
        bounce = memoryview(self._bounce)
        done = 0
        while done < len(view):
            n = min(len(bounce), len(view) - done)
            bounce[:n] = view[done : done + n]
            padded = -(-n // self._BLOCK) * self._BLOCK
            if padded > n:
                bounce[n:padded] = bytes(padded - n)
            written = os.pwritev(fd, [bounce[:padded]], offset + done)
            if written != padded:
                raise OSError(f"short direct write: {written} of {padded}")
            done += n
        self.spent["pwrite_all"] = self.spent.get("pwrite_all", 0.0) + time.perf_counter() - t0

    def fsync(self, fd: int) -> None:
        """Cut the padding off, then fsync."""
        t0 = time.perf_counter()
        os.ftruncate(fd, self._sizes.pop(fd))
        os.fsync(fd)
        self.spent["fsync"] = self.spent.get("fsync", 0.0) + time.perf_counter() - t0


def fresh_memory() -> None:
    """Give freed memory back to the system before a timed run, so every contender starts alike.

    NOTE: without this a run right after one that freed a GiB reuses pages
    the allocator kept (no page faults) and looks faster than its neighbour.
    """
    import ctypes

    import mlx.core as mx

    mx.clear_cache()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # NOTE: not glibc: nothing to trim.
    if _SETTLE_S[0] > 0:
        time.sleep(_SETTLE_S[0])


def first_touch_mmap(nbytes: int, mode: str) -> float | None:
    """Seconds to advise (``mode``: plain, hugepage, hugepage+populate) and write ``nbytes`` of
    fresh anonymous memory in 4 MiB copies; ``None`` when the kernel refuses the advice."""
    import ctypes
    import mmap

    fresh_memory()
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = 4 << 20
    src = b"\1" * chunk
    try:
        buf = (ctypes.c_char * nbytes).from_buffer(m)
        addr, length = ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(nbytes)
        del buf
        t0 = time.perf_counter()
        advice = {"plain": (), "hugepage": (_MADV_HUGEPAGE,)}.get(
            mode, (_MADV_HUGEPAGE, _MADV_POPULATE_WRITE)
        )
        for a in advice:
            if libc.madvise(addr, length, a) != 0:
                return None
        for off in range(0, nbytes, chunk):
            m[off : off + chunk] = src[: min(chunk, nbytes - off)]
        return time.perf_counter() - t0
    finally:
        m.close()


def first_touch(sizes: list[int]) -> float:
    """Seconds to allocate (and zero) one fresh ``bytearray`` per size: what the reader allocates."""
    fresh_memory()
    t0 = time.perf_counter()
    keep = [bytearray(n) for n in sizes]
    took = time.perf_counter() - t0
    del keep
    return took


@dataclass
class Figures:
    """Seconds per run of each measured operation, and the breakdowns of ours."""

    runs: dict[str, list[float]] = field(default_factory=dict)
    breakdown: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def add(self, key: str, seconds: float, parts: dict[str, float] | None = None) -> None:
        """Record one run."""
        self.runs.setdefault(key, []).append(seconds)
        if parts is not None:
            self.breakdown.setdefault(key, []).append(parts)


def make_entry(layers: int, heads: int, tokens: int, head_dim: int, seed: int) -> list[Any]:
    """``layers`` evaluated ``KVCache`` objects holding ``tokens`` random bf16 keys and values."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    # NOTE: Any, so mypy does not follow mlx-lm's partly annotated classes.
    mlc: Any = cache_module
    mx.random.seed(seed)
    caches = []
    for _ in range(layers):
        c = mlc.KVCache()
        k = mx.random.normal((1, heads, tokens, head_dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, heads, tokens, head_dim)).astype(mx.bfloat16)
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd(*args: str) -> float:
    """Run ``dd`` and return the seconds it reports for its copy (its own clock)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = _DD_RATE.search(out.stderr)
    if match is None:
        raise RuntimeError(f"unexpected dd output: {out.stderr!r}")
    return float(match.group(1))


def store(
    port: TimedPort, caches: list[Any], tokens: int, directory: Path, name: str = "entry.kvt"
) -> tuple[Path, float, dict[str, float]]:
    """Plan and write the entry as the SSD writer does; the final path, seconds, breakdown."""
    from kernels.cache import KvFileWriter, plan_entry, tensor_bytes

    plan = plan_entry(
        caches,
        model_id="bench",
        fingerprint="bench",
        namespace="",
        tokenizer_hash="bench",
        tokens=range(tokens),
    )
    final = directory / name
    port.reset()
    readback = write = 0.0
    t0 = time.perf_counter()
    with KvFileWriter(port, plan) as writer:
        writer.begin(str(directory))
        for i in range(len(plan.tensors)):
            t1 = time.perf_counter()
            view = tensor_bytes(plan, i)
            t2 = time.perf_counter()
            writer.write_tensor(i, view)
            t3 = time.perf_counter()
            del view
            readback += t2 - t1
            write += t3 - t2
        t4 = time.perf_counter()
        writer.commit(str(final))
        commit = time.perf_counter() - t4
    total = time.perf_counter() - t0
    spent = dict(port.spent)
    parts = {
        "tensor_bytes": readback,
        "pwrite": spent.get("pwrite_all", 0.0),
        "hash+other in write_tensor": write - spent.get("pwrite_all", 0.0),
        "fsync": spent.get("fsync", 0.0),
        "commit total": commit,
        "open+truncate": spent.get("open_temp", 0.0) + spent.get("truncate", 0.0),
    }
    plan.release_arrays()
    return final, total, parts


def restore_old(port: TimedPort, path: Path, *, verify: bool) -> tuple[float, dict[str, float]]:
    """The old path to usable MLX caches: ``read_tensors`` into host buffers, then
    ``materialize(consume=True)``; seconds, breakdown."""
    import mlx.core as mx

    from kernels.cache import materialize, read_header, read_tensors

    fresh_memory()
    port.reset()
    t0 = time.perf_counter()
    header = read_header(port, str(path))
    host = read_tensors(port, str(path), header, verify=verify)
    t1 = time.perf_counter()
    caches = materialize(header, host, consume=True)
    total = time.perf_counter() - t0
    spent = dict(port.spent)
    parts = {
        "pread": spent.get("pread_into", 0.0),
        "host alloc+hash": (t1 - t0) - spent.get("pread_into", 0.0),
        "copy into MLX": total - (t1 - t0),
    }
    del caches, host
    mx.clear_cache()
    return total, parts


def restore_new(
    port: TimedPort,
    path: Path,
    pool: Any,
    *,
    verify: bool,
    overlap: bool = True,
    streams: Sequence[Any] | None = None,
    check_in_pass: bool = False,
) -> tuple[float, dict[str, float]]:
    """The product's path to usable MLX caches; seconds, breakdown.

    ``overlap`` (the product as a request sees it): the reader opens the
    file (``open_file``), its pass (``OpenEntry.pass_over``) starts on a
    worker thread, and the turn is granted at once: ``land_entry`` on this
    thread goes right behind the pass. Without: the whole pass first,
    then the landing (the sequential figure, and what a late turn
    costs). ``streams``: the landing's fill streams (default the product's,
    ``kernels.cache.default_fill_streams``). ``check_in_pass``: the pass
    checks the hashes too (what-if: the product before 2026-12-01, which
    hashed every byte in both passes); the product's pass only reads.
    """
    import mlx.core as mx
    from _restore import land_behind_pass

    from kernels.cache import land_entry, open_file, read_header

    fresh_memory()
    port.reset()
    t0 = time.perf_counter()
    header = read_header(port, str(path))
    if not overlap:
        entry = open_file(port, str(path), header, verify=verify, check_in_pass=check_in_pass)
        try:
            entry.pass_over()
        except BaseException:
            entry.close()
            raise
        t1 = time.perf_counter()
        try:
            caches = land_entry(entry, pool=pool, streams=streams)
        finally:
            entry.close()
        total = time.perf_counter() - t0
        parts = {
            "reader pass (header, read, hash)": t1 - t0,
            "of which pread": port.spent.get("pread_into", 0.0),
            "landing (alloc, read, hash)": total - (t1 - t0),
            "preadv, summed over the landing threads": port.spent.get("preadv_into", 0.0),
        }
        del caches
        mx.clear_cache()
        return total, parts
    entry = open_file(port, str(path), header, verify=verify, check_in_pass=check_in_pass)
    t1 = time.perf_counter()
    caches, pass_end = land_behind_pass(entry, pool, streams)
    total = time.perf_counter() - t0
    parts = {
        "open (header, open)": t1 - t0,
        "reader pass ends": pass_end - t0,
        "of which pread": port.spent.get("pread_into", 0.0),
        "landing tail after the pass": total - (pass_end - t0),
        "preadv, summed over the landing threads": port.spent.get("preadv_into", 0.0),
    }
    del caches
    mx.clear_cache()
    return total, parts


def restore_willneed(port: TimedPort, path: Path, pool: Any) -> tuple[float, dict[str, float]]:
    """What-if (verify off): no reader pass, a ``posix_fadvise(WILLNEED)`` read-ahead hint on the
    open file instead, then the landing at once; seconds, breakdown."""
    import mlx.core as mx

    from kernels.cache import OpenEntry, land_entry, read_header

    fresh_memory()
    port.reset()
    t0 = time.perf_counter()
    header = read_header(port, str(path))
    fd = port.open_read(str(path))
    entry = OpenEntry(port, fd, str(path), header, verify=False)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    t1 = time.perf_counter()
    try:
        caches = land_entry(entry, pool=pool)
    finally:
        entry.close()
    total = time.perf_counter() - t0
    parts = {"open + fadvise": t1 - t0, "landing": total - (t1 - t0)}
    del caches
    mx.clear_cache()
    return total, parts


def mlx_alloc_floor(
    shapes: Sequence[tuple[int, ...]], streams: Sequence[Any] | None = None
) -> float:
    """Seconds to allocate and evaluate ``mx.zeros`` of each shape, the next ``len(streams)`` at
    once, one per stream (default one CPU stream): what a landing allocates."""
    import mlx.core as mx

    fill = list(streams) if streams else [mx.cpu]
    fresh_memory()
    t0 = time.perf_counter()
    keep: list[Any] = []
    for i in range(0, len(shapes), len(fill)):
        group = [
            mx.zeros(shape, dtype=mx.bfloat16, stream=s)
            for shape, s in zip(shapes[i : i + len(fill)], fill, strict=False)
        ]
        mx.eval(*group)
        keep.extend(group)
    took = time.perf_counter() - t0
    del keep
    mx.clear_cache()
    return took


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main() -> int:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dd-bs", default="16M", help="dd block size for the write (default 16M)")
    parser.add_argument(
        "--dd-read-bs", default="4M", help="dd block size for the read (default 4M)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="parent directory (default: $KVTIER_HOME or ~/.cache/kvtier, where the tier lives)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument(
        "--restore-only",
        action="store_true",
        help="write the entry once; time only the restores, the dd reads and the floors",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds to wait after freeing memory, before every timed restore and floor",
    )
    args = parser.parse_args()
    _SETTLE_S[0] = args.settle

    parent = args.dir or Path(os.environ.get("KVTIER_HOME", Path.home() / ".cache" / "kvtier"))
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cold-tier-io-", dir=parent))
    port = TimedPort()
    figures = Figures()
    loads = [loadavg()]
    info = machine()
    info["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    for knob in ("enabled", "defrag"):
        thp = Path("/sys/kernel/mm/transparent_hugepage") / knob
        info[f"thp_{knob}"] = thp.read_text().strip() if thp.exists() else "absent"
    from kernels.cache import (
        LANDING_THREADS_ENV,
        default_fill_streams,
        landing_thread_count,
        usable_cpus,
    )

    # NOTE: the product's fill streams for this (the landing) thread: the
    # "restore" rows use them; the "one stream" rows always use one.
    info["fill_streams"] = len(default_fill_streams())
    info["landing_threads"] = landing_thread_count(
        usable_cpus(), os.environ.get(LANDING_THREADS_ENV)
    )
    try:
        caches = make_entry(args.layers, args.heads, args.tokens, args.head_dim, seed=0)
        tensor_bytes = sum(c.keys.nbytes + c.values.nbytes for c in caches)
        df = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True, check=False)
        print(
            f"entry: {args.layers} layers x 2 tensors [1,{args.heads},{args.tokens},{args.head_dim}] "
            f"bf16 = {tensor_bytes / 2**30:.3f} GiB; directory {work}"
        )
        print(df.stdout.strip())
        print(f"load average at start: {loads[0]}")
        print(
            f"GLIBC_TUNABLES={info['glibc_tunables']!r}; THP enabled {info['thp_enabled']}, "
            f"defrag {info['thp_defrag']}; settle {args.settle} s; "
            f"the product's fill streams here: {info['fill_streams']}, "
            f"landing threads: {info['landing_threads']}"
        )
        file_size = 0
        sizes = [int(a.nbytes) for c in caches for a in (c.keys, c.values)]
        capacity = -(-(args.tokens + 1) // 256) * 256
        shapes = [(1, args.heads, capacity, args.head_dim)] * (2 * args.layers)
        import mlx.core as mx

        from kernels.cache import LandingPool

        pool = LandingPool(int(info["landing_threads"]))
        # NOTE: what-if: a second CPU stream (made on this thread, which lands).
        two = [mx.cpu, mx.new_stream(mx.cpu)]
        if args.restore_only:
            final, _, _ = store(port, caches, args.tokens, work)
            file_size = final.stat().st_size
        for r in range(args.rounds):
            if args.restore_only:
                restore_round(figures, port, final, pool, two, shapes, r, args.dd_read_bs)
                loads.append(loadavg())
                print(
                    f"round {r + 1}: {_round_line(figures, file_size)}; load {loads[-1]}",
                    flush=True,
                )
                continue
            # Store: ours, then dd writing the same bytes into the same directory.
            final, secs, parts = store(port, caches, args.tokens, work)
            file_size = final.stat().st_size
            figures.add("store", secs, parts)
            ddfile = work / "dd.bin"
            bs = args.dd_bs
            count = -(-file_size // _bytes(bs))
            scale = file_size / (count * _bytes(bs))
            for key, flags in (
                ("dd_write", ("oflag=direct", "conv=fsync")),
                ("dd_write_buffered", ("conv=fsync",)),
            ):
                ddfile.unlink(missing_ok=True)
                of = f"of={ddfile}"
                figures.add(
                    key, dd("if=/dev/zero", of, f"bs={bs}", f"count={count}", *flags) * scale
                )
            ddfile.unlink()
            # The same writer without the early writeback start (the port before it).
            late, secs, parts = store(
                TimedPort(early_writeback=False), caches, args.tokens, work, "late.kvt"
            )
            figures.add("store_fsync_only", secs, parts)
            late.unlink()
            # What-if: the same writer through an O_DIRECT port (bench only).
            direct, secs, parts = store(DirectPort(), caches, args.tokens, work, "direct.kvt")
            figures.add("store_o_direct", secs, parts)
            direct.unlink()
            # The fresh-memory floors: what the old reader and a landing allocate.
            figures.add("first_touch_host", first_touch(sizes))
            figures.add("first_touch_mlx", mlx_alloc_floor(shapes))
            figures.add("first_touch_mlx_two_streams", mlx_alloc_floor(shapes, two))
            for mode in _MMAP_MODES:
                took = first_touch_mmap(1 << 30, mode)
                if took is not None:
                    figures.add(f"first_touch_mmap_{mode}", took)
            # Page cache dropped: new (verify on, off), old, dd; interleaved.
            for key, how, verify in (
                ("restore_cold_verify_on", "overlap", True),
                ("restore_cold_one_stream", "one stream", True),
                ("seq_restore_cold_verify_on", "sequential", True),
                ("restore_cold_verify_off", "overlap", False),
                ("willneed_restore_cold_verify_off", "willneed", False),
                ("old_restore_cold_verify_on", "old", True),
            ):
                drop_cache(final)
                if how == "old":
                    secs, parts = restore_old(port, final, verify=verify)
                elif how == "willneed":
                    secs, parts = restore_willneed(port, final, pool)
                elif how == "one stream":
                    secs, parts = restore_new(port, final, pool, verify=verify, streams=[mx.cpu])
                else:
                    secs, parts = restore_new(
                        port, final, pool, verify=verify, overlap=how == "overlap"
                    )
                figures.add(key, secs, parts)
            drop_cache(final)
            figures.add("dd_read_cold", dd(f"if={final}", "of=/dev/null", f"bs={args.dd_read_bs}"))
            # Warm: the file is in the page cache for all.
            dd(f"if={final}", "of=/dev/null", "bs=4M")  # NOTE: primes the page cache.
            secs, parts = restore_new(port, final, pool, verify=True)
            figures.add("restore_warm_verify_on", secs, parts)
            secs, parts = restore_new(port, final, pool, verify=True, streams=[mx.cpu])
            figures.add("restore_warm_one_stream", secs, parts)
            secs, parts = restore_new(port, final, pool, verify=True, overlap=False)
            figures.add("seq_restore_warm_verify_on", secs, parts)
            secs, parts = restore_old(port, final, verify=True)
            figures.add("old_restore_warm_verify_on", secs, parts)
            figures.add("dd_read_warm", dd(f"if={final}", "of=/dev/null", f"bs={args.dd_read_bs}"))
            final.unlink()
            loads.append(loadavg())
            print(
                f"round {r + 1}: store {file_size / figures.runs['store'][-1] / 1e9:.2f} GB/s, "
                f"dd write {file_size / figures.runs['dd_write'][-1] / 1e9:.2f}; restore cold "
                f"{file_size / figures.runs['restore_cold_verify_on'][-1] / 1e9:.2f} "
                f"(sequential {file_size / figures.runs['seq_restore_cold_verify_on'][-1] / 1e9:.2f}, "
                f"old {file_size / figures.runs['old_restore_cold_verify_on'][-1] / 1e9:.2f}), "
                f"dd read cold {file_size / figures.runs['dd_read_cold'][-1] / 1e9:.2f}; warm "
                f"{file_size / figures.runs['restore_warm_verify_on'][-1] / 1e9:.2f} "
                f"(sequential {file_size / figures.runs['seq_restore_warm_verify_on'][-1] / 1e9:.2f}, "
                f"old {file_size / figures.runs['old_restore_warm_verify_on'][-1] / 1e9:.2f}), "
                f"dd {file_size / figures.runs['dd_read_warm'][-1] / 1e9:.2f}; load {loads[-1]}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if "pool" in locals():
            pool.close()

    # NOTE: the mmap floors write 1 GiB whatever the file's size; the rest moved the file's bytes.
    sizes_of = {
        k: (1 << 30 if k.startswith("first_touch_mmap") else file_size) for k in figures.runs
    }
    rates = {k: [sizes_of[k] / s / 1e9 for s in v] for k, v in figures.runs.items()}
    print(
        f"\nfile {file_size / 2**30:.3f} GiB, {args.rounds} rounds, GB/s (1e9 bytes/s), median [min..max]"
    )
    for key, xs in rates.items():
        med, lo, hi = _stats(xs)
        print(f"  {key:<34}{med:>8.2f}  [{lo:.2f}..{hi:.2f}]")
    ratios = {
        "store / dd_write": ("store", "dd_write", 0.80),
        "restore / dd_read (cold, verify on)": ("restore_cold_verify_on", "dd_read_cold", 0.85),
        "restore / dd_read (cold, verify off)": ("restore_cold_verify_off", "dd_read_cold", None),
        "restore / dd_read (warm, verify on)": ("restore_warm_verify_on", "dd_read_warm", 0.85),
        "sequential / dd_read (cold, verify on)": (
            "seq_restore_cold_verify_on",
            "dd_read_cold",
            None,
        ),
        "sequential / dd_read (warm, verify on)": (
            "seq_restore_warm_verify_on",
            "dd_read_warm",
            None,
        ),
        "willneed / dd_read (cold, verify off)": (
            "willneed_restore_cold_verify_off",
            "dd_read_cold",
            None,
        ),
        "old path / dd_read (cold, verify on)": (
            "old_restore_cold_verify_on",
            "dd_read_cold",
            None,
        ),
        "old path / dd_read (warm, verify on)": (
            "old_restore_warm_verify_on",
            "dd_read_warm",
            None,
        ),
        "one fill stream / restore (cold, verify on)": (
            "restore_cold_one_stream",
            "restore_cold_verify_on",
            None,
        ),
        "one fill stream / restore (warm, verify on)": (
            "restore_warm_one_stream",
            "restore_warm_verify_on",
            None,
        ),
        "pass checks too / restore (cold, verify on)": (
            "restore_cold_pass_checks",
            "restore_cold_verify_on",
            None,
        ),
        "pass checks too / restore (warm, verify on)": (
            "restore_warm_pass_checks",
            "restore_warm_verify_on",
            None,
        ),
        "one fill stream / dd_read (cold)": ("restore_cold_one_stream", "dd_read_cold", None),
        "one fill stream / dd_read (warm)": ("restore_warm_one_stream", "dd_read_warm", None),
        "diag: MLX alloc floor, two streams / one": (
            "first_touch_mlx_two_streams",
            "first_touch_mlx",
            None,
        ),
        "diag: mmap hugepage / plain": (
            "first_touch_mmap_hugepage",
            "first_touch_mmap_plain",
            None,
        ),
        "diag: mmap hugepage+populate / plain": (
            "first_touch_mmap_hugepage+populate",
            "first_touch_mmap_plain",
            None,
        ),
        "diag: restore cold / MLX alloc floor": ("restore_cold_verify_on", "first_touch_mlx", None),
        "diag: restore warm / MLX alloc floor": ("restore_warm_verify_on", "first_touch_mlx", None),
        "diag: store / dd_write_buffered": ("store", "dd_write_buffered", None),
        "diag: store_fsync_only / dd_write": ("store_fsync_only", "dd_write", None),
        "diag: store_o_direct / dd_write": ("store_o_direct", "dd_write", None),
    }
    print("ratios of medians (per-round ratios min..max):")
    out_ratios: dict[str, Any] = {}
    for label, (ours, theirs, target) in ratios.items():
        if ours not in rates or theirs not in rates or len(rates[ours]) != len(rates[theirs]):
            continue  # NOTE: a contender this run did not time (--restore-only, refused advice).
        med = statistics.median(rates[ours]) / statistics.median(rates[theirs])
        per = [a / b for a, b in zip(rates[ours], rates[theirs], strict=True)]
        verdict = (
            ""
            if target is None
            else ("  met" if med >= target else "  MISSED") + f" (target >= {target})"
        )
        print(f"  {label:<38}{med:>7.3f}  [{min(per):.3f}..{max(per):.3f}]{verdict}")
        out_ratios[label] = {"median": med, "per_round": per, "target": target}
    print("breakdown of ours, seconds, median over rounds:")
    for key, rows in figures.breakdown.items():
        names = rows[0].keys()
        print(
            f"  {key}: "
            + ", ".join(f"{n} {statistics.median(r[n] for r in rows):.3f}" for n in names)
        )
    print(f"load average per round: {', '.join(loads)}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "file_bytes": file_size,
                    "seconds": figures.runs,
                    "gbps": rates,
                    "ratios": out_ratios,
                    "breakdown": figures.breakdown,
                    "loadavg": loads,
                },
                indent=1,
            )
        )
    return 0


_MMAP_MODES = ("plain", "hugepage", "hugepage+populate")


def restore_round(
    figures: Figures,
    port: TimedPort,
    final: Path,
    pool: Any,
    two: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    r: int,
    dd_read_bs: str,
) -> None:
    """One ``--restore-only`` round: the restores (the product, the one-stream what-if; the order
    flips every round), dd, cold then warm; then the floors."""
    import mlx.core as mx

    contenders: list[tuple[str, Sequence[Any] | None, bool]] = [
        ("verify_on", None, False),
        ("one_stream", [mx.cpu], False),
        ("pass_checks", None, True),
    ]
    if r % 2:
        contenders.reverse()
    for suffix, streams, checks in contenders:
        drop_cache(final)
        secs, parts = restore_new(
            port, final, pool, verify=True, streams=streams, check_in_pass=checks
        )
        figures.add("restore_cold_" + suffix, secs, parts)
    drop_cache(final)
    figures.add("dd_read_cold", dd(f"if={final}", "of=/dev/null", f"bs={dd_read_bs}"))
    dd(f"if={final}", "of=/dev/null", "bs=4M")  # NOTE: primes the page cache.
    for suffix, streams, checks in contenders:
        secs, parts = restore_new(
            port, final, pool, verify=True, streams=streams, check_in_pass=checks
        )
        figures.add("restore_warm_" + suffix, secs, parts)
    figures.add("dd_read_warm", dd(f"if={final}", "of=/dev/null", f"bs={dd_read_bs}"))
    floors: list[tuple[str, Callable[[], float]]] = [
        ("first_touch_mlx", lambda: mlx_alloc_floor(shapes)),
        ("first_touch_mlx_two_streams", lambda: mlx_alloc_floor(shapes, two)),
    ]
    for key, floor in floors if r % 2 == 0 else floors[::-1]:
        figures.add(key, floor())
    modes = _MMAP_MODES[r % 3 :] + _MMAP_MODES[: r % 3]
    for mode in modes:
        took = first_touch_mmap(1 << 30, mode)
        if took is not None:
            figures.add(f"first_touch_mmap_{mode}", took)


def _round_line(figures: Figures, size: int) -> str:
    """The round's GB/s of each contender, for the progress line."""
    return ", ".join(
        f"{k} {(1 << 30 if k.startswith('first_touch_mmap') else size) / v[-1] / 1e9:.2f}"
        for k, v in figures.runs.items()
    )


def _bytes(bs: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(bs[:-1]) * units[bs[-1]] if bs[-1] in units else int(bs)


if __name__ == "__main__":
    raise SystemExit(main())
