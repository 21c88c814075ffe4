"""The crash model of ``CrashFS`` and the Nth-call faults of ``FaultingPort``, rule by rule."""

from __future__ import annotations

import errno

import pytest

from kernels.cache._file_port import LockUnavailable, ShortRead
from tests.crash.crash_fs import (
    CrashFS,
    CrashState,
    Fault,
    FaultingPort,
    UnobservedRead,
)


def _fs(*, record: bool = False) -> CrashFS:
    fs = CrashFS(record=record)
    fs.makedirs("/d")
    return fs


def _images(fs: CrashFS) -> set[tuple[tuple[str, bytes], ...]]:
    """Every crash state of a crash now, as {(path, content), ...} (directories left out)."""
    return {tuple((f.path, f.data) for f in s.files) for s in fs.crash_space().states()}


def _write_file(fs: CrashFS, path: str, data: bytes, *, sync: bool) -> int:
    fd = fs.open_temp(path)
    fs.pwrite_all(fd, data, 0)
    if sync:
        fs.fsync(fd)
    return fd


def test_an_unsynced_creation_may_vanish_until_its_directory_is_synced() -> None:
    """A new name survives every crash only after fsync_dir of its directory."""
    fs = _fs()
    fd = _write_file(fs, "/d/f", b"abc", sync=True)
    assert _images(fs) == {(), (("/d/f", b"abc"),)}
    fs.fsync_dir("/d")
    assert _images(fs) == {(("/d/f", b"abc"),)}
    fs.close(fd)


def test_unsynced_writes_are_kept_dropped_or_garbage_each_on_its_own() -> None:
    """Two pending writes give 3 x 3 contents; after fsync only the synced one is left."""
    fs = _fs()
    fd = fs.open_temp("/d/f")
    fs.fsync_dir("/d")
    fs.pwrite_all(fd, b"aa", 0)
    fs.pwrite_all(fd, b"bb", 2)
    contents = {img[0][1] for img in _images(fs)}
    assert len(contents) == 9
    assert {b"", b"aabb", b"aa", b"\x00\x00bb"} <= contents
    garbage = [c for c in contents if len(c) == 4 and c not in (b"aabb", b"\x00\x00bb")]
    assert garbage  # NOTE: some content keeps neither the data nor zeros in a written range.
    fs.fsync(fd)
    assert _images(fs) == {(("/d/f", b"aabb"),)}
    fs.close(fd)


def test_a_truncation_persists_or_not() -> None:
    """A pending ftruncate either sets the size or leaves the synced one."""
    fs = _fs()
    fd = _write_file(fs, "/d/f", b"abcdef", sync=True)
    fs.fsync_dir("/d")
    fs.truncate(fd, 2)
    assert {img[0][1] for img in _images(fs)} == {b"abcdef", b"ab"}
    fs.close(fd)


def test_an_unsynced_rename_shows_one_name_never_both() -> None:
    """A rename within a directory is atomic: the old name or the new one, never both or a mix."""
    fs = _fs()
    fd = _write_file(fs, "/d/tmp", b"x", sync=True)
    fs.close(fd)
    fs.fsync_dir("/d")
    fs.replace("/d/tmp", "/d/final")
    assert _images(fs) == {(("/d/tmp", b"x"),), (("/d/final", b"x"),)}
    fs.fsync_dir("/d")
    assert _images(fs) == {(("/d/final", b"x"),)}


def test_a_rename_over_an_old_file_leaves_the_old_or_the_new_content() -> None:
    """Replacing a synced file: a crash before the directory sync may bring the old one back."""
    fs = _fs()
    fs.close(_write_file(fs, "/d/final", b"old", sync=True))
    fs.fsync_dir("/d")
    fs.close(_write_file(fs, "/d/tmp", b"new", sync=True))
    fs.replace("/d/tmp", "/d/final")
    images = _images(fs)
    assert (("/d/final", b"old"),) in images
    assert (("/d/final", b"new"),) in images
    assert all(dict(img).get("/d/final") in (b"old", b"new") for img in images)


def test_an_unsynced_unlink_may_be_undone() -> None:
    """An unlink is durable only after its directory's fsync."""
    fs = _fs()
    fs.close(_write_file(fs, "/d/f", b"x", sync=True))
    fs.fsync_dir("/d")
    fs.unlink("/d/f")
    assert _images(fs) == {(), (("/d/f", b"x"),)}
    fs.fsync_dir("/d")
    assert _images(fs) == {()}


