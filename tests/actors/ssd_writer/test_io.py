"""The cold tier's blocking file work: durable removals and what the startup scan reports."""

from __future__ import annotations

from actors.ssd_writer import io
from tests.crash import checker
from tests.crash.crash_fs import CrashFS, Fault, FaultingPort

FP_DIR = checker.FP_DIR


def _fs_with(*names: str) -> CrashFS:
    """A CrashFS holding durable files ``<FP_DIR>/<name>`` (``ns/x.kvt``), 10 bytes each."""
    fs = CrashFS()
    for name in names:
        fs.makedirs(f"{FP_DIR}/{name.split('/')[0]}")
        fs.put_file(f"{FP_DIR}/{name}", b"0123456789")
    return fs


def test_a_durable_removal_fsyncs_each_directory_once_after_its_unlinks() -> None:
    """Unlinks first, then one fsync per directory: after it no crash brings a file back."""
    fs = _fs_with("a/1.kvt", "a/2.kvt", "b/3.kvt")
    start = fs.op_count
    paths = (f"{FP_DIR}/a/1.kvt", f"{FP_DIR}/a/2.kvt", f"{FP_DIR}/b/3.kvt")
    removal = io.remove_durably(fs, paths)
    assert removal == io.Removal(gone=paths)
    ops = [(op.kind, op.path) for op in fs.ops[start:]]
    assert ops == [
        *(("unlink", p) for p in paths),
        ("fsync_dir", f"{FP_DIR}/a"),
        ("fsync_dir", f"{FP_DIR}/b"),
    ]
    last = fs.crash_space()
    assert all(not f.path.endswith(".kvt") for s in last.states() for f in s.files)


def test_a_removal_whose_directory_fsync_fails_is_unsynced_and_may_come_back() -> None:
    """A failed directory fsync is reported (never retried): a crash may undo the unlink."""
    fs = _fs_with("a/1.kvt")
    path = f"{FP_DIR}/a/1.kvt"
    removal = io.remove_durably(FaultingPort(fs, Fault("fsync_dir", 1, "eio")), (path,))
    assert removal == io.Removal(unsynced=(path,))
    assert removal.left == (path,)
    assert path not in fs.tree()
    assert any(path in [f.path for f in s.files] for s in fs.crash_space().states())
    # NOTE: the next removal of the same path syncs what the first one unlinked.
    assert io.remove_durably(fs, (path,)) == io.Removal(gone=(path,))
    assert all(path not in [f.path for f in s.files] for s in fs.crash_space().states())


def test_a_removal_whose_unlink_fails_leaves_the_file_and_fsyncs_nothing() -> None:
    """An unlink that fails is ``failed``; no directory fsync is spent on it."""
    fs = _fs_with("a/1.kvt")
    port = FaultingPort(fs, Fault("unlink", 1, "eio"))
    path = f"{FP_DIR}/a/1.kvt"
    assert io.remove_durably(port, (path,)) == io.Removal(failed=(path,))
    assert port.calls["fsync_dir"] == 0
    assert path in fs.tree()


def test_the_scan_reports_a_file_it_cannot_read_with_its_size() -> None:
    """An EIO reading a header is no proof of corruption: the file is reported unreadable,
    with the size the listing gave, so the index can count it."""
    fs = _fs_with("a/1.kvt")
    port = FaultingPort(fs, Fault("open_read", 1, "eio"))
    scan = io.scan(port, checker.ROOT, checker.IDENTITY.fingerprint, tokenizer_hash=None,
                   max_header_bytes=None)  # fmt: skip
    (scanned,) = scan.files
    assert (scanned.problem, scanned.file_bytes) == ("unreadable", 10)
    assert scan.directories == (f"{FP_DIR}/a",)
    assert not scan.incomplete


def test_a_directory_the_scan_cannot_list_makes_it_incomplete() -> None:
    """A namespace directory that cannot be listed is not skipped silently."""
    fs = _fs_with("a/1.kvt")
    port = FaultingPort(fs, Fault("scandir", 3, "eio"))
    scan = io.scan(port, checker.ROOT, checker.IDENTITY.fingerprint, tokenizer_hash=None,
                   max_header_bytes=None)  # fmt: skip
    assert port.fired
    assert scan.incomplete
    assert scan.files == ()
