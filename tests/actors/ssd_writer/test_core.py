"""The cold tier's index and rules (sans-IO core), by plain calls and against a simple model."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actors.ssd_writer import core
from messages import (
    Body,
    Covers,
    CoversResult,
    EntryMeta,
    EntryWritten,
    Envelope,
    Find,
    FindResult,
    ObservePrefill,
    ReserveSpace,
    Restore,
    RestoreReport,
    RestoreResult,
    SpaceReserved,
    SsdStats,
    SsdStatsRequest,
    Store,
    StoreResult,
    WriteCommitted,
)
from messages.spill_queue import CheckpointRecord, RemoveCheckpoints
from messages.ssd_writer import FilesRemoved, LandingReport, ScrubPick, ScrubReport, ScrubTarget

ROOT = "/cache"
FP = "fp0"
_ids = itertools.count()


def env(body: Body, correlation: str = "c") -> Envelope:
    """An envelope around ``body`` as delivered to the index."""
    return Envelope(f"m-{next(_ids)}", correlation, None, "x", "ssd_writer", 0.0, body)


def deliver(state: core.IndexState, envelope: Envelope) -> tuple[core.IndexState, list[core.Effect]]:
    """``core.handle`` of ``envelope`` received (at time 0)."""
    return core.handle(state, core.Received(envelope, 0.0))


def scan_loaded(
    state: core.IndexState, scan: core.ScanResult
) -> tuple[core.IndexState, list[core.Effect]]:
    """``core.handle`` of the start hook's scan (the directory lock held)."""
    return core.handle(state, core.ScanLoaded(scan, locked=True, now=0.0))


def new_state(max_bytes: int = 1000, *, read_only: bool = False) -> core.IndexState:
    """An empty, ready index."""
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=max_bytes, read_only=read_only)
    scan_loaded(state, core.ScanResult())
    return state


def entry(
    tokens: tuple[int, ...],
    *,
    ns: str = "",
    nbytes: int = 10,
    mtime: int = 1,
    trimmable: bool = True,
    min_offset: int = 0,
    name: str | None = None,
) -> core.IndexEntry:
    """An index entry at its canonical path."""
    directory = os.path.join(ROOT, FP, core.namespace_dir(ns))
    path = os.path.join(directory, f"{name or '-'.join(map(str, tokens)) or 'empty'}.kvt")
    return core.IndexEntry(path, ns, tokens, nbytes, mtime, trimmable, min_offset)


def loaded(*entries: core.IndexEntry, max_bytes: int = 1000) -> core.IndexState:
    """An index loaded from a scan of ``entries``."""
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=max_bytes)
    files = tuple(core.ScannedFile(e.path, os.path.dirname(e.path), None, entry=e) for e in entries)
    scan_loaded(state, core.ScanResult(files=files))
    return state


def answer(effects: list[core.Effect], request: Envelope | None = None) -> Body:
    """The one answer among ``effects`` (to ``request`` when given)."""
    bodies = [
        e.body
        for e in effects
        if isinstance(e, core.Answer) and (request is None or e.request is request)
    ]
    assert len(bodies) == 1, effects
    return bodies[0]


def find(
    state: core.IndexState, prompt: tuple[int, ...], ns: str = "", better: int = 0
) -> FindResult:
    """Ask the core for ``prompt``."""
    _, fx = deliver(state, env(Find(tokens=prompt, namespace=ns, better_than=better)))
    body = answer(fx)
    assert isinstance(body, FindResult)
    return body


def store_msg(tokens: tuple[int, ...], ns: str = "", handle: str = "h") -> Store:
    """A Store for ``tokens``."""
    meta = EntryMeta(offset=len(tokens), nbytes=1, trimmable=True, min_reusable_offset=0)
    return Store(handle=handle, namespace=ns, tokens=tokens, meta=meta, reply_to="q")


@dataclass
class Written:
    """The outcome of driving one store through the core like the store worker would."""

    result: StoreResult
    reserved: SpaceReserved | None
    remove: tuple[str, ...]