def test_directories_are_independent() -> None:
    """Syncing one directory makes nothing in another durable."""
    fs = _fs()
    fs.makedirs("/e")
    fs.close(_write_file(fs, "/d/f", b"1", sync=True))
    fs.close(_write_file(fs, "/e/g", b"2", sync=True))
    fs.fsync_dir("/d")
    assert _images(fs) == {(("/d/f", b"1"),), (("/d/f", b"1"), ("/e/g", b"2"))}


def test_makedirs_makes_each_new_directory_durable() -> None:
    """Directories made by makedirs survive every crash (their parents are fsynced)."""
    fs = CrashFS()
    fs.makedirs("/a/b/c")
    for state in fs.crash_space().states():
        assert set(state.dirs) == {"/", "/a", "/a/b", "/a/b/c"}


def test_a_failed_fsync_loses_the_data_and_a_retry_succeeds_over_the_loss() -> None:
    """fsyncgate: after a writeback error the data reads back now, is gone after a crash,
    and the next fsync reports success without bringing it back."""
    fs = _fs()
    fd = fs.open_temp("/d/f")
    fs.fsync_dir("/d")
    fs.pwrite_all(fd, b"data", 0)
    fs.writeback_error(fd)
    assert fs.read_file("/d/f") == b"data"
    fs.fsync(fd)
    assert _images(fs) == {(("/d/f", b""),)}
    fs.close(fd)


def test_recording_keeps_a_space_before_and_after_every_change() -> None:
    """With record=True there is one crash space per changing operation, plus the start."""
    fs = CrashFS(record=True)
    fs.makedirs("/d")  # mkdir + fsync of "/"
    fd = fs.open_temp("/d/f")
    fs.pwrite_all(fd, b"x", 0)
    fs.fsync(fd)
    fs.close(fd)  # changes nothing
    fs.stat("/d/f")  # changes nothing
    assert [op.kind for op in fs.ops] == ["mkdir", "fsync_dir", "create", "write", "fsync"]
    assert [s.point for s in fs.spaces] == [0, 1, 2, 3, 4, 5]
    assert fs.spaces[0].last_op is None
    assert fs.spaces[-1].last_op == fs.ops[-1]


def test_a_mounted_state_is_durable_and_unobserved_files_cannot_be_read() -> None:
    """mount() gives a file system holding the state; reading an unobserved file raises."""
    fs = _fs()
    fs.close(_write_file(fs, "/d/a.kvt", b"entry", sync=True))
    fs.close(_write_file(fs, "/d/b.tmp", b"temp", sync=True))
    fs.fsync_dir("/d")
    (state,) = fs.crash_space().states(observe=lambda p: p.endswith(".kvt"))
    assert isinstance(state, CrashState)
    again = CrashFS.mount(state)
    assert _images(again) == {(("/d/a.kvt", b"entry"), ("/d/b.tmp", b"temp"))}
    fd = again.open_read("/d/a.kvt")
    assert again.pread_exact(fd, 5, 0) == b"entry"
    with pytest.raises(ShortRead):
        again.pread_exact(fd, 6, 0)
    with pytest.raises(UnobservedRead):
        again.open_read("/d/b.tmp")
    again.unlink("/d/b.tmp")  # NOTE: removing an unobserved file is allowed: it reads nothing.


def test_unobserved_files_are_enumerated_with_one_content() -> None:
    """observe() false collapses a file's content variants to its current content."""
    fs = _fs()
    fd = fs.open_temp("/d/t.tmp")
    fs.fsync_dir("/d")
    fs.pwrite_all(fd, b"ab", 0)
    fs.pwrite_all(fd, b"cd", 2)
    assert len(list(fs.crash_space().states())) == 9
    (only,) = fs.crash_space().states(observe=lambda p: False)
    assert only.files[0].data == b"abcd"


def test_errors_match_the_os() -> None:
    """Missing paths, existing names, directories and bad descriptors raise the usual OSErrors."""
    fs = _fs()
    with pytest.raises(FileNotFoundError):
        fs.open_temp("/missing/f")
    fs.close(fs.open_temp("/d/f"))
    with pytest.raises(FileExistsError):
        fs.open_temp("/d/f")
    with pytest.raises(FileNotFoundError):
        fs.unlink("/d/g")
    with pytest.raises(IsADirectoryError):
        fs.unlink("/d")
    with pytest.raises(OSError) as info:
        fs.close(99)
    assert info.value.errno == errno.EBADF
    held = fs.lock("/d/lock")
    with pytest.raises(LockUnavailable):
        fs.lock("/d/lock")
    held.release()
    fs.lock("/d/lock").release()


