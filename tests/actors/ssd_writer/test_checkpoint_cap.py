"""Generation checkpoint files count under the cold tier's byte cap (index core, by plain calls)."""

from __future__ import annotations

import os

from actors.ssd_writer import core
from messages import EntryMeta, EntryWritten, ReserveSpace, SpaceReserved, Store, WriteCommitted
from messages.spill_queue import CheckpointRecord, RemoveCheckpoints
from messages.ssd_writer import FilesRemoved, ScrubPick
from tests.actors.ssd_writer.test_core import (
    FP,
    ROOT,
    answer,
    deliver,
    drive_store,
    env,
    new_state,
    scan_loaded,
)

KEY = "ab" * 16
CK_DIR = os.path.join(ROOT, FP, "checkpoints")
DAY_NS = 24 * 3600 * 10**9


def _ck_path(key: str, index: int) -> str:
    return os.path.join(CK_DIR, f"{key}-{index}.kvc")


def _write(state: core.IndexState, nbytes: int, *, key: str = KEY, index: int = 8,
           handle: str = "ck") -> SpaceReserved:
    """Drive one checkpoint Store as the store worker does: forward, reserve, settle."""
    record = CheckpointRecord(request_key=key, prompt_len=2, pending_token=5, sample_index=index)
    meta = EntryMeta(offset=3, nbytes=1, trimmable=True, min_reusable_offset=0)
    request = env(Store(handle=handle, tokens=(1, 2, 3), meta=meta, checkpoint=record))
    _, fx = deliver(state, request)
    job_id = core.checkpoint_job_id(handle)
    assert fx == [core.ForwardCheckpoint(request, job_id)]
    _, fx = deliver(state, env(ReserveSpace(job_id=job_id, file_bytes=nbytes)))
    reserved = answer(fx)
    assert isinstance(reserved, SpaceReserved)
    if reserved.ok:
        assert core.stats(state).reserved_bytes == nbytes
    written = EntryWritten(job_id=job_id, ok=reserved.ok, reason=reserved.reason,
                           path=_ck_path(key, index) if reserved.ok else None, file_bytes=nbytes)
    _, fx = deliver(state, env(written))
    assert answer(fx) == WriteCommitted()
    assert state.reserved_bytes == 0
    assert job_id not in state.jobs
    return reserved


def test_checkpoint_reservation_evicts_prompt_entries_under_the_cap() -> None:
    """A checkpoint that does not fit evicts the LRU prompt entry, then counts in bytes."""
    state = new_state(max_bytes=100)
    old = drive_store(state, (1, 2), nbytes=60)
    drive_store(state, (7, 8), nbytes=30)
    assert old.result.stored
    assert state.indexed_bytes == 90
    reserved = _write(state, 50)
    assert reserved.ok
    assert reserved.evict == (old.result.path,)
    assert (state.indexed_bytes, state.checkpoint_bytes) == (30, 50)
    stats = core.stats(state)
    assert (stats.bytes, stats.checkpoint_bytes) == (80, 50)
    assert stats.bytes + stats.leftover_bytes <= stats.max_bytes


def test_checkpoint_too_large_for_the_cap_is_refused_over_cap() -> None:
    """A checkpoint larger than the room checkpoints leave is refused over_cap; nothing counts."""
    state = new_state(max_bytes=100)
    assert _write(state, 70, key="cd" * 16).ok
    reserved = _write(state, 40, index=16)
    assert (reserved.ok, reserved.reason) == (False, "over_cap")
    assert _write(state, 101, index=24).reason == "over_cap"
    assert (state.checkpoint_bytes, state.too_large, state.store_failures) == (70, 0, 0)


def test_newer_checkpoint_replaces_the_older_file_of_its_key() -> None:
    """A committed checkpoint stops the count of its key's older file (the write removed it)."""
    state = new_state(max_bytes=1000)
    assert _write(state, 50, index=8).ok
    assert _write(state, 70, index=16, handle="ck2").ok
    assert state.checkpoints == {_ck_path(KEY, 16): 70}
    assert state.checkpoint_bytes == 70


