"""The restore's landing: file bytes read straight into MLX-owned memory (``open_entry`` + ``land_entry``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from kernels.cache import cache_arrays, declare_min_reusable_offset
from kernels.cache._file_port import MAX_IOV, OsFilePort, ShortRead, WritableBuffer
from kernels.cache._kv_format import CacheFileCorrupt, KvFileHeader
from kernels.cache._kv_header import read_header
from kernels.cache._kv_landing import LandingPool, land_entry
from kernels.cache._kv_reader import OpenEntry, open_entry, read_tensors
from kernels.cache._kv_restore import materialize
from tests.crash.ports import ForwardingPort
from tests.kernels.cache.test_kv_file import (
    PROMPT,
    _arrays_with_none,
    _filled_kv,
    _filled_rotating,
    assert_same_state,
    fetched_bytes,
    greedy,
    kv_step,
    raw,
    tiny_llama,
    tiny_mamba,
    write_entry,
)

PORT = OsFilePort(writeback=None)


@pytest.fixture
def pool() -> Iterator[LandingPool]:
    """A landing pool of two workers, stopped after the test."""
    p = LandingPool(2)
    yield p
    p.close()


def _header(path: Path) -> KvFileHeader:
    return read_header(PORT, str(path))


def _land(
    path: Path, pool: LandingPool | None, *, step: int = 256, verify: bool = True
) -> list[Any]:
    entry = open_entry(PORT, str(path), _header(path), verify=verify)
    try:
        return land_entry(entry, step=step, pool=pool)
    finally:
        entry.close()


def _old_path(path: Path, *, step: int = 256) -> list[Any]:
    header = _header(path)
    return materialize(header, read_tensors(PORT, str(path), header), step=step)


def _all_bytes(caches: Sequence[Any]) -> list[tuple[tuple[int, ...], str, bytes]]:
    """Every array of ``caches`` (slack included) as (shape, dtype, bytes)."""
    return [(tuple(a.shape), str(a.dtype), raw(a)) for a in cache_arrays(list(caches))]


def _cases() -> dict[str, tuple[list[Any], list[int]]]:
    n = 9
    llama = tiny_llama(mx.bfloat16)
    plain = make_prompt_cache(llama)
    llama(mx.array([PROMPT[:n]]), cache=plain)
    inner = CacheList(_filled_kv(7, mx.bfloat16, seed=1), _arrays_with_none(7))
    outer = CacheList(_filled_rotating(7), inner)
    declare_min_reusable_offset(outer, 3)
    mamba = tiny_mamba()
    recurrent = mamba.make_cache()
    mamba(mx.array([PROMPT[:8]]), cache=recurrent)
    for c in recurrent:
        c._kvtier_offset = 8
    return {
        "plain-bf16-slack": (plain, PROMPT[:n]),
        "plain-fp32": ([_filled_kv(n)], list(range(n))),
        "quantized-4": ([_filled_kv(n).to_quantized(group_size=32, bits=4)], list(range(n))),
        "quantized-8": ([_filled_kv(n).to_quantized(group_size=32, bits=8)], list(range(n))),
        "rotating-before-wrap": ([_filled_rotating(4)], list(range(4))),
        "rotating-after-wrap": ([_filled_rotating(11)], list(range(11))),
        "arrays-with-none": ([_arrays_with_none(4)], list(range(4))),
        "mamba": (recurrent, PROMPT[:8]),
        "list": ([outer, _filled_kv(7)], list(range(7))),
        "empty": ([KVCache(), QuantizedKVCache(group_size=64, bits=4)], []),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("step", [256, 4])
def test_landing_equals_the_old_path_bit_for_bit_for_every_kind(
    tmp_path: Path, pool: LandingPool, case: str, step: int
) -> None:
    """Every cache kind lands with the original state and exactly the old path's arrays, slack included."""
    caches, tokens = _cases()[case]
    path = write_entry(caches, tokens, tmp_path)
    landed = _land(path, pool, step=step)
    assert len(landed) == len(caches)
    for original, got in zip(caches, landed, strict=True):
        assert_same_state(original, got)
    assert _all_bytes(landed) == _all_bytes(_old_path(path, step=step))