def drive_store(
    state: core.IndexState,
    tokens: tuple[int, ...],
    *,
    ns: str = "",
    nbytes: int = 10,
    trimmable: bool = True,
    min_offset: int = 0,
    fail: str = "",
    report_removed: bool = True,
) -> Written:
    """Store -> ReserveSpace -> EntryWritten (-> FilesRemoved), as the worker does.

    ``report_removed``: tell the index that the files ``WriteCommitted`` asked
    to remove are gone, as the worker does after removing them durably.
    """
    request = env(store_msg(tokens, ns))
    _, fx = deliver(state, request)
    starts = [e for e in fx if isinstance(e, core.StartWrite)]
    if not starts:
        body = answer(fx, request)
        assert isinstance(body, StoreResult)
        return Written(body, None, ())
    (start,) = starts
    assert os.path.dirname(start.path) == os.path.join(ROOT, FP, core.namespace_dir(ns))
    _, fx = deliver(state, env(ReserveSpace(job_id=start.job_id, file_bytes=nbytes)))
    reserved = answer(fx)
    assert isinstance(reserved, SpaceReserved)
    assert state.indexed_bytes + state.reserved_bytes <= (state.max_bytes or 2**63) or not reserved.ok
    path = start.path
    report = env(
        EntryWritten(
            job_id=start.job_id,
            ok=reserved.ok and not fail,
            reason=fail or reserved.reason,
            path=path if reserved.ok and not fail else None,
            file_bytes=nbytes,
            trimmable=trimmable,
            min_reusable_offset=min_offset,
        )
    )
    _, fx = deliver(state, report)
    result = answer(fx, request)
    committed = answer(fx, report)
    assert isinstance(result, StoreResult)
    assert isinstance(committed, WriteCommitted)
    if committed.remove and report_removed:
        deliver(state, env(FilesRemoved(removed=committed.remove)))
    return Written(result, reserved, committed.remove)


# --- find ------------------------------------------------------------------------------


def test_find_returns_the_longest_usable_prefix_capped_at_prompt_minus_one() -> None:
    """An entry equal to the prompt serves len - 1 tokens; the longest candidate wins."""
    state = loaded(entry((1, 2)), entry((1, 2, 3, 4)), entry((9, 9, 9)))
    got = find(state, (1, 2, 3, 4))
    assert (got.choice, got.cached_tokens, got.entry_tokens) == ("restore", 3, 4)
    assert got.path is not None
    assert got.path.endswith("1-2-3-4.kvt")


def test_find_skips_untrimmable_entries_that_would_need_a_trim() -> None:
    """An untrimmable longer entry is passed over for an exact shorter prefix."""
    state = loaded(entry((1, 2, 3, 4, 5), trimmable=False), entry((1, 2)))
    got = find(state, (1, 2, 3, 9))
    assert (got.cached_tokens, got.entry_tokens) == (2, 2)


def test_find_never_cuts_below_the_minimum_reusable_offset() -> None:
    """A trimmable entry cannot serve a prefix shorter than its minimum reusable offset."""
    state = loaded(entry((1, 2, 3, 4, 5, 6), min_offset=5))
    assert find(state, (1, 2, 3, 7)).choice == "miss"
    assert find(state, (1, 2, 3, 4, 5, 9)).cached_tokens == 5


def test_find_keeps_namespaces_apart_and_needs_more_than_better_than() -> None:
    """Another namespace never serves; a prefix not longer than the RAM hit is no candidate."""
    state = loaded(entry((1, 2, 3), ns="lora"))
    assert find(state, (1, 2, 3, 4)).choice == "miss"
    assert find(state, (1, 2, 3, 4), ns="lora").cached_tokens == 3
    assert find(state, (1, 2, 3, 4), ns="lora", better=3).choice == "miss"


def test_find_on_a_one_token_prompt_is_a_miss() -> None:
    """Nothing can be reused when only one token is to be computed."""
    assert find(loaded(entry((1,))), (1,)).choice == "miss"


def test_covers_exact_or_a_trimmable_descendant_that_may_be_cut_there() -> None:
    """Covers holds for an exact file or a trimmable descendant whose bound allows the cut."""
    state = loaded(
        entry((1, 2, 3, 4), min_offset=3),
        entry((5, 6, 7), trimmable=False),
    )

    def covered(tokens: tuple[int, ...]) -> bool:
        _, fx = deliver(state, env(Covers(tokens=tokens)))
        body = answer(fx)
        assert isinstance(body, CoversResult)
        return body.covered

    assert covered((1, 2, 3, 4))
    assert covered((1, 2, 3))
    assert not covered((1, 2))
    assert covered((5, 6, 7))
    assert not covered((5, 6))
    assert not covered(())


# --- restore-or-recompute ---------------------------------------------------------------


def test_estimator_restores_until_it_knows_both_rates_then_picks_the_faster() -> None:
    """No estimate -> restore; then restore only when reading beats prefilling the saved tokens."""
    state = loaded(entry(tuple(range(100)), nbytes=1_000_000), max_bytes=10**9)
    prompt = (*range(100), 7)
    assert find(state, prompt).choice == "restore"
    deliver(state, env(ObservePrefill(tokens=1000, seconds=1.0)))  # 1000 tok/s
    deliver(
        state,
        env(RestoreReport(path="elsewhere", ok=True, bytes=10_000_000, seconds=1.0)),
    )  # 10 MB/s
    got = find(state, prompt)  # 0.1 s to read vs 0.1 s to prefill 100 tokens: not faster
    assert got.choice == "recompute"
    assert got.predicted_restore_s is not None
    assert got.predicted_prefill_s is not None
    deliver(state, env(ObservePrefill(tokens=10, seconds=1.0)))  # prefill slows down
    assert find(state, prompt).choice == "restore"
    stats = core.stats(state)
    assert (stats.choices_restore, stats.choices_recompute) == (2, 1)


