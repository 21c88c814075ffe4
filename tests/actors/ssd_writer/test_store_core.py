"""The store worker's rules (``actors.ssd_writer.store_core``) by plain calls and a property."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.ssd_writer import store_core as core
from messages import (
    EntryMeta,
    EntryWritten,
    Envelope,
    SpaceReserved,
    Store,
    StoreResult,
    WriteCommitted,
    WriteEntry,
)
from messages.spill_queue import CheckpointRecord, RemoveCheckpoints
from messages.ssd_writer import FilesRemoved, RemoveEntries

PATH = "/c/fp/ns/a.kvt"


def _asked(body: object = None) -> core.StoreState:
    state = core.StoreState()
    body = body if body is not None else WriteEntry(
        job_id="j1", handle="h", namespace="", tokens=(1, 2), path=PATH
    )
    request = Envelope("m", "c", None, "ssd_writer", "ssd_writer.store", 0.0, body)  # type: ignore[arg-type]
    core.handle(state, core.Asked(request, 0.0))
    return state


def _reports(effects: list[core.Effect]) -> list[EntryWritten]:
    return [e.body for e in effects if isinstance(e, core.Report)]


def test_a_write_runs_plan_reserve_evict_tensors_commit_then_reports_and_removes() -> None:
    """The happy path in order: the victims go before the temp file exists, every tensor is
    written, the plan is released before the report, superseded files are removed and told."""
    state = _asked()
    assert core.handle(state, core.Planned(300, 2, True, 0, 0.0))[1] == [core.Reserve("j1", 300)]
    answer = SpaceReserved(ok=True, evict=("/c/fp/ns/old.kvt",))
    assert core.handle(state, core.Reserved(answer, 0.0))[1] == [core.Evict(answer.evict)]
    assert core.handle(state, core.Evicted((), (), 0.0))[1] == [core.Begin("/c/fp/ns")]
    assert core.handle(state, core.Begun(0.0))[1] == [core.WriteTensor(0)]
    assert core.handle(state, core.TensorWritten(0, 0.0))[1] == [core.WriteTensor(1)]
    assert core.handle(state, core.TensorWritten(1, 0.0))[1] == [core.Commit(PATH)]
    _, fx = core.handle(state, core.Committed(0.0))
    assert fx == [core.Release(), core.Report(EntryWritten(
        job_id="j1", ok=True, path=PATH, file_bytes=300, trimmable=True, min_reusable_offset=0))]
    _, fx = core.handle(state, core.Settled(WriteCommitted(remove=("/c/fp/ns/b.kvt",)), 0.0))
    assert fx == [core.Remove(("/c/fp/ns/b.kvt",))]
    _, fx = core.handle(state, core.Removed(("/c/fp/ns/b.kvt",), (), 0.0))
    assert core.TellRemoved(FilesRemoved(removed=("/c/fp/ns/b.kvt",))) in fx
    assert (state.job, state.request) == (None, None)


def test_a_victim_that_stays_fails_the_write_before_any_file_is_made() -> None:
    """An eviction that did not become durable ends the job: no Begin, a report naming them."""
    state = _asked()
    core.handle(state, core.Planned(300, 2, True, 0, 0.0))
    core.handle(state, core.Reserved(SpaceReserved(ok=True, evict=("/v",)), 0.0))
    _, fx = core.handle(state, core.Evicted((), ("/v",), 0.0))
    assert not any(isinstance(e, core.Begin) for e in fx)
    assert _reports(fx) == [EntryWritten(job_id="j1", ok=False, reason="evict_failed",
                                         unsynced=("/v",))]


def test_a_commit_whose_directory_fsync_failed_reports_its_file_as_a_leftover() -> None:
    """The renamed file may come back after a crash: the report counts it."""
    state = _asked()
    core.handle(state, core.Planned(300, 1, True, 0, 0.0))
    core.handle(state, core.Reserved(SpaceReserved(ok=True), 0.0))
    core.handle(state, core.Evicted((), (), 0.0))
    core.handle(state, core.Begun(0.0))
    core.handle(state, core.TensorWritten(0, 0.0))
    _, fx = core.handle(state, core.WriteFailed("fsync_failed", "EIO", 0.0, fsync_dir=True))
    assert _reports(fx) == [EntryWritten(job_id="j1", ok=False, reason="fsync_failed",
                                         leftover_path=PATH, leftover_bytes=300)]


def test_a_removal_the_index_asked_for_is_told_back() -> None:
    """RemoveEntries: remove, then FilesRemoved with what stayed."""
    state = _asked(RemoveEntries(paths=("/x", "/y"), reason="corrupt"))
    _, fx = core.handle(state, core.Removed(("/x",), ("/y",), 0.0))
    assert core.TellRemoved(FilesRemoved(removed=("/x",), failed=("/y",))) in fx


outcomes = st.one_of(
    st.builds(core.Planned, st.integers(1, 500), st.integers(0, 3), st.booleans(),
              st.just(0), st.just(0.0)),
    st.builds(core.SourceFailed, st.just(0.0)),
    st.builds(core.Reserved, st.sampled_from([None, SpaceReserved(ok=False, reason="no_room"),
                                               SpaceReserved(ok=True, evict=("/v",))]),
              st.just(0.0)),
    st.builds(core.Evicted, st.sampled_from([(), ("/v",)]), st.just(()), st.just(0.0)),
    st.builds(core.Begun, st.just(0.0)),
    st.builds(core.TensorWritten, st.integers(0, 3), st.just(0.0)),
    st.builds(core.Committed, st.just(0.0)),
    st.builds(core.WriteFailed, st.just("io_error"), st.just("x"), st.just(0.0), st.booleans()),
    st.builds(core.Crashed, st.just("Boom"), st.just(0.0)),
    st.builds(core.Settled, st.sampled_from([None, WriteCommitted(),
                                              WriteCommitted(remove=("/s",))]), st.just(0.0)),
    st.builds(core.Removed, st.just(("/s",)), st.just(()), st.just(0.0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(outcomes, max_size=25))
def test_every_write_reports_once_after_releasing_its_plan(seq: list[core.Event]) -> None:
    """Whatever outcomes arrive (those that do not fit are refused before any change), a write
    job reports to the index at most once, always right after releasing its plan, and never
    creates its file before its victims' removal was found durable."""
    state = _asked()
    every: list[core.Effect] = []
    evicted_ok = False
    for event in seq:
        before = (state.job, state.request, state.removing)
        try:
            _, fx = core.handle(state, event)
        except (ValueError, TypeError):
            assert (state.job, state.request, state.removing) == before
            continue
        if isinstance(event, core.Evicted) and not event.failed:
            evicted_ok = True
        if any(isinstance(e, core.Begin) for e in fx):
            assert evicted_ok
        for i, effect in enumerate(fx):
            if isinstance(effect, core.Report):
                assert i > 0
                assert isinstance(fx[i - 1], core.Release)
        every.extend(fx)
    assert len(_reports(every)) <= 1