@pytest.mark.parametrize(
    ("kind", "error", "code"),
    [
        ("enospc", OSError, errno.ENOSPC),
        ("eio", OSError, errno.EIO),
        ("eintr", InterruptedError, errno.EINTR),
    ],
)
def test_the_nth_call_of_a_method_fails_once(kind: str, error: type[OSError], code: int) -> None:
    """Only the chosen call fails, with the chosen errno; the others go through."""
    fs = _fs()
    port = FaultingPort(fs, Fault("open_temp", 2, kind))  # type: ignore[arg-type]
    port.close(port.open_temp("/d/a"))
    with pytest.raises(error) as info:
        port.open_temp("/d/b")
    assert info.value.errno == code
    assert port.fired
    port.close(port.open_temp("/d/c"))
    assert port.calls["open_temp"] == 3
    assert sorted(fs.tree()) == ["/d/a", "/d/c"]


def test_a_short_write_lands_half_then_fails_with_enospc() -> None:
    """'short' writes the first half of the buffer, then raises ENOSPC."""
    fs = _fs()
    port = FaultingPort(fs, Fault("pwrite_all", 1, "short"))
    fd = port.open_temp("/d/f")
    with pytest.raises(OSError) as info:
        port.pwrite_all(fd, b"abcdef", 0)
    assert info.value.errno == errno.ENOSPC
    assert fs.read_file("/d/f") == b"abc"


def test_a_failed_fsync_through_the_port_loses_the_dirty_data() -> None:
    """FaultingPort turns an fsync fault into a writeback error of the CrashFS below."""
    fs = _fs()
    port = FaultingPort(fs, Fault("fsync", 1, "eio"))
    fd = port.open_temp("/d/f")
    port.fsync_dir("/d")
    port.pwrite_all(fd, b"data", 0)
    with pytest.raises(OSError):
        port.fsync(fd)
    port.fsync(fd)
    assert _images(fs) == {(("/d/f", b""),)}


def test_a_failed_close_still_closes() -> None:
    """close(2) releases the descriptor even when it reports an error."""
    fs = _fs()
    port = FaultingPort(fs, Fault("close", 1, "eio"))
    fd = port.open_temp("/d/f")
    with pytest.raises(OSError):
        port.close(fd)
    with pytest.raises(OSError) as info:
        fs.close(fd)
    assert info.value.errno == errno.EBADF


def test_fault_arguments_are_checked() -> None:
    """Unknown methods, n < 1 and short faults outside pwrite_all are refused."""
    with pytest.raises(ValueError):
        Fault("nope", 1, "eio")
    with pytest.raises(ValueError):
        Fault("fsync", 0, "eio")
    with pytest.raises(ValueError):
        Fault("fsync", 1, "short")


def test_large_pending_sets_use_the_reduced_family() -> None:
    """Past max_file_variants a file's contents come from the reduced family, and the space says so."""
    fs = CrashFS(max_file_variants=10)
    fs.makedirs("/d")
    fd = fs.open_temp("/d/f")
    fs.fsync_dir("/d")
    for i in range(4):
        fs.pwrite_all(fd, bytes([65 + i]), i)
    space = fs.crash_space()
    contents = {s.files[0].data for s in space.states()}
    assert space.reduced
    assert {b"", b"ABCD", b"A", b"AB", b"ABC", b"\x00BCD", b"A\x00CD"} <= contents
    assert len(contents) < 3**4


def test_an_unsynced_utime_may_be_lost_and_an_fsync_keeps_it() -> None:
    """A file's mtime after a crash is the synced one or a later utime that persisted."""
    fs = _fs()
    fd = _write_file(fs, "/d/f", b"x", sync=True)
    fs.fsync_dir("/d")
    synced = fs.stat("/d/f").mtime_ns
    fs.utime("/d/f", synced + 5)
    fs.utime("/d/f", synced + 9)
    times = {s.files[0].mtime_ns for s in fs.crash_space().states()}
    assert times == {synced, synced + 5, synced + 9}
    fs.fsync(fd)
    assert {s.files[0].mtime_ns for s in fs.crash_space().states()} == {synced + 9}
    fs.close(fd)