# --- store, cap, supersession -------------------------------------------------------------


def test_store_reserves_evicting_lru_and_answers_stored() -> None:
    """Room is made by evicting the oldest files before the write; the cap always holds."""
    state = loaded(entry((1,), nbytes=40, mtime=1), entry((2,), nbytes=40, mtime=2), max_bytes=100)
    w = drive_store(state, (3, 3), nbytes=50)
    assert w.reserved is not None
    assert len(w.reserved.evict) == 1
    assert w.reserved.evict[0].endswith("/1.kvt")
    assert w.result.stored
    assert w.result.evicted == 1
    assert state.indexed_bytes == 90
    assert core.stats(state).reserved_bytes == 0


def test_an_entry_larger_than_the_cap_is_not_stored_and_nothing_is_evicted() -> None:
    """too_large leaves the index untouched."""
    state = loaded(entry((1,), nbytes=40), max_bytes=100)
    w = drive_store(state, (2, 2), nbytes=101)
    assert (w.result.stored, w.result.reason) == (False, "too_large")
    assert len(state.entries) == 1
    assert core.stats(state).too_large == 1


def test_a_trimmable_descendant_supersedes_ancestors_it_can_serve() -> None:
    """Ancestors at or above the new entry's minimum reusable offset are removed; others stay."""
    state = loaded(entry((1, 2)), entry((1, 2, 3, 4)), entry((1, 9)))
    w = drive_store(state, (1, 2, 3, 4, 5, 6), min_offset=3)
    assert sorted(os.path.basename(p) for p in w.remove) == ["1-2-3-4.kvt"]
    assert w.result.superseded == 1
    assert {e.tokens for e in state.entries.values()} == {(1, 2), (1, 9), (1, 2, 3, 4, 5, 6)}


def test_an_untrimmable_entry_supersedes_nothing() -> None:
    """The prompt-boundary snapshot stays beside an untrimmable completion."""
    state = loaded(entry((1, 2)))
    w = drive_store(state, (1, 2, 3), trimmable=False)
    assert w.remove == ()
    assert len(state.entries) == 2


def test_an_exact_duplicate_already_on_disk_is_not_written_again() -> None:
    """A Store of tokens already committed answers stored (duplicate) without a write."""
    state = loaded(entry((1, 2, 3)))
    w = drive_store(state, (1, 2, 3))
    assert w.reserved is None
    assert (w.result.stored, w.result.reason) == (True, "duplicate")


def test_a_store_of_an_entry_being_written_gets_that_writes_outcome() -> None:
    """Two stores of the same tokens: one write; the second store is answered with its
    outcome (stored as a duplicate, or failed with the same reason), never a second write."""
    for ok in (True, False):
        state = new_state()
        r1, r2 = env(store_msg((4, 5), handle="a")), env(store_msg((4, 5), handle="b"))
        _, fx1 = deliver(state, r1)
        _, fx2 = deliver(state, r2)
        (start,) = [e for e in (*fx1, *fx2) if isinstance(e, core.StartWrite)]
        assert fx2 == []
        deliver(state, env(ReserveSpace(job_id=start.job_id, file_bytes=10)))
        report = env(
            EntryWritten(
                job_id=start.job_id,
                ok=ok,
                reason="" if ok else "io_error",
                path=start.path if ok else None,
                file_bytes=10,
                trimmable=True,
            )
        )
        _, fx = deliver(state, report)
        first, second = answer(fx, r1), answer(fx, r2)
        assert isinstance(first, StoreResult)
        assert isinstance(second, StoreResult)
        assert (first.handle, second.handle) == ("a", "b")
        if ok:
            assert (first.stored, first.reason) == (True, "stored")
            assert (second.stored, second.reason, second.path) == (True, "duplicate", start.path)
            assert list(state.entries) == [start.path]
        else:
            assert (first.stored, second.stored) == (False, False)
            assert second.reason == first.reason == "io_error"
            assert state.entries == {}


def test_entry_names_are_stable_digests_of_the_tokens() -> None:
    """The same tokens always get the same file name; different tokens a different one."""
    assert core.entry_name((1, 2, 3)) == core.entry_name((1, 2, 3))
    assert core.entry_name((1, 2, 3)) != core.entry_name((1, 2, 4))
    assert core.entry_name((1, 2, 3)) != core.entry_name((1, 2, 3, 0))
    assert core.entry_name((1, 2, 3)).endswith(".kvt")


