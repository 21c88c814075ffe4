"""Deliberately broken writers, each caught by the crash checker.

Each variant changes one step of the write protocol through a port wrapper
(``tests/crash/ports.py``); the real tier actors run unchanged above it.
The same workloads through the correct port have no violation
(``test_exhaustive.py``), so every violation here is the variant's.
"""

from __future__ import annotations

from kernels.cache._file_port import FilePort
from tests.crash import checker
from tests.crash.checker import FlushStep, PutStep, StoreStep
from tests.crash.crash_fs import CrashFS, Fault, FaultingPort
from tests.crash.ports import NoDirFsyncPort, RenameBeforeFsyncPort, TrustedRetryFsyncPort

STORES = [
    (StoreStep("A"),),
    (StoreStep("B"),),
    (StoreStep("A"), StoreStep("A+")),
    (PutStep("A"), FlushStep()),
]


def _kinds(report: checker.Report) -> set[str]:
    out: set[str] = set()
    for v in report.violations:
        if "acknowledged prefix" in v and "is not served" in v:
            out.add("lost")
        elif "serves bytes that differ" in v:
            out.add("wrong_bytes")
        else:
            out.add(v)
    return out


def test_a_writer_without_the_directory_fsync_loses_acknowledged_entries() -> None:
    """Skipping fsync of the directory after the rename: a crash after the ack loses the entry."""
    report = checker.sweep(STORES, make_port=NoDirFsyncPort, max_violations=1000)
    assert report.violations
    assert _kinds(report) == {"lost"}


def test_a_writer_that_renames_before_fsync_exposes_torn_files() -> None:
    """Renaming before the data is synced: a crash can leave a final name with torn content."""
    report = checker.sweep(STORES, make_port=RenameBeforeFsyncPort, max_violations=1000)
    assert report.violations
    assert "wrong_bytes" in _kinds(report)


def test_a_writer_that_trusts_a_retried_fsync_loses_acknowledged_entries() -> None:
    """fsyncgate: EIO on fsync, retry succeeds over lost pages, ack; a crash loses the entry."""
    ports: list[TrustedRetryFsyncPort] = []

    def broken(fs: CrashFS) -> FilePort:
        port = TrustedRetryFsyncPort(FaultingPort(fs, Fault("fsync", 1, "eio")))
        ports.append(port)
        return port

    report = checker.sweep(STORES, make_port=broken, max_violations=1000)
    assert all(p.retried == 1 for p in ports)
    assert report.violations
    assert _kinds(report) == {"lost"}


def test_the_real_writer_under_the_same_fsync_fault_loses_nothing() -> None:
    """The same EIO on fsync with the real port: the store is refused, nothing acknowledged is lost."""

    def real(fs: CrashFS) -> FilePort:
        return FaultingPort(fs, Fault("fsync", 1, "eio"))

    report = checker.sweep(STORES, make_port=real, max_violations=1000)
    assert report.violations == []


def test_a_flush_after_a_failed_fsync_is_not_durable_until_the_entry_is_rewritten() -> None:
    """fsyncgate at the flush: EIO on the write's fsync -> durable false; the next flush rewrites
    the file and is durable; no crash state in between loses or invents an acknowledgement."""
    workload = (PutStep("A"), FlushStep(), FlushStep())
    fs = CrashFS(record=True)
    port = FaultingPort(fs, Fault("fsync", 1, "eio"))
    trace = checker.run_forward(workload, fs=fs, port=port)
    first, second = trace.flushes
    assert (first.durable, first.failed) == (False, 1)
    assert (second.durable, second.written) == (True, 1)
    assert [at for _, at in trace.acks] == [fs.op_count]
    report = checker.Sweeper().check("put A -> flush -> flush", trace, fs.spaces)
    assert report.violations == []
    assert report.required_checks > 0