def test_plain_kv_lands_with_slack_and_continues_like_the_original(
    tmp_path: Path, pool: LandingPool
) -> None:
    """Plain KV lands in step-rounded capacity, the next step writes in place, and a greedy
    continuation equals the original's."""
    model = tiny_llama(mx.bfloat16)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cache)
    path = write_entry(cache, PROMPT[:-1], tmp_path)
    landed = _land(path, pool, step=4)
    assert landed[0].keys.shape[2] == 12  # ceil((8 + 1) / 4) * 4
    assert greedy(model, landed, PROMPT[-1]) == greedy(model, cache, PROMPT[-1])
    again = _land(path, pool, step=4)
    kv_step(again[0], seed=1, dtype=mx.bfloat16, dim=16)
    assert (again[0].keys.shape[2], again[0].offset) == (12, 9)  # written in place


@pytest.mark.parametrize("kind", ["q4", "rot-wrap"])
def test_landed_quantized_and_rotating_caches_update_like_the_original(
    tmp_path: Path, pool: LandingPool, kind: str
) -> None:
    """After landing, update_and_fetch returns the same bytes as the original cache."""
    cache: Any = (
        _filled_kv(9).to_quantized(group_size=32, bits=4) if kind == "q4" else _filled_rotating(11)
    )
    n = 9 if kind == "q4" else 11
    path = write_entry([cache], list(range(n)), tmp_path)
    landed = _land(path, pool)
    for s in range(3):
        assert fetched_bytes(kv_step(landed[0], seed=s)) == fetched_bytes(kv_step(cache, seed=s))


def test_inline_landing_equals_pooled_landing(tmp_path: Path, pool: LandingPool) -> None:
    """Without a pool the same arrays land (reads and hashes on the calling thread)."""
    caches, tokens = _cases()["list"]
    path = write_entry(caches, tokens, tmp_path)
    assert _all_bytes(_land(path, None)) == _all_bytes(_land(path, pool))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("tensor", [0, -1])