def _checkpoint_store() -> Store:
    record = CheckpointRecord(request_key="ab" * 16, prompt_len=2, pending_token=5, sample_index=8)
    meta = EntryMeta(offset=3, nbytes=1, trimmable=True, min_reusable_offset=0)
    return Store(handle="ck", tokens=(1, 2, 3), meta=meta, checkpoint=record)


def test_a_checkpoint_reserves_evicts_writes_then_settles_before_its_answer() -> None:
    """Plan, reserve the planned size, evict durably, write, report to the index, then answer."""
    body = _checkpoint_store()
    state = _asked(body)
    _, fx = core.handle(state, core.CheckpointPlanned(500, 0.0))
    assert fx == [core.Reserve("checkpoint:ck", 500)]
    answer = SpaceReserved(ok=True, evict=("/v.kvt",))
    assert core.handle(state, core.Reserved(answer, 0.0))[1] == [core.Evict(("/v.kvt",))]
    assert core.handle(state, core.Evicted((), (), 0.0))[1] == [core.WriteCheckpoint(body)]
    _, fx = core.handle(state, core.CheckpointWritten(True, 0.0, path="/k-8.kvc", file_bytes=500))
    assert fx == [core.Release(), core.Report(EntryWritten(
        job_id="checkpoint:ck", ok=True, path="/k-8.kvc", file_bytes=500))]
    _, fx = core.handle(state, core.Settled(WriteCommitted(), 0.0))
    assert fx == [core.Count("written", nbytes=500),
                  core.Answer(StoreResult(handle="ck", stored=True, path="/k-8.kvc",
                                          file_bytes=500))]
    assert (state.ck, state.request) == (None, None)


def test_a_checkpoint_refused_over_cap_is_counted_refused_and_answered_not_stored() -> None:
    """An over_cap reservation writes nothing: the job is settled, counted refused, not failed."""
    state = _asked(_checkpoint_store())
    core.handle(state, core.CheckpointPlanned(500, 0.0))
    _, fx = core.handle(state, core.Reserved(SpaceReserved(ok=False, reason="over_cap"), 0.0))
    assert not any(isinstance(e, (core.Evict, core.WriteCheckpoint)) for e in fx)
    assert _reports(fx) == [EntryWritten(job_id="checkpoint:ck", ok=False, reason="over_cap")]
    _, fx = core.handle(state, core.Settled(WriteCommitted(), 0.0))
    assert fx == [core.Count("refused", reason="over_cap"),
                  core.Answer(StoreResult(handle="ck", stored=False, reason="over_cap"))]