def test_entry_names_match_their_golden_digests() -> None:
    """File names are the on-disk format: a rewrite must land on the name an earlier version gave (golden values)."""
    assert core.entry_name((1, 2, 3)) == "abccad42d03c940bc2b249bf5a4e1e3d.kvt"
    assert core.entry_name(tuple(range(0, 200_000, 37))) == "377a9d09070b42be8b65412aa8671c4b.kvt"
    assert core.entry_name((49151, 0, 2**40)) == "ff9119ea93a560df4d55249cc8e69210.kvt"


def test_disk_full_is_a_soft_failure_warned_once() -> None:
    """Two disk-full stores: both answered not stored, one warning, the index unchanged."""
    state = new_state()
    logs = 0
    for _ in range(2):
        request = env(store_msg((7, 7)))
        _, fx = deliver(state, request)
        (start,) = [e for e in fx if isinstance(e, core.StartWrite)]
        deliver(state, env(ReserveSpace(job_id=start.job_id, file_bytes=10)))
        _, fx = deliver(
            state, env(EntryWritten(job_id=start.job_id, ok=False, reason="disk_full"))
        )
        logs += sum(isinstance(e, core.Log) for e in fx)
        result = answer(fx, request)
        assert isinstance(result, StoreResult)
        assert (result.stored, result.reason) == (False, "disk_full")
    assert logs == 1
    stats = core.stats(state)
    assert (stats.disk_full, stats.store_failures, stats.entries, stats.reserved_bytes) == (
        2,
        2,
        0,
        0,
    )


def test_victims_that_could_not_be_unlinked_are_indexed_again() -> None:
    """An eviction unlink that failed leaves that file indexed (it is still valid and on disk)."""
    state = loaded(entry((1,), nbytes=60), max_bytes=100)
    request = env(store_msg((2, 2)))
    _, fx = deliver(state, request)
    (start,) = [e for e in fx if isinstance(e, core.StartWrite)]
    _, fx = deliver(state, env(ReserveSpace(job_id=start.job_id, file_bytes=60)))
    reserved = answer(fx)
    assert isinstance(reserved, SpaceReserved)
    assert len(reserved.evict) == 1
    deliver(
        state,
        env(
            EntryWritten(
                job_id=start.job_id, ok=False, reason="evict_failed", unremoved=reserved.evict
            )
        ),
    )
    assert list(state.entries) == list(reserved.evict)
    assert state.indexed_bytes == 60


def _counted(state: core.IndexState) -> int:
    """Bytes that count toward the cap between stores."""
    return state.indexed_bytes + state.leftover_bytes


def _reserve(state: core.IndexState, tokens: tuple[int, ...], nbytes: int) -> SpaceReserved:
    """Store -> ReserveSpace for ``tokens``; the reservation answer."""
    _, fx = deliver(state, env(store_msg(tokens)))
    (start,) = [e for e in fx if isinstance(e, core.StartWrite)]
    _, fx = deliver(state, env(ReserveSpace(job_id=start.job_id, file_bytes=nbytes)))
    reserved = answer(fx)
    assert isinstance(reserved, SpaceReserved)
    return reserved


def _job(state: core.IndexState) -> str:
    (job_id,) = state.jobs
    return job_id


def test_a_superseded_file_counts_until_its_removal_is_reported() -> None:
    """F2: A+ supersedes A; A's bytes count as a leftover until the worker reports it durably
    gone; a removal that failed keeps them counted."""
    state = loaded(entry((1, 2), nbytes=30), max_bytes=100)
    w = drive_store(state, (1, 2, 3), nbytes=40, report_removed=False)
    (old,) = w.remove
    assert (state.indexed_bytes, state.leftovers) == (40, {old: 30})
    deliver(state, env(FilesRemoved(failed=(old,))))
    assert state.leftovers == {old: 30}
    assert state.stuck == {old}
    deliver(state, env(FilesRemoved(removed=(old,))))
    assert (state.leftovers, state.leftover_bytes, state.stuck) == ({}, 0, set())
    stats = core.stats(state)
    assert (stats.leftover_files, stats.leftover_bytes) == (0, 0)


def test_leftovers_are_the_first_victims_and_stuck_ones_the_last() -> None:
    """Room comes from leftovers first (they serve nothing), then LRU entries, then leftovers
    whose removal already failed once."""
    free, stuck = "/cache/fp0/x/free.kvt", "/cache/fp0/x/stuck.kvt"
    state = loaded(entry((1,), nbytes=20, mtime=1), entry((2,), nbytes=20, mtime=2), max_bytes=100)
    _reserve(state, (9,), 10)
    deliver(state, env(EntryWritten(job_id=_job(state), ok=False, reason="fsync_failed",
                                        leftover_path=free, leftover_bytes=20)))  # fmt: skip
    _reserve(state, (8,), 10)
    deliver(state, env(EntryWritten(job_id=_job(state), ok=False, reason="fsync_failed",
                                        leftover_path=stuck, leftover_bytes=20)))  # fmt: skip
    deliver(state, env(FilesRemoved(failed=(stuck,))))
    assert (state.leftover_bytes, state.stuck) == (40, {stuck})
    reserved = _reserve(state, (3,), 60)
    assert reserved.evict == (free, entry((1,)).path)
    assert _counted(state) + state.reserved_bytes == 100
    job_id = _job(state)
    deliver(state, env(EntryWritten(job_id=job_id, ok=True, path=state.path_of("", (3,)),
                                        file_bytes=60, trimmable=True)))  # fmt: skip
    assert state.leftovers == {stuck: 20}
    reserved = _reserve(state, (4,), 90)
    assert reserved.evict == (entry((2,)).path, state.path_of("", (3,)), stuck)


