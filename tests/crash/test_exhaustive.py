"""Every crash point and crash state of every cold-tier workload of up to three steps.

Workloads are all sequences of 1 to 3 steps over: store A, store A+ (A's
trimmable descendant: supersedes A), store B (another namespace), store C
(past the two-entry cap: evicts the least recently used), scrub (the idle
scrubber re-verifies every entry), restore (every entry read back through
the reader, hashes verified, LRU touched), restart (a startup scan), put A and put
A+ (the RAM tier tells the durability coordinator; write-behind off) and
flush (``durable: true`` acknowledges every prefix put before it). Each
runs on the real actors (SSD tier, spill queue, durability coordinator;
the gateway grants every engine turn at once) over a ``CrashFS``; every
state a crash may leave
after every file-system operation is restarted (and every state a second
crash during that startup may leave) and checked: startup never fails, no
temp file survives it, the cap holds, no file serves bytes that differ from
the stored ones, and every prefix acknowledged durable before the crash is
still served. ``checker.py`` has the details; ``docs/reliability.md`` the
numbers.
"""

from __future__ import annotations

import pytest

from tests.crash import checker
from tests.crash.checker import RestoreStep, ScrubStep, StoreStep
from tests.crash.crash_fs import CrashFS


def test_every_crash_state_of_every_workload_up_to_three_steps_keeps_the_invariants() -> None:
    """0 violations over 100 % of the crash points of all 1,110 workloads (the totals are printed)."""
    report = checker.sweep(checker.workloads(3, checker.DURABLE_ALPHABET), max_violations=20)
    print(f"crash sweep: {report.summary()}")
    assert report.violations == []
    assert report.workloads == 10 + 10**2 + 10**3
    # NOTE: one crash point before the first operation and one after each.
    assert report.crash_points == report.ops + report.workloads
    assert report.reduced_points == 0
    assert report.untracked == []
    assert report.required_checks > 1000
    assert report.states > report.crash_points - report.shared_points


def test_the_scrub_step_drives_the_real_scrubber() -> None:
    """A, B, scrub: the tier's idle scrubber re-verifies both files, reading each one."""
    fs = CrashFS()
    trace = checker.run_forward((StoreStep("A"), StoreStep("B"), ScrubStep()), fs=fs)
    assert trace.problems == []
    assert trace.scrubbed == 2
    assert fs.calls["open_read"] >= 2


def test_a_lost_lru_touch_never_costs_an_acknowledged_entry() -> None:
    """F4: A, B, restore (touches both), C (evicts B): no crash may lose A or C, both acknowledged.

    B lives in another directory than C; before the fix, a crash could undo
    B's unlink and the restore's touch of A together, and the startup,
    over the cap, evicted A by its stale time.
    """
    workload = (StoreStep("A"), StoreStep("B"), RestoreStep(), StoreStep("C"))
    report = checker.sweep([workload], max_violations=1000)
    assert report.violations == []
    assert report.required_checks > 0


@pytest.mark.slow
def test_every_workload_of_four_steps_keeps_the_invariants() -> None:
    """All 2,401 cold-tier workloads of four steps: 0 violations (make test-slow)."""
    report = checker.sweep(checker.workloads(4, checker.ALPHABET)[-(7**4) :], max_violations=50)
    print(f"crash sweep (4 steps): {report.summary()}")
    assert report.violations == []
    assert report.untracked == []