def test_a_checkpoint_removal_tells_the_index_which_files_went() -> None:
    """RemoveCheckpoints: the removed paths reach the index (FilesRemoved), which uncounts them."""
    state = _asked(RemoveCheckpoints(request_key="ab" * 16))
    _, fx = core.handle(state, core.CheckpointsRemoved(1, 0.0, paths=("/k-8.kvc",)))
    assert core.TellRemoved(FilesRemoved(removed=("/k-8.kvc",))) in fx
    assert core.Count("removed", n=1) in fx


def _ask(state: core.StoreState, body: object) -> list[core.Effect]:
    request = Envelope("m", "c", None, "ssd_writer", "ssd_writer.store", 0.0, body)  # type: ignore[arg-type]
    return core.handle(state, core.Asked(request, 0.0))[1]


def _ck(writer: str, index: int, key: str = "ab" * 16) -> Store:
    record = CheckpointRecord(request_key=key, prompt_len=2, pending_token=5, sample_index=index,
                              writer=writer)
    meta = EntryMeta(offset=2 + index, nbytes=1, trimmable=True, min_reusable_offset=0)
    return Store(handle=f"ck-{index}", tokens=tuple(range(2 + index)), meta=meta, checkpoint=record)


def _finish(state: core.StoreState, written: core.CheckpointWritten) -> list[core.Effect]:
    core.handle(state, core.CheckpointPlanned(500, 0.0))
    core.handle(state, core.Reserved(SpaceReserved(ok=True), 0.0))
    core.handle(state, core.Evicted((), (), 0.0))
    core.handle(state, written)
    return core.handle(state, core.Settled(WriteCommitted(), 0.0))[1]


def test_a_checkpoint_builds_on_the_file_its_request_wrote_last() -> None:
    """The next checkpoint of a request is planned on the file this worker last wrote for its key;
    another request of the same key, a failed write, a completion's removal or no writer plans
    none; a delta's reused bytes are counted with the write."""
    state = core.StoreState()
    first = _ck("req-1", 8)
    assert _ask(state, first) == [core.PlanCheckpoint(first, None)]
    _finish(state, core.CheckpointWritten(True, 0.0, path="/k-8.kvc", file_bytes=500))
    second = _ck("req-1", 16)
    assert _ask(state, second) == [core.PlanCheckpoint(second, "/k-8.kvc")]
    fx = _finish(state, core.CheckpointWritten(True, 0.0, path="/k-16.kvc", file_bytes=900,
                                               reused_bytes=400))
    assert core.Count("written", nbytes=900, reused=400) in fx
    other = _ck("req-2", 24)
    assert _ask(state, other) == [core.PlanCheckpoint(other, None)]
    _finish(state, core.CheckpointWritten(False, 0.0, reason="io_error"))
    after_failure = _ck("req-2", 32)
    assert _ask(state, after_failure) == [core.PlanCheckpoint(after_failure, None)]
    _finish(state, core.CheckpointWritten(True, 0.0, path="/k-32.kvc", file_bytes=500))
    _ask(state, RemoveCheckpoints(request_key="ab" * 16))
    core.handle(state, core.CheckpointsRemoved(1, 0.0, paths=("/k-32.kvc",)))
    again = _ck("req-2", 40)
    assert _ask(state, again) == [core.PlanCheckpoint(again, None)]
    _finish(state, core.CheckpointWritten(True, 0.0, path="/k-40.kvc", file_bytes=500))
    anonymous = _ck("", 48)
    assert _ask(state, anonymous) == [core.PlanCheckpoint(anonymous, None)]


def test_the_bases_remembered_are_bounded() -> None:
    """Past MAX_CHECKPOINT_BASES keys (answers cancelled mid-way keep their files), the oldest
    key's base is forgotten first."""
    state = core.StoreState()
    keys = [f"{i:032x}" for i in range(core.MAX_CHECKPOINT_BASES + 1)]
    for key in keys:
        _ask(state, _ck("r", 8, key))
        _finish(state, core.CheckpointWritten(True, 0.0, path=f"/{key}-8.kvc", file_bytes=1))
    assert len(state.ck_bases) == core.MAX_CHECKPOINT_BASES
    assert keys[0] not in state.ck_bases
    assert keys[-1] in state.ck_bases