def test_unsynced_victims_stay_counted_and_the_store_fails() -> None:
    """Victims unlinked whose directory fsync failed may come back: they stay counted (tried
    last from now on), the store fails, nothing is indexed for them."""
    state = loaded(entry((1,), nbytes=60), max_bytes=100)
    reserved = _reserve(state, (2,), 60)
    job_id = _job(state)
    deliver(state, env(EntryWritten(job_id=job_id, ok=False, reason="evict_failed",
                                        unsynced=reserved.evict)))  # fmt: skip
    assert state.entries == {}
    assert state.leftovers == {entry((1,)).path: 60}
    assert state.stuck == {entry((1,)).path}


def test_a_failed_commits_final_file_counts_until_a_store_renames_over_it() -> None:
    """F3: the final file of a commit whose directory fsync failed is a leftover (it may come
    back after a crash); a later commit of the same tokens renames over it durably."""
    state = new_state(100)
    _reserve(state, (5,), 40)
    path = state.path_of("", (5,))
    deliver(state, env(EntryWritten(job_id=_job(state), ok=False, reason="fsync_failed",
                                        leftover_path=path, leftover_bytes=40)))  # fmt: skip
    assert (state.leftovers, state.stuck) == ({path: 40}, set())
    reserved = _reserve(state, (6,), 70)
    assert reserved.evict == (path,)  # NOTE: the first victim: its unlink is only synced.
    deliver(state, env(EntryWritten(job_id=_job(state), ok=False, reason="io_error")))
    assert state.leftovers == {}
    _reserve(state, (5,), 40)
    deliver(state, env(EntryWritten(job_id=_job(state), ok=False, reason="fsync_failed",
                                        leftover_path=path, leftover_bytes=40)))  # fmt: skip
    w = drive_store(state, (5,), nbytes=40)
    assert w.result.stored
    assert (state.leftovers, state.indexed_bytes) == ({}, 40)


def test_abandoned_job_answers_the_store_and_restores_victims() -> None:
    """A job the store worker never got is answered as failed, its victims indexed again."""
    state = new_state()
    request = env(store_msg((3,)))
    _, fx = deliver(state, request)
    (start,) = [e for e in fx if isinstance(e, core.StartWrite)]
    _, fx = core.handle(state, core.WorkerGone(start.job_id, "writer_unavailable", 0.0))
    result = answer(fx, request)
    assert isinstance(result, StoreResult)
    assert (result.stored, result.reason) == (False, "writer_unavailable")
    assert state.jobs == {}


def test_read_only_tiers_refuse_stores_and_uncapped_ones_write() -> None:
    """read_only (another server owns the directory) never starts a write; max_bytes 0 (no cap) does."""
    assert drive_store(new_state(read_only=True), (1, 2)).result.reason == "read_only"
    assert drive_store(new_state(max_bytes=0), (1, 2), nbytes=10**15).result.stored


# --- restore --------------------------------------------------------------------------------


def test_restore_of_an_unindexed_path_is_gone_and_an_indexed_one_goes_to_the_reader() -> None:
    """Restore answers gone at once, or hands the entry's facts to the reader."""
    e = entry((1, 2, 3))
    state = loaded(e)
    request = env(Restore(path="/nope", reply_to="r"))
    _, fx = deliver(state, request)
    body = answer(fx, request)
    assert isinstance(body, RestoreResult)
    assert (body.ok, body.reason) == (False, "gone")
    request = env(Restore(path=e.path, reply_to="r"))
    _, fx = deliver(state, request)
    assert fx == [core.StartRead(request, e.path, "", (1, 2, 3))]


def test_restore_reports_update_lru_time_and_remove_corrupt_files() -> None:
    """A good read makes the entry most recently used; a corrupt one drops it and counts."""
    a, b = entry((1,), mtime=1), entry((2,), mtime=2)
    state = loaded(a, b)
    deliver(
        state, env(RestoreReport(path=a.path, ok=True, bytes=10, seconds=0.5, touched=True))
    )
    assert state.entries[a.path].last_used > state.entries[b.path].last_used
    deliver(state, env(RestoreReport(path=b.path, ok=False, reason="corrupt", removed=True)))
    assert list(state.entries) == [a.path]
    _, fx = deliver(state, env(SsdStatsRequest(reply_to="s")))
    stats = answer(fx)
    assert isinstance(stats, SsdStats)
    assert (stats.restores, stats.restore_failures, stats.corrupt_removed) == (1, 1, 1)
    assert stats.restore_ms_last == 500.0