def test_completion_removal_subtracts_the_keys_checkpoint_bytes() -> None:
    """The worker's FilesRemoved for a key's checkpoint stops counting every file of that key."""
    state = new_state(max_bytes=1000)
    other = "cd" * 16
    assert _write(state, 50).ok
    assert _write(state, 20, key=other, handle="o").ok
    # NOTE: a resume's lookup may have removed a stale file the index still counts.
    state.checkpoints[_ck_path(KEY, 4)] = 5
    state.checkpoint_bytes += 5
    _, fx = deliver(state, env(RemoveCheckpoints(request_key=KEY)))
    assert [type(e) for e in fx] == [core.ForwardCheckpoint]
    deliver(state, env(FilesRemoved(removed=(_ck_path(KEY, 8),))))
    assert (state.checkpoints, state.checkpoint_bytes) == ({_ck_path(other, 8): 20}, 20)
    deliver(state, env(FilesRemoved(failed=(_ck_path(other, 8),))))
    assert state.checkpoint_bytes == 20


def test_startup_scan_counts_checkpoints_and_reaps_expired_ones() -> None:
    """The scan counts *.kvc bytes under the cap and removes files older than the age bound."""
    now = 1_000 * DAY_NS
    fresh = core.ScannedCheckpoint(_ck_path(KEY, 8), 40, now - DAY_NS + 10**9)
    stale = core.ScannedCheckpoint(_ck_path("cd" * 16, 8), 30, now - DAY_NS - 10**9)
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=1000)
    _, fx = scan_loaded(state, core.ScanResult(checkpoints=(fresh, stale), now_ns=now))
    assert [e for e in fx if isinstance(e, core.RemoveNow)] == [
        core.RemoveNow((stale.path,), "checkpoint_expired")
    ]
    assert (state.checkpoint_bytes, state.leftover_bytes) == (40, 30)
    stats = core.stats(state)
    assert (stats.checkpoint_bytes, stats.checkpoints_expired, stats.bytes) == (40, 1, 40)
    core.handle(state, core.Removed((stale.path,), (), 0.0))
    assert state.leftover_bytes == 0


def test_startup_scan_evicts_prompt_entries_for_counted_checkpoints() -> None:
    """With the cap lowered below entries plus checkpoints, the scan evicts prompt entries."""
    state = new_state(max_bytes=100)
    drive_store(state, (1, 2), nbytes=60)
    entry = state.entries[next(iter(state.entries))]
    rescan = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=100)
    files = (core.ScannedFile(entry.path, os.path.dirname(entry.path), None, entry=entry),)
    ck = core.ScannedCheckpoint(_ck_path(KEY, 8), 50, 0)
    _, fx = scan_loaded(rescan, core.ScanResult(files=files, checkpoints=(ck,), now_ns=0))
    assert core.RemoveNow((entry.path,), "over_cap") in fx
    assert (rescan.indexed_bytes, rescan.checkpoint_bytes) == (0, 50)


def test_scrubber_pick_reaps_checkpoints_past_the_age_bound() -> None:
    """In a run, the scrubber's next pick removes checkpoints older than the bound (written or
    scanned), counting them as leftovers until the worker reports them gone."""
    now_ns = 1_000 * DAY_NS
    scanned = core.ScannedCheckpoint(_ck_path("cd" * 16, 8), 30, now_ns - DAY_NS + 3600 * 10**9)
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=1000)
    core.handle(state, core.ScanLoaded(core.ScanResult(checkpoints=(scanned,), now_ns=now_ns),
                                       locked=True, now=100.0))
    assert _write(state, 50).ok  # NOTE: settled at the events' time 0.
    _, fx = core.handle(state, core.Received(env(ScrubPick()), 100.0 + 3600 * 2))
    assert [e for e in fx if isinstance(e, core.RemoveFiles)] == [
        core.RemoveFiles((scanned.path,), "checkpoint_expired")
    ]
    assert (state.checkpoint_bytes, state.leftover_bytes) == (50, 30)
    _, fx = core.handle(state, core.Received(env(ScrubPick()), DAY_NS / 1e9 + 1))
    assert core.RemoveFiles((_ck_path(KEY, 8),), "checkpoint_expired") in fx
    assert (state.checkpoint_bytes, core.stats(state).checkpoints_expired) == (0, 2)
    deliver(state, env(FilesRemoved(removed=(scanned.path, _ck_path(KEY, 8)))))
    assert state.leftover_bytes == 0
