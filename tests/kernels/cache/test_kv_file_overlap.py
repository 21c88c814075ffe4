"""The landing right behind the reader's pass (``open_file`` + ``pass_over`` overlapping ``land_entry``)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels.cache._file_port import OsFilePort, WritableBuffer
from kernels.cache._kv_format import KvFileHeader
from kernels.cache._kv_header import read_header
from kernels.cache._kv_landing import LandingPool, land_entry
from kernels.cache._kv_reader import OpenEntry, PassFailed, open_entry, open_file
from tests.crash.ports import ForwardingPort
from tests.kernels.cache.test_kv_file import _filled_kv, assert_same_state, write_entry

WAIT = 10.0
"""Seconds any scripted wait may take before the test fails instead of hanging."""


@pytest.fixture
def pool() -> Iterator[LandingPool]:
    """A landing pool of two workers, stopped after the test."""
    p = LandingPool(2)
    yield p
    p.close()


def _entry_file(tmp_path: Path, layers: int = 4) -> tuple[Path, list[Any], KvFileHeader]:
    caches = [_filled_kv(9, mx.bfloat16, seed=i) for i in range(layers)]
    path = write_entry(caches, list(range(9)), tmp_path)
    return path, caches, read_header(OsFilePort(writeback=None), str(path))


def _tensor_at(header: KvFileHeader, offset: int) -> int:
    for i, t in enumerate(header.tensors):
        if t.offset <= offset < t.offset + max(t.nbytes, 1):
            return i
    raise AssertionError(f"offset {offset} is in no tensor")


class ScriptedPort(ForwardingPort):
    """Holds the reader's pass before tensor ``hold_at`` until ``release`` is set; logs every read.

    ``fail_at``: the pass's read of that tensor raises ``EIO`` instead.
    """

    def __init__(self, header: KvFileHeader, *, hold_at: int, fail_at: int | None = None) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.header = header
        self.hold_at = hold_at
        self.fail_at = fail_at
        self.held = threading.Event()
        self.release = threading.Event()
        self.entry: OpenEntry | None = None
        self.landed: list[tuple[int, int]] = []
        self.closed: list[int] = []
        self.reads_after_close = 0
        self._lock = threading.Lock()

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """The pass's reads: held (or failed) at tensor ``hold_at`` / ``fail_at``."""
        if offset >= self.header.data_offset:
            index = _tensor_at(self.header, offset)
            if index == self.hold_at and not self.release.is_set():
                self.held.set()
                assert self.release.wait(WAIT), "the test never released the pass"
            if index == self.fail_at:
                raise OSError(errno.EIO, "scripted read error")
        with self._lock:
            if self.closed:
                self.reads_after_close += 1
        super().pread_into(fd, buf, offset)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """The landing's reads: logged with how far the pass was then."""
        assert self.entry is not None
        with self._lock:
            self.landed.append((_tensor_at(self.header, offset), self.entry.progress))
        super().preadv_into(fd, bufs, offset)

    def close(self, fd: int) -> None:
        """Log the close, then close."""
        with self._lock:
            self.closed.append(fd)
        super().close(fd)


def _start_pass(entry: OpenEntry) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            entry.pass_over()
        except BaseException as exc:  # noqa: BLE001 - NOTE: the test inspects it.
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-reader")
    thread.start()
    return thread, errors


def _opened(
    tmp_path: Path, *, hold_at: int, fail_at: int | None = None
) -> tuple[ScriptedPort, OpenEntry, list[Any], Path]:
    path, caches, header = _entry_file(tmp_path)
    port = ScriptedPort(header, hold_at=hold_at, fail_at=fail_at)
    entry = open_file(port, str(path), header)
    port.entry = entry
    return port, entry, caches, path