# --- scrub ---------------------------------------------------------------------------------


def test_scrub_picks_every_file_in_turn_and_a_bad_one_leaves_the_index() -> None:
    """The scrubber is offered each indexed file once per round (path order, whatever the LRU
    order); a corrupt report drops the file from the index and counts it, an OK one counts its
    bytes; a read-only index offers nothing."""
    a, b, c = entry((1,), mtime=3), entry((2,), mtime=1), entry((3,), mtime=2)
    state = loaded(a, b, c)
    picks = []
    for _ in range(4):
        _, fx = deliver(state, env(ScrubPick(reply_to="s")))
        target = answer(fx)
        assert isinstance(target, ScrubTarget)
        picks.append(target.path)
    assert picks == [a.path, b.path, c.path, a.path]
    deliver(state, env(ScrubReport(path=b.path, ok=False, reason="corrupt", removed=True)))
    deliver(state, env(ScrubReport(path=c.path, ok=True, bytes=64)))
    assert sorted(state.entries) == sorted([a.path, c.path])
    stats = core.stats(state)
    assert (stats.scrubbed, stats.scrubbed_bytes, stats.scrub_corrupt, stats.corrupt_removed) == (
        2,
        64,
        1,
        1,
    )
    read_only = loaded(entry((4,)))
    read_only.read_only = True
    _, fx = deliver(read_only, env(ScrubPick(reply_to="s")))
    assert answer(fx) == ScrubTarget(read_only=True)


# --- startup scan -------------------------------------------------------------------------


def test_scan_removes_corrupt_mismatched_orphans_duplicates_and_over_cap() -> None:
    """Every bad or redundant file is removed and counted; foreign dirs only counted."""
    good = entry((1, 2), nbytes=30, mtime=5)
    older_dup = entry((1, 2), nbytes=30, mtime=1, name="dup")
    lru = entry((3,), nbytes=30, mtime=2)
    newest = entry((4,), nbytes=30, mtime=9)
    wrong_dir = core.ScannedFile(
        "/cache/fp0/0000/x.kvt", "/cache/fp0/0000", None, entry=entry((5,), ns="lora")
    )
    files = (
        *(
            core.ScannedFile(e.path, os.path.dirname(e.path), None, entry=e)
            for e in (good, older_dup, lru, newest)
        ),
        core.ScannedFile("/cache/fp0/d/bad.kvt", "/cache/fp0/d", "corrupt", "bad magic"),
        core.ScannedFile(
            "/cache/fp0/d/other.kvt", "/cache/fp0/d", "incompatible", "fingerprint differs"
        ),
        wrong_dir,
    )
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=60)
    _, fx = scan_loaded(
        state, core.ScanResult(files=files, orphans=("/cache/fp0/d/t.kvt.tmp",), foreign_dirs=2)
    )
    removed = {e.reason: set(e.paths) for e in fx if isinstance(e, core.RemoveNow)}
    assert removed == {
        "corrupt": {"/cache/fp0/d/bad.kvt", "/cache/fp0/d/other.kvt", "/cache/fp0/0000/x.kvt"},
        "orphan": {"/cache/fp0/d/t.kvt.tmp"},
        "duplicate": {older_dup.path},
        "over_cap": {lru.path},
    }
    assert set(state.entries) == {good.path, newest.path}
    stats = core.stats(state)
    assert (stats.corrupt_removed, stats.orphans_reaped, stats.foreign_dirs) == (3, 1, 2)
    assert stats.ready


def test_a_read_only_scan_removes_nothing() -> None:
    """A second server on the directory indexes valid files and deletes nothing."""
    good = entry((1, 2))
    files = (
        core.ScannedFile(good.path, os.path.dirname(good.path), None, entry=good),
        core.ScannedFile("/cache/fp0/d/bad.kvt", "/cache/fp0/d", "corrupt", "bad magic"),
    )
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=1, read_only=True)
    _, fx = scan_loaded(state, core.ScanResult(files=files, orphans=("/x.kvt.tmp",)))
    assert fx == []
    assert list(state.entries) == [good.path]