def test_a_bit_flipped_after_the_worker_pass_is_caught_by_the_landing(
    tmp_path: Path, pool: LandingPool, tensor: int
) -> None:
    """A byte changed between the worker's checked pass and the landing fails the landing's hash;
    with verification off the same flip would land (the second hash is what catches it)."""
    caches, tokens = _cases()["plain-fp32"]
    path = write_entry(caches, tokens, tmp_path)
    header = _header(path)
    rec = header.tensors[tensor]
    entry = open_entry(PORT, str(path), header, verify=True)
    try:
        _flip(path, rec.offset + rec.nbytes // 2)  # NOTE: the open fd sees the same inode.
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            land_entry(entry, pool=pool)
    finally:
        entry.close()
    unchecked = open_entry(PORT, str(path), header, verify=False)
    try:
        land_entry(unchecked, pool=pool)
    finally:
        unchecked.close()


def test_a_file_truncated_or_rewritten_after_the_worker_pass_fails_the_landing(
    tmp_path: Path, pool: LandingPool
) -> None:
    """A size or header change between the passes is corruption, not a short or wrong restore."""
    caches, tokens = _cases()["plain-fp32"]
    path = write_entry(caches, tokens, tmp_path)
    header = _header(path)
    entry = open_entry(PORT, str(path), header)
    try:
        os.truncate(path, header.file_size - 1)
        with pytest.raises(CacheFileCorrupt, match="size changed"):
            land_entry(entry, pool=pool)
    finally:
        entry.close()
    path = write_entry(caches, tokens, tmp_path, name="b.kvt")
    header = _header(path)
    entry = open_entry(PORT, str(path), header)
    try:
        _flip(path, 20)  # inside the preamble's header hash
        with pytest.raises(CacheFileCorrupt, match="changed since"):
            land_entry(entry, pool=pool)
    finally:
        entry.close()


def test_the_worker_pass_rejects_a_corrupt_file_and_leaves_nothing_open(tmp_path: Path) -> None:
    """open_entry checks every tensor's hash before the turn; a bad file opens nothing."""
    counting = CountingPort()
    caches, tokens = _cases()["plain-fp32"]
    path = write_entry(caches, tokens, tmp_path)
    header = _header(path)
    _flip(path, header.tensors[1].offset)
    with pytest.raises(CacheFileCorrupt, match="tensor 1"):
        open_entry(counting, str(path), header, verify=True)
    assert counting.open_fds == set()
    entry = open_entry(counting, str(path), header, verify=False)
    assert counting.open_fds == {entry.fileno()}
    entry.close()
    entry.close()
    assert counting.open_fds == set()
    assert entry.closed


class CountingPort(ForwardingPort):
    """Counts the descriptors it opened and has not closed."""

    def __init__(self) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.open_fds: set[int] = set()
        self.threads: set[int] = set()

    def open_read(self, path: str) -> int:
        """Open and count."""
        self.threads.add(threading.get_ident())
        fd = super().open_read(path)
        self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        """Close and uncount."""
        self.threads.add(threading.get_ident())
        self.open_fds.discard(fd)
        super().close(fd)

    def fstat(self, fd: int) -> Any:
        """Forward, noting the thread."""
        self.threads.add(threading.get_ident())
        return super().fstat(fd)

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Forward, noting the thread."""
        self.threads.add(threading.get_ident())
        return super().pread_exact(fd, size, offset)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Forward, noting the thread."""
        self.threads.add(threading.get_ident())
        super().preadv_into(fd, bufs, offset)


def test_with_a_pool_the_landing_makes_no_file_call_on_its_own_thread(
    tmp_path: Path, pool: LandingPool
) -> None:
    """Every port call of a pooled landing (re-check and reads) runs on a landing worker."""
    caches, tokens = _cases()["list"]
    path = write_entry(caches, tokens, tmp_path)
    counting = CountingPort()
    entry = open_entry(counting, str(path), _header(path))
    counting.threads.clear()
    land_entry(entry, pool=pool)
    assert counting.threads
    assert threading.get_ident() not in counting.threads
    entry.close()


def test_no_mlx_call_runs_off_the_landing_thread(
    tmp_path: Path, pool: LandingPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The landing workers only read and hash: every ``mlx.core`` call of a landing is on its own thread."""
    caches, tokens = _cases()["list"]
    path = write_entry(caches, tokens, tmp_path)
    entry = open_entry(PORT, str(path), _header(path))
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                ident = threading.get_ident()
                calls[ident] = calls.get(ident, 0) + 1
            return fn(*args, **kwargs)

        return call

    for name in dir(mx):
        fn = getattr(mx, name)
        if not name.startswith("_") and callable(fn) and not isinstance(fn, type):
            monkeypatch.setattr(mx, name, recording(fn))
    try:
        land_entry(entry, pool=pool)
    finally:
        monkeypatch.undo()
        entry.close()
    me = threading.get_ident()
    assert calls.get(me, 0) > 0  # the recording does see the landing's MLX calls
    assert set(calls) == {me}


class SplittingPort(ForwardingPort):
    """Returns every scatter read in pieces of at most ``piece`` bytes (as a signal could)."""

    def __init__(self, piece: int) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.piece = piece
        self.max_buffers = 0

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Fill each buffer piece by piece through the real port."""
        self.max_buffers = max(self.max_buffers, len(bufs))
        for buf in bufs:
            view = memoryview(buf).cast("B")
            for i in range(0, len(view), self.piece):
                self.inner.preadv_into(fd, [view[i : i + self.piece]], offset)
                offset += len(view[i : i + self.piece])


def test_rows_land_through_any_split_of_the_scatter_reads(
    tmp_path: Path, pool: LandingPool
) -> None:
    """Slack rows land right when reads come back in odd pieces; no read takes over IOV_MAX buffers."""
    cache = KVCache()
    mx.random.seed(3)
    heads = 600  # more rows than one scatter read may take
    cache.update_and_fetch(mx.random.normal((1, heads, 5, 4)), mx.random.normal((1, heads, 5, 4)))
    path = write_entry([cache], list(range(5)), tmp_path)
    port = SplittingPort(7)
    entry = open_entry(port, str(path), _header(path))
    try:
        landed = land_entry(entry, pool=pool, step=4)
    finally:
        entry.close()
    assert 0 < port.max_buffers <= MAX_IOV
    assert landed[0].keys.shape == (1, heads, 8, 4)
    assert _all_bytes(landed) == _all_bytes(_old_path(path, step=4))


def test_preadv_into_resumes_short_reads_inside_a_buffer_and_reports_eof(tmp_path: Path) -> None:
    """OsFilePort.preadv_into fills every buffer in order and raises ShortRead past the end."""
    path = tmp_path / "f"
    path.write_bytes(bytes(range(200)))
    fd = PORT.open_read(str(path))
    try:
        a, b, c = bytearray(3), bytearray(0), bytearray(100)
        PORT.preadv_into(fd, [a, b, memoryview(c)], 10)
        assert (bytes(a), bytes(c)) == (bytes(range(10, 13)), bytes(range(13, 113)))
        with pytest.raises(ShortRead):
            PORT.preadv_into(fd, [bytearray(50), bytearray(50)], 150)
        with pytest.raises(ValueError, match="at most"):
            PORT.preadv_into(fd, [bytearray(1)] * (MAX_IOV + 1), 0)
    finally:
        PORT.close(fd)


def test_a_closed_entry_cannot_land(tmp_path: Path, pool: LandingPool) -> None:
    """Landing a closed entry fails before anything is allocated or read."""
    caches, tokens = _cases()["plain-fp32"]
    path = write_entry(caches, tokens, tmp_path)
    entry: OpenEntry = open_entry(PORT, str(path), _header(path))
    entry.close()
    with pytest.raises(ValueError, match="closed"):
        land_entry(entry, pool=pool)


def test_a_landing_on_a_closed_pool_fails_at_once(tmp_path: Path) -> None:
    """A pool closed at shutdown refuses the landing's jobs: the landing raises, never waits."""
    caches, tokens = _cases()["plain-fp32"]
    path = write_entry(caches, tokens, tmp_path)
    closed = LandingPool(1)
    closed.close()
    entry = open_entry(PORT, str(path), _header(path))
    try:
        with pytest.raises(RuntimeError, match="closed"):
            land_entry(entry, pool=closed)
    finally:
        entry.close()


@pytest.mark.parametrize("case", ["plain-bf16-slack", "list", "mamba"])
def test_a_backend_without_writable_array_buffers_lands_through_host_bytes(
    tmp_path: Path, pool: LandingPool, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Where MLX arrays lend no writable buffer, each tensor is read into host bytes, hashed and
    copied: the same arrays as the old path, and a flipped bit is still caught."""
    from kernels.cache import _kv_landing

    monkeypatch.setattr(_kv_landing, "_writable_view", lambda a: None)
    caches, tokens = _cases()[case]
    path = write_entry(caches, tokens, tmp_path)
    assert _all_bytes(_land(path, pool)) == _all_bytes(_old_path(path))
    header = _header(path)
    entry = open_entry(PORT, str(path), header)
    try:
        _flip(path, header.tensors[0].offset)
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            land_entry(entry, pool=pool)
    finally:
        entry.close()