def test_a_landing_started_before_the_pass_ended_reads_each_tensor_only_behind_it(
    tmp_path: Path, pool: LandingPool
) -> None:
    """Landing begun while the pass is held at tensor 3: tensors 0-2 land meanwhile, none ahead of the pass."""
    port, entry, caches, _ = _opened(tmp_path, hold_at=3)
    thread, errors = _start_pass(entry)
    assert port.held.wait(WAIT)

    def release_once_three_landed() -> None:
        for _ in range(int(WAIT / 0.01)):
            with port._lock:
                if {i for i, _ in port.landed} >= {0, 1, 2}:
                    break
            threading.Event().wait(0.01)
        port.release.set()

    releaser = threading.Thread(target=release_once_three_landed)
    releaser.start()
    landed = land_entry(entry, pool=pool)
    releaser.join(WAIT)
    thread.join(WAIT)
    assert errors == []
    assert {i for i, p in port.landed if p <= 3} >= {0, 1, 2}
    assert all(index < progress for index, progress in port.landed)
    for original, got in zip(caches, landed, strict=True):
        assert_same_state(original, got)
    entry.close()
    assert len(port.closed) == 1


def test_a_landing_after_the_pass_is_unchanged(tmp_path: Path, pool: LandingPool) -> None:
    """A late turn (pass already done through ``open_entry``) lands every tensor without waiting."""
    path, caches, header = _entry_file(tmp_path)
    entry = open_entry(OsFilePort(writeback=None), str(path), header)
    assert entry.passed
    assert entry.progress == len(header.tensors)
    landed = land_entry(entry, pool=pool)
    for original, got in zip(caches, landed, strict=True):
        assert_same_state(original, got)
    entry.close()


def test_a_pass_failing_mid_way_fails_the_landing_behind_it(
    tmp_path: Path, pool: LandingPool
) -> None:
    """An I/O error in the pass at tensor 5 wakes the waiting landing: PassFailed, no arrays, file closable."""
    port, entry, _, _ = _opened(tmp_path, hold_at=2, fail_at=5)
    thread, errors = _start_pass(entry)
    assert port.held.wait(WAIT)
    port.release.set()
    with pytest.raises(PassFailed):
        land_entry(entry, pool=pool)
    thread.join(WAIT)
    assert not thread.is_alive()
    assert [type(e) for e in errors] == [OSError]
    assert entry.pass_failure is not None
    assert not entry.passed
    assert all(index < 5 for index, _ in port.landed)
    entry.close()
    assert len(port.closed) == 1


def test_closing_during_the_pass_cancels_it_and_closes_only_after_its_last_read(
    tmp_path: Path,
) -> None:
    """A close while the pass is held (shutdown, pushed out) stops the pass and closes after its last read."""
    port, entry, _, _ = _opened(tmp_path, hold_at=2)
    thread, errors = _start_pass(entry)
    assert port.held.wait(WAIT)
    entry.close()
    assert port.closed == []  # NOTE: the pass still reads through the descriptor.
    assert entry.closed
    with pytest.raises(ValueError):
        entry.fileno()
    port.release.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert [type(e) for e in errors] == [PassFailed]
    assert len(port.closed) == 1
    assert port.reads_after_close == 0
    assert entry.progress <= 3
    assert entry.pass_failure is not None
    entry.close()
    assert len(port.closed) == 1


def test_an_abandoned_pass_wakes_a_waiting_landing(tmp_path: Path, pool: LandingPool) -> None:
    """A pass that never runs (its worker cancelled) ends by ``abandon``: the landing fails instead of hanging."""
    port, entry, _, _ = _opened(tmp_path, hold_at=0)
    timer = threading.Timer(0.2, entry.abandon)
    timer.start()
    with pytest.raises(PassFailed):
        land_entry(entry, pool=pool)
    timer.join(WAIT)
    assert port.landed == []
    with pytest.raises(RuntimeError):
        entry.pass_over()
    entry.close()
    assert len(port.closed) == 1


def test_a_pass_runs_once_and_not_on_a_closed_entry(tmp_path: Path) -> None:
    """``pass_over`` twice is refused; on an entry closed before it, PassFailed and nothing read."""
    path, _, header = _entry_file(tmp_path)
    entry = open_file(OsFilePort(writeback=None), str(path), header)
    assert entry.pass_over() == header.nbytes
    with pytest.raises(RuntimeError):
        entry.pass_over()
    entry.close()
    port = ScriptedPort(header, hold_at=-1)
    closed = open_file(port, str(path), header)
    port.entry = closed
    closed.close()
    with pytest.raises(PassFailed):
        closed.pass_over()
    assert closed.pass_failure is not None