def test_scan_counts_a_file_it_could_not_read_and_evicts_it_first_over_the_cap() -> None:
    """F1: an unreadable file is kept and counted as a leftover; over the cap (lowered) it is
    the first to go; every removal counts until reported gone."""
    good = entry((1, 2), nbytes=30, mtime=5)
    older = entry((3,), nbytes=30, mtime=1)
    unreadable = core.ScannedFile(
        "/cache/fp0/d/eio.kvt", "/cache/fp0/d", "unreadable", "EIO", file_bytes=25
    )
    files = (
        *(core.ScannedFile(e.path, os.path.dirname(e.path), None, entry=e) for e in (good, older)),
        unreadable,
    )
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=100)
    _, fx = scan_loaded(state, core.ScanResult(files=files))
    assert fx == []
    assert (state.indexed_bytes, state.leftovers) == (60, {unreadable.path: 25})
    lowered = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=40)
    _, fx = scan_loaded(lowered, core.ScanResult(files=files))
    assert fx == [core.RemoveNow((unreadable.path, older.path), "over_cap")]
    assert list(lowered.entries) == [good.path]
    assert lowered.leftovers == {unreadable.path: 25, older.path: 30}
    deliver(lowered, env(FilesRemoved(removed=(unreadable.path, older.path))))
    assert (lowered.leftover_bytes, _counted(lowered)) == (0, 30)


def test_an_incomplete_scan_makes_the_tier_read_only() -> None:
    """A directory the scan could not list may hold files the index cannot count: the tier
    stores and removes nothing in this run, and says so once."""
    good = entry((1, 2))
    bad = core.ScannedFile("/cache/fp0/d/bad.kvt", "/cache/fp0/d", "corrupt", "bad magic")
    scanned = core.ScannedFile(good.path, os.path.dirname(good.path), None, entry=good)
    state = core.IndexState(root=ROOT, fingerprint=FP, max_bytes=100)
    _, fx = scan_loaded(state, core.ScanResult(files=(scanned, bad), incomplete=True))
    assert [type(e) for e in fx] == [core.Log]
    assert state.read_only
    assert list(state.entries) == [good.path]
    assert drive_store(state, (7, 7)).result.reason == "read_only"


def test_a_corrupt_file_that_could_not_be_removed_stays_counted() -> None:
    """The scrubber or the reader drops a corrupt file from the index; when its removal was
    not durable it keeps counting toward the cap (and is tried last as a victim)."""
    a, b, c = entry((1,), nbytes=10), entry((2,), nbytes=20), entry((3,), nbytes=30)
    state = loaded(a, b, c)
    deliver(state, env(ScrubReport(path=a.path, ok=False, reason="corrupt", removed=False)))
    deliver(state, env(RestoreReport(path=b.path, ok=False, reason="corrupt", removed=False)))
    deliver(state, env(ScrubReport(path=c.path, ok=False, reason="corrupt", removed=True)))
    assert state.entries == {}
    assert state.leftovers == {a.path: 10, b.path: 20}
    assert state.stuck == {a.path, b.path}
    stats = core.stats(state)
    assert (stats.leftover_files, stats.leftover_bytes, stats.corrupt_removed) == (2, 30, 1)


# --- the rules against a simple model ----------------------------------------------------


@dataclass
class RefFile:
    """The model's view of one file on disk."""

    ns: str
    tokens: tuple[int, ...]
    nbytes: int
    mtime: int
    trimmable: bool
    min_offset: int


def ref_usable(f: RefFile, prompt: tuple[int, ...]) -> int:
    """The longest k <= len(prompt) - 1 that ``f`` can serve, by trying every k."""
    best = 0
    for k in range(1, len(prompt)):
        if f.tokens[:k] != prompt[:k]:
            break
        if k == len(f.tokens) or (f.trimmable and k >= f.min_offset):
            best = k
    return best


tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(tuple)
ns_st = st.sampled_from(["", "lora"])
CAP = 100


