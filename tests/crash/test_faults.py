"""Nth-call faults: ENOSPC, EIO, EINTR and short writes on every call of every port method.

For each workload, a clean run counts the port calls by method; then one
run per (method, n, fault) fails exactly that call. Every run must keep the
forward invariants (every store answered, a failed store answered with a
soft reason, no temp file, the index equal to the files on disk, the cap
held at every operation) and pass the full crash sweep of its own trace
(a fault followed by a crash loses nothing acknowledged and serves nothing
wrong; a failed fsync loses its dirty pages, as Linux does).

Three known gaps (reported; ``docs/reliability.md``, "Known gaps") show up
under faults; :func:`known_gap` recognises exactly those and nothing else,
and each is pinned by a strict-xfail test below that fails while the gap
exists. None serves wrong bytes; F1 and F2 can exceed the byte cap until
the next startup, F3 can lose an acknowledged entry after a failed
directory fsync followed by a crash.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kernels.cache._crash_fs import CrashFS, Fault, FaultingPort
from tests.crash import checker
from tests.crash.checker import FlushStep, PutStep, RestartStep, RestoreStep, StoreStep

# NOTE: the startup scan reads each header through these calls; an OS error
# there leaves the file unindexed and not deleted (by design), and uncounted.
SCAN_READS = frozenset({"scandir", "open_read", "pread_exact", "pread_into", "fstat", "close"})


def known_gap(item: checker.FaultItem) -> str:
    """The known gap an item of the fault sweep belongs to ('' when none).

    F1: a read error at the startup scan leaves a valid file unindexed and
    uncounted (untracked; the cap can be exceeded by its size until the next
    startup). F2: a superseded file whose unlink failed stays on disk
    uncounted (untracked; same cap consequence). F3: a failed directory
    fsync leaves the removed final file able to reappear after a crash;
    that startup is over the cap and its LRU eviction may drop an older,
    acknowledged entry instead.
    """
    method, text = item.fault.method, item.text
    over_cap = "bytes on disk at one point" in text
    if method in SCAN_READS and item.phase == "startup" and (item.untracked or over_cap):
        return "F1"
    if method == "unlink" and item.superseded and (item.untracked or over_cap):
        return "F2"
    if (
        method == "fsync_dir"
        and "is not served (the startup evicted over the cap)" in text
        and not item.untracked
    ):
        return "F3"
    return ""


def _check(items: list[checker.FaultItem]) -> Counter[str]:
    gaps = Counter(known_gap(i) for i in items)
    unexplained = [i.text for i in items if not known_gap(i)]
    assert unexplained == []
    return gaps


# NOTE: flush workloads: a flush whose write fails and the flush after it
# (fsyncgate: the retry must rewrite), a flush over a stored ancestor, and a
# put that a restart forgets before its flush.
FLUSH_WORKLOADS = [
    (PutStep("A"), FlushStep(), FlushStep()),
    (StoreStep("A"), PutStep("A+"), FlushStep()),
    (PutStep("A"), RestartStep(), FlushStep()),
]
# NOTE: every step of the cold tier followed by a store in another
# namespace, so each fault is also followed by work that must succeed; and
# a startup scan and a restore over a stored file.
THEN_B = [(step, StoreStep("B")) for step in checker.ALPHABET]
SCAN = [(StoreStep("A"), RestartStep(), RestoreStep())]


def test_every_fault_on_every_call_fails_softly() -> None:
    """0 violations with each fault kind on each call of each method of every cold-tier step
    (followed by a store), of a scan and restore, and of three flush workloads."""
    report, items, runs = checker.fault_sweep([*THEN_B, *SCAN, *FLUSH_WORKLOADS], max_items=200)
    gaps = _check(items)
    print(f"fault sweep: {runs} faulted runs; {report.summary()}; known gaps {dict(gaps)}")
    assert runs > 400
    assert report.violations == []


@pytest.mark.slow
def test_every_fault_of_every_workload_up_to_two_steps_is_soft() -> None:
    """Every (method, n, fault kind) of all 110 workloads of one or two steps (make test-slow)."""
    workloads = checker.workloads(2, checker.DURABLE_ALPHABET)
    report, items, runs = checker.fault_sweep(workloads, max_items=200)
    gaps = _check(items)
    print(
        f"fault sweep (2 steps): {runs} faulted runs; {report.summary()}; known gaps {dict(gaps)}"
    )
    assert report.violations == []


@pytest.mark.slow
def test_every_call_of_every_workload_up_to_three_steps_fails_softly() -> None:
    """Each call of all 399 cold-tier workloads of up to three steps; only the gaps F1-F3 show."""
    report, items, runs = checker.fault_sweep(checker.workloads(3), every_kind=False)
    gaps = _check(items)
    print(
        f"fault sweep (3 steps): {runs} faulted runs; {report.summary()}; known gaps {dict(gaps)}"
    )


async def _run_with(workload: tuple[checker.Step, ...], fault: Fault) -> checker.Trace:
    fs = CrashFS()
    port = FaultingPort(fs, fault)
    trace = await checker.forward(workload, fs=fs, port=port)
    assert port.fired
    return trace


@pytest.mark.anyio
@pytest.mark.xfail(
    strict=True, reason="F2: a superseded file that cannot be unlinked leaves the cap"
)
async def test_a_superseded_file_that_cannot_be_unlinked_still_counts_toward_the_cap() -> None:
    """A -> A+ (the unlink of A fails) -> B: the disk must still hold at most the cap."""
    workload = (StoreStep("A"), StoreStep("A+"), StoreStep("B"))
    trace = await _run_with(workload, Fault("unlink", 1, "eio"))
    assert [p for p in trace.problems if "bytes on disk" in p] == []


@pytest.mark.anyio
@pytest.mark.xfail(strict=True, reason="F1: a file the startup scan cannot read is not counted")
async def test_a_file_the_scan_cannot_read_still_counts_toward_the_cap() -> None:
    """A, B -> restart (EIO reading the first header) -> C: the disk must still hold at most the cap."""
    workload = (StoreStep("A"), StoreStep("B"), RestartStep(), StoreStep("C"))
    calls = await checker.count_calls(workload[:2])
    # NOTE: the first header read after the restart is the first pread_exact
    # past those of the clean part of the run.
    fault = Fault("pread_exact", calls["pread_exact"] + 1, "eio")
    trace = await _run_with(workload, fault)
    assert [p for p in trace.problems if "bytes on disk" in p] == []


@pytest.mark.anyio
@pytest.mark.xfail(
    strict=True, reason="F3: a failed directory fsync leaves a file that may reappear"
)
async def test_a_failed_directory_fsync_never_costs_an_acknowledged_entry_after_a_crash() -> None:
    """A, B (its directory fsync fails), C: no crash may lose A or C, both acknowledged."""
    workload = (StoreStep("A"), StoreStep("B"), StoreStep("C"))
    report, _ = await checker.check_fault(workload, Fault("fsync_dir", 2, "eio"), checker.Sweeper())
    assert report.violations == []
