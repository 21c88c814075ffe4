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

Generation checkpoints join the sweep: workloads over writing an answer's
next checkpoint (through the tier's store worker), its completion, a
restart and a prefix store; after every crash the retry must resume a whole
checkpoint (tensors read with verification off) no older than the newest
answered ``stored``. Two broken writers show the sweep catches a lost
previous checkpoint and a torn one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from actors.checkpoints import write_checkpoint
from kernels.cache import EntryPlan, FilePort
from tests.crash import checker
from tests.crash.checker import (
    CheckpointDoneStep,
    CheckpointStep,
    RestoreStep,
    ScrubStep,
    StoreStep,
)
from tests.crash.crash_fs import CrashFS
from tests.crash.ports import RenameBeforeFsyncPort


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


CHECKPOINT_WORKLOADS = 4 + 4**2 + 4**3


def test_every_crash_state_of_every_checkpoint_workload_resumes_a_whole_checkpoint_no_older_than_acknowledged() -> None:
    """All 84 workloads of up to three steps over checkpoint, completion, restart and a prefix
    store: at every crash point and state, the retry resumes a whole written checkpoint at least
    as new as the last one answered stored (0 violations; the totals are printed)."""
    report = checker.sweep(checker.workloads(3, checker.CHECKPOINT_ALPHABET), max_violations=20)
    print(f"checkpoint crash sweep: {report.summary()}")
    assert report.violations == []
    assert report.workloads == CHECKPOINT_WORKLOADS
    assert report.crash_points == report.ops + report.workloads
    assert report.checkpoint_checks > 500
    assert report.untracked == []


def test_a_checkpoint_is_required_from_its_answer_until_completion() -> None:
    """ckpt, ckpt, done: checkpoint 2 is required from its answer, 4 from its own, none after done."""
    fs = CrashFS(record=True)
    trace = checker.run_forward((CheckpointStep(), CheckpointStep(), CheckpointDoneStep()), fs=fs)
    assert trace.problems == []
    (n2, at2), (n4, at4) = trace.ckpt_acks
    assert (n2, n4) == (2, 4)
    assert trace.checkpoint_required_at(at2 - 1) is None
    assert trace.checkpoint_required_at(at2) == 2
    assert trace.checkpoint_required_at(at4 - 1) == 2
    assert trace.checkpoint_required_at(at4) == 4
    assert trace.checkpoint_required_at(trace.ckpt_done[0] - 1) == 4
    assert trace.checkpoint_required_at(trace.ckpt_done[0]) is None


def _broken_writer(
    port: FilePort, directory: str, plan: EntryPlan, tensor: Callable[[int], memoryview],
    base: object = None,
) -> str:
    """write_checkpoint with its order reversed: the key's older files go BEFORE the new one commits."""
    ck = plan.header.checkpoint
    assert ck is not None
    for e in port.scandir(directory):
        if e.name.startswith(ck.request_key):
            port.unlink(e.path)
    port.fsync_dir(directory)
    return write_checkpoint(port, directory, plan, tensor)


def test_the_sweep_catches_a_writer_that_drops_the_previous_checkpoint_before_the_new_one_is_durable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the older file removed first, some crash during the second write loses checkpoint 2."""
    import actors.ssd_writer.store as ssd_store

    monkeypatch.setattr(ssd_store, "write_checkpoint", _broken_writer)
    report = checker.sweep([(CheckpointStep(), CheckpointStep())], max_violations=50)
    assert any("acknowledged checkpoint 2 is lost (the retry resumes None)" in v
               for v in report.violations), report.violations[:3]


def test_the_sweep_catches_a_checkpoint_renamed_before_its_data_is_synced() -> None:
    """With the rename reaching the directory before the fsync, some crash leaves a torn file
    under the checkpoint's final name: the sweep sees it served torn or the acknowledged one lost."""
    report = checker.sweep([(CheckpointStep(), CheckpointStep())], make_port=RenameBeforeFsyncPort,
                           max_violations=50)
    assert any("serves bytes that differ from the written ones" in v or "is lost" in v
               for v in report.violations), report.violations[:3]


def test_checkpoint_files_are_observed_in_every_content_a_crash_may_leave() -> None:
    """A checkpoint file's content is enumerated per crash state (as entry files are): the sweep
    of one checkpoint has more crash states than crash points."""
    report = checker.sweep([(CheckpointStep(),)], max_violations=5)
    assert report.violations == []
    assert report.states > report.crash_points
    assert os.path.basename(checker.CKPT_DIR) == "checkpoints"