class IndexMachine(RuleBasedStateMachine):
    """Stores and finds on the core and on a brute-force model; they must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.state = new_state(CAP)
        self.files: list[RefFile] = []
        self.clock = 0

    @rule(
        tokens=tokens_st,
        ns=ns_st,
        nbytes=st.integers(1, 120),
        trimmable=st.booleans(),
        min_offset=st.integers(0, 5),
    )
    def store(
        self, tokens: tuple[int, ...], ns: str, nbytes: int, trimmable: bool, min_offset: int
    ) -> None:
        """Store through the core; apply the documented rules to the model."""
        min_offset = min(min_offset, len(tokens))
        self.clock += 1
        w = drive_store(
            self.state,
            tokens,
            ns=ns,
            nbytes=nbytes,
            trimmable=trimmable,
            min_offset=min_offset,
        )
        if any(f.ns == ns and f.tokens == tokens for f in self.files):
            assert w.result.reason == "duplicate"
            return
        if nbytes > CAP:
            assert w.result.reason == "too_large"
            return
        assert w.result.stored
        lru = sorted(self.files, key=lambda f: f.mtime)
        while sum(f.nbytes for f in self.files) + nbytes > CAP:
            self.files.remove(lru.pop(0))
        if trimmable:
            self.files = [
                f
                for f in self.files
                if not (
                    f.ns == ns
                    and len(f.tokens) < len(tokens)
                    and min_offset <= len(f.tokens)
                    and tokens[: len(f.tokens)] == f.tokens
                )
            ]
        self.files.append(RefFile(ns, tokens, nbytes, self.clock, trimmable, min_offset))

    @rule(prompt=tokens_st, ns=ns_st)
    def find(self, prompt: tuple[int, ...], ns: str) -> None:
        """Find agrees with the brute-force best (longest, then smallest, then newest)."""
        got = find(self.state, prompt, ns)
        scored = [(ref_usable(f, prompt), -f.nbytes, f.mtime, f) for f in self.files if f.ns == ns]
        scored = [s for s in scored if s[0] > 0]
        if not scored:
            assert got.choice == "miss"
            return
        best = max(scored, key=lambda s: s[:3])
        assert (got.cached_tokens, got.entry_tokens) == (best[0], len(best[3].tokens))

    @invariant()
    def index_matches_model_and_cap(self) -> None:
        """Same files, bytes within the cap, nothing reserved between stores."""
        have = sorted((e.namespace, e.tokens) for e in self.state.entries.values())
        assert have == sorted((f.ns, f.tokens) for f in self.files)
        assert self.state.indexed_bytes == sum(f.nbytes for f in self.files) <= CAP
        assert self.state.reserved_bytes == 0
        assert (self.state.leftovers, self.state.leftover_bytes) == ({}, 0)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_read_the_reader_never_got_is_answered_unavailable_and_counted() -> None:
    """ReaderGone: the Restore is answered reader_unavailable (a miss) and counted failed."""
    a = entry((1, 2, 3))
    state = loaded(a)
    request = env(Restore(path=a.path, ticket="t", reply_to="asker"))
    _, fx = deliver(state, request)
    (start,) = fx
    assert isinstance(start, core.StartRead)
    assert not start.read_only
    _, fx = core.handle(state, core.ReaderGone(request, a.path, 0.0))
    assert answer(fx, request) == RestoreResult(ok=False, path=a.path, reason="reader_unavailable",
                                                ticket="t")
    assert state.restore_failures == 1


def test_a_removal_the_store_worker_could_not_take_stays_counted_and_is_tried_last() -> None:
    """A corrupt landing's RemoveFiles not delivered comes back as Removed(failed): the file
    keeps counting toward the cap as a stuck leftover until a later removal succeeds."""
    a = entry((1, 2, 3), nbytes=30)
    state = loaded(a)
    _, fx = deliver(state, env(LandingReport(path=a.path, nbytes=30, ok=False, corrupt=True)))
    assert [e for e in fx if isinstance(e, core.RemoveFiles)] == [
        core.RemoveFiles((a.path,), "corrupt")
    ]
    core.handle(state, core.Removed((), (a.path,), 0.0))
    assert (state.leftovers, state.stuck) == ({a.path: 30}, {a.path})
    core.handle(state, core.Removed((a.path,), (), 0.0))
    assert (state.leftovers, state.leftover_bytes) == ({}, 0)


def test_checkpoint_work_goes_to_the_store_worker_unless_the_tier_writes_nothing() -> None:
    """A checkpoint Store or RemoveCheckpoints is forwarded; a read-only tier refuses the Store
    (read_only) and drops the removal."""
    key = "0" * 32
    record = CheckpointRecord(request_key=key, prompt_len=2, pending_token=5, sample_index=1)
    ckpt = Store(handle="h", tokens=(1, 2), meta=EntryMeta(offset=2, nbytes=8, trimmable=True, min_reusable_offset=0),
                 checkpoint=record)
    request = env(ckpt)
    assert deliver(new_state(), request)[1] == [core.ForwardCheckpoint(request, "checkpoint:h")]
    removal = env(RemoveCheckpoints(request_key=key))
    assert deliver(new_state(), removal)[1] == [core.ForwardCheckpoint(removal)]
    assert deliver(new_state(read_only=True), request)[1] == [
        core.RefuseCheckpoint(request, "read_only")
    ]
    assert deliver(new_state(read_only=True), removal)[1] == []


def test_index_changes_are_reported_after_the_events_effects() -> None:
    """With KV events on, the changes an event made leave as one ReportTier, last."""
    state = new_state()
    state.report_tier = True
    w = drive_store(state, (1, 2))
    assert w.result.stored
    a = entry((1, 2))
    _, fx = deliver(state, env(LandingReport(path=state.path_of("", (1, 2)), nbytes=10, ok=False,
                                             corrupt=True)))
    assert isinstance(fx[-1], core.ReportTier)
    assert [c.op for c in fx[-1].body.changes] == ["removed"]
    assert a.tokens == fx[-1].body.changes[0].tokens
