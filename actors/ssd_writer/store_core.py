"""The store worker's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

One message at a time: a ``WriteEntry`` of the index (plan, reserve room,
remove the victims durably, temp file, one tensor at a time, commit, report,
remove what the new file superseded), a generation checkpoint (``Store``
with a checkpoint record), a checkpoint removal (``RemoveCheckpoints``), or
a removal the index decided (``RemoveEntries``). The shell
(``actors/ssd_writer/store.py``) holds the plan and the open writer,
performs each effect and feeds its outcome back as the next event; every
effect whose outcome the rules need comes last in its batch.

Rules kept here (``tests/actors/ssd_writer/test_store_core.py``):

- every write job ends with exactly one ``EntryWritten`` to the index, and
  the plan's resources are released (:class:`Release`) before it: a failed
  or crashed write never leaves the index waiting, and no MLX buffer
  outlives the job;
- no temp file is created before the victims' removal is durable (a crash
  can never leave the new file and the victims together, over the cap);
- a commit whose directory fsync failed reports its final file as a
  leftover (neither its rename nor its removal is durable);
- every removal's outcome is told to the index (``FilesRemoved``): it counts
  the files until then;
- a checkpoint write reserves its planned size with the index (which makes
  room by evicting prompt entries, or refuses it ``over_cap``), removes the
  victims durably before its file exists, and always settles its job with
  one ``EntryWritten`` (the committed path and size) before its ``Store``
  is answered; a checkpoint removal tells the index the files it removed;
- a checkpoint is planned on a delta base (``PlanCheckpoint.base``) only
  when this worker's last committed file of its key was written for the
  same request (``CheckpointRecord.writer``); a failed write or the key's
  removal forgets the base, so the next file is read back whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, assert_never

from messages import (
    EntryWritten,
    Envelope,
    RemoveCheckpoints,
    SpaceReserved,
    Store,
    StoreResult,
    WriteCommitted,
    WriteEntry,
)
from messages.ssd_writer import FilesRemoved, RemoveEntries

from .core import checkpoint_job_id

__all__ = [
    "MAX_CHECKPOINT_BASES",
    "Answer",
    "Asked",
    "Begin",
    "Begun",
    "CheckpointPlanned",
    "CheckpointWritten",
    "CheckpointsRemoved",
    "Commit",
    "Committed",
    "Count",
    "Crashed",
    "Effect",
    "Event",
    "Evict",
    "Evicted",
    "Log",
    "Plan",
    "PlanCheckpoint",
    "Planned",
    "Release",
    "Remove",
    "RemoveCheckpointFiles",
    "Removed",
    "Report",
    "Reserve",
    "Reserved",
    "Settled",
    "SourceFailed",
    "StoreState",
    "TellRemoved",
    "TensorWritten",
    "WriteCheckpoint",
    "WriteFailed",
    "WriteTensor",
    "handle",
]

MAX_CHECKPOINT_BASES = 1024
"""Delta bases remembered at most (an answer cancelled mid-way keeps its file and its entry
here until pushed out; a finished one's goes with its files)."""


@dataclass
class WriteJob:
    """The write in progress."""

    body: WriteEntry
    file_bytes: int = 0
    tensors: int = 0
    trimmable: bool = False
    min_reusable_offset: int = 0
    reported: bool = False


@dataclass
class CheckpointJob:
    """The checkpoint write in progress (``body`` is its ``Store``)."""

    body: Store
    job_id: str
    file_bytes: int = 0
    reported: bool = False
    outcome: StoreResult | None = None
    """The answer to the ``Store`` once the index has settled the job."""
    counts: tuple[Count, ...] = ()


@dataclass
class StoreState:
    """The message in progress and lifetime counters."""

    job: WriteJob | None = None
    ck: CheckpointJob | None = None
    request: Envelope | None = None
    """The message being handled (its outcome events refer to it)."""
    removing: str = ""
    """Why the removal in progress runs (``superseded``, or a ``RemoveEntries`` reason)."""
    written: int = 0
    failed: int = 0
    removed_files: int = 0
    ck_bases: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Request key -> (writer, path) of the checkpoint this worker last wrote for it: the base a
    delta of the same writer builds on (at most ``MAX_CHECKPOINT_BASES``, oldest dropped)."""


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Asked:
    """A message arrived (``request`` is its envelope)."""

    request: Envelope
    now: float


@dataclass(frozen=True, slots=True)
class Planned:
    """:class:`Plan` succeeded: the file's size, tensor count and trim facts."""

    file_bytes: int
    tensors: int
    trimmable: bool
    min_reusable_offset: int
    now: float


@dataclass(frozen=True, slots=True)
class SourceFailed:
    """The tensor source could not plan or read back the entry (a soft failure)."""

    now: float


@dataclass(frozen=True, slots=True)
class Reserved:
    """The index's answer to :class:`Reserve` (``None``: it did not answer in time)."""

    answer: SpaceReserved | None
    now: float


@dataclass(frozen=True, slots=True)
class Evicted:
    """The outcome of :class:`Evict`: ``failed`` unlinks, ``unsynced`` directory fsyncs."""

    failed: tuple[str, ...]
    unsynced: tuple[str, ...]
    now: float


@dataclass(frozen=True, slots=True)
class Begun:
    """:class:`Begin` created the temp file."""

    now: float


@dataclass(frozen=True, slots=True)
class TensorWritten:
    """:class:`WriteTensor` ``index`` was read back and written."""

    index: int
    now: float


@dataclass(frozen=True, slots=True)
class Committed:
    """:class:`Commit` made the file durable under its final name."""

    now: float


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """A file step failed: ``reason`` (``disk_full``, ``fsync_failed``, ``io_error``).

    ``fsync_dir``: the commit's directory fsync failed after the rename.
    """

    reason: str
    error: str
    now: float
    fsync_dir: bool = False


@dataclass(frozen=True, slots=True)
class Crashed:
    """Performing an effect raised something unexpected (``error``, logged by the shell)."""

    error: str
    now: float


@dataclass(frozen=True, slots=True)
class Settled:
    """The index's answer to :class:`Report` (``None``: it did not answer in time)."""

    answer: WriteCommitted | None
    now: float


@dataclass(frozen=True, slots=True)
class Removed:
    """The outcome of :class:`Remove`: ``gone`` durably, ``left`` still there or not durable."""

    gone: tuple[str, ...]
    left: tuple[str, ...]
    now: float


@dataclass(frozen=True, slots=True)
class CheckpointPlanned:
    """:class:`PlanCheckpoint` succeeded: the planned file's size."""

    file_bytes: int
    now: float


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """The outcome of :class:`WriteCheckpoint` (``reason`` when not stored)."""

    stored: bool
    now: float
    reason: str = ""
    path: str | None = None
    file_bytes: int = 0
    error: str = ""
    reused_bytes: int = 0
    """Tensor bytes a delta took from the previous file instead of the live caches (0: read whole)."""


@dataclass(frozen=True, slots=True)
class CheckpointsRemoved:
    """The outcome of :class:`RemoveCheckpointFiles`: ``count`` files, or ``error``."""

    count: int
    now: float
    error: str = ""
    paths: tuple[str, ...] = ()


Event = (
    Asked
    | Planned
    | SourceFailed
    | Reserved
    | Evicted
    | Begun
    | TensorWritten
    | Committed
    | WriteFailed
    | Crashed
    | Settled
    | Removed
    | CheckpointPlanned
    | CheckpointWritten
    | CheckpointsRemoved
)


# --- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """Plan the file of ``handle`` (one engine turn) -> Planned | SourceFailed."""

    handle: str
    namespace: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reserve:
    """Ask the index for ``file_bytes`` of room (``ReserveSpace``) -> :class:`Reserved`."""

    job_id: str
    file_bytes: int


@dataclass(frozen=True, slots=True)
class Evict:
    """Remove the victims durably before anything is written -> :class:`Evicted`."""

    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Begin:
    """Create ``directory`` and the temp file in it -> Begun | WriteFailed."""

    directory: str


@dataclass(frozen=True, slots=True)
class WriteTensor:
    """Read tensor ``index`` back (one engine turn) and write it -> TensorWritten | failure."""

    index: int


@dataclass(frozen=True, slots=True)
class Commit:
    """fsync, rename to ``path``, fsync the directory -> Committed | WriteFailed."""

    path: str


@dataclass(frozen=True, slots=True)
class Release:
    """Drop the temp file unless committed and release the plan (engine turn); never fails."""


@dataclass(frozen=True, slots=True)
class Report:
    """Ask the index to settle the job (``EntryWritten``) -> :class:`Settled`."""

    body: EntryWritten


@dataclass(frozen=True, slots=True)
class Remove:
    """Remove ``paths`` durably -> :class:`Removed`."""

    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TellRemoved:
    """Tell the index which files are gone (``FilesRemoved``)."""

    body: FilesRemoved


@dataclass(frozen=True, slots=True)
class PlanCheckpoint:
    """Plan the checkpoint in ``Store`` ``body`` and take its tensors' views (one engine turn,
    no copy) -> CheckpointPlanned | SourceFailed. ``base``: the previous file of the same
    answer, which a delta may build on (``kernels.cache._kv_delta``)."""

    body: Store
    base: str | None = None


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """Write the planned checkpoint of ``Store`` ``body`` from its views
    -> :class:`CheckpointWritten`."""

    body: Store


@dataclass(frozen=True, slots=True)
class RemoveCheckpointFiles:
    """Remove the checkpoint files of ``request_key`` -> :class:`CheckpointsRemoved`."""

    request_key: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply ``body`` to the message in progress."""

    body: StoreResult


@dataclass(frozen=True, slots=True)
class Count:
    """Add to the generation-checkpoint counters: ``written`` (with ``nbytes``, and ``reused``
    bytes when a delta), ``failed``, ``removed``, ``refused`` (one request not checkpointed for
    ``reason``)."""

    what: Literal["written", "failed", "removed", "refused"]
    n: int = 1
    nbytes: int = 0
    reason: str = ""
    reused: int = 0


@dataclass(frozen=True, slots=True)
class Log:
    """Write one line: ``event`` (``level``) with ``fields``."""

    event: str
    fields: tuple[tuple[str, object], ...] = ()
    level: Literal["info", "warning"] = "warning"


Effect = (
    Plan
    | Reserve
    | Evict
    | Begin
    | WriteTensor
    | Commit
    | Release
    | Report
    | Remove
    | TellRemoved
    | PlanCheckpoint
    | WriteCheckpoint
    | RemoveCheckpointFiles
    | Answer
    | Count
    | Log
)


# --- rules ---------------------------------------------------------------------------------


def _job(state: StoreState) -> WriteJob:
    if state.job is None or state.job.reported:
        raise ValueError("a write outcome without a write in progress")
    return state.job


def _end_job(state: StoreState, job: WriteJob, written: EntryWritten) -> list[Effect]:
    """Release the plan, then report the job to the index (its answer settles it)."""
    job.reported = True
    if written.ok:
        state.written += 1
    else:
        state.failed += 1
    return [Release(), Report(written)]


def _fail(
    state: StoreState,
    job: WriteJob,
    reason: str,
    *,
    unremoved: tuple[str, ...] = (),
    unsynced: tuple[str, ...] = (),
    leftover_path: str | None = None,
    leftover_bytes: int = 0,
) -> list[Effect]:
    body = EntryWritten(
        job_id=job.body.job_id,
        ok=False,
        reason=reason,
        unremoved=unremoved,
        unsynced=unsynced,
        leftover_path=leftover_path,
        leftover_bytes=leftover_bytes,
    )
    return _end_job(state, job, body)


def _done(state: StoreState) -> list[Effect]:
    state.job = None
    state.ck = None
    state.request = None
    state.removing = ""
    return []


def _asked(state: StoreState, event: Asked) -> list[Effect]:
    if state.request is not None:
        raise ValueError("a message while another is in progress")
    body = event.request.body
    match body:
        case WriteEntry():
            state.request = event.request
            state.job = WriteJob(body)
            return [Plan(body.handle, body.namespace, body.tokens)]
        case Store(checkpoint=checkpoint) if checkpoint is not None:
            state.request = event.request
            state.ck = CheckpointJob(body, checkpoint_job_id(body.handle))
            last = state.ck_bases.get(checkpoint.request_key)
            base = last[1] if last is not None and checkpoint.writer and last[0] == checkpoint.writer \
                else None
            return [PlanCheckpoint(body, base)]
        case RemoveCheckpoints(request_key=key):
            state.request = event.request
            state.ck_bases.pop(key, None)
            return [RemoveCheckpointFiles(key)]
        case RemoveEntries(paths=paths, reason=reason):
            state.request = event.request
            state.removing = reason or "removed"
            return [Remove(paths)]
        case _:
            raise TypeError(f"store worker has no rule for {body.kind!r}")


def _planned(state: StoreState, event: Planned) -> list[Effect]:
    job = _job(state)
    job.file_bytes, job.tensors = event.file_bytes, event.tensors
    job.trimmable, job.min_reusable_offset = event.trimmable, event.min_reusable_offset
    return [Reserve(job.body.job_id, event.file_bytes)]


def _reserved(state: StoreState, event: Reserved) -> list[Effect]:
    job = _job(state)
    answer = event.answer
    if answer is None:
        return _fail(state, job, "internal_error")
    if not answer.ok:
        return _fail(state, job, answer.reason)
    # NOTE: the victims' removal is durable before the new file exists, so
    # no crash can leave both (with more than the cap).
    return [Evict(answer.evict)]


def _evicted(state: StoreState, event: Evicted) -> list[Effect]:
    job = _job(state)
    if event.failed or event.unsynced:
        return _fail(state, job, "evict_failed", unremoved=event.failed, unsynced=event.unsynced)
    return [Begin(os.path.dirname(job.body.path))]


def _tensor_written(state: StoreState, index: int) -> list[Effect]:
    job = _job(state)
    following = index + 1
    if following < job.tensors:
        return [WriteTensor(following)]
    return [Commit(job.body.path)]


def _committed(state: StoreState) -> list[Effect]:
    job = _job(state)
    written = EntryWritten(
        job_id=job.body.job_id,
        ok=True,
        path=job.body.path,
        file_bytes=job.file_bytes,
        trimmable=job.trimmable,
        min_reusable_offset=job.min_reusable_offset,
    )
    return _end_job(state, job, written)


def _write_failed(state: StoreState, event: WriteFailed) -> list[Effect]:
    job = _job(state)
    log = Log("ssd_cache.store_failed", (("reason", event.reason), ("error", event.error)))
    if event.fsync_dir:
        # NOTE: the rename happened; the final file was unlinked again, but
        # neither is durable: the index counts it until a later directory
        # fsync makes its removal durable.
        return [log, *_fail(state, job, event.reason, leftover_path=job.body.path,
                            leftover_bytes=job.file_bytes)]
    return [log, *_fail(state, job, event.reason)]


def _crashed(state: StoreState, event: Crashed) -> list[Effect]:
    ck = state.ck
    if ck is not None and not ck.reported:
        return _ck_fail(state, ck, "internal_error", event.error)
    if ck is not None:
        return _done(state)
    job = state.job
    if job is not None and not job.reported:
        # NOTE: liveness: the index must hear of every job, or the Store it
        # answers (and the spill queue behind it) would wait for ever.
        return _fail(state, job, "internal_error")
    return _done(state)  # NOTE: after the report: the job is settled or lost with the ask.


def _settled(state: StoreState, event: Settled) -> list[Effect]:
    if state.job is None or not state.job.reported:
        raise ValueError("a settlement without a reported write")
    remove = event.answer.remove if event.answer is not None else ()
    if not remove:
        return _done(state)
    state.removing = "superseded"
    return [Remove(remove)]


def _removed(state: StoreState, event: Removed) -> list[Effect]:
    if not state.removing:
        raise ValueError("a removal outcome without a removal in progress")
    reason = state.removing
    state.removed_files += len(event.gone)
    log = (
        Log("ssd_cache.remove_failed", (("reason", reason), ("paths", list(event.left))))
        if event.left
        else Log("ssd_cache.removed", (("reason", reason), ("removed", len(event.gone))), "info")
    )
    # NOTE: the index counts these files until it hears they are gone.
    tell = TellRemoved(FilesRemoved(removed=event.gone, failed=event.left))
    return [log, tell, *_done(state)]


def _ck_job(state: StoreState) -> CheckpointJob:
    if state.ck is None or state.ck.reported:
        raise ValueError("a checkpoint outcome without a checkpoint write in progress")
    return state.ck


def _ck_end(state: StoreState, ck: CheckpointJob, written: EntryWritten,
            outcome: StoreResult, counts: tuple[Count, ...], log: Log | None) -> list[Effect]:
    """Release the plan and its views, then settle the job with the index; the Store is answered
    after."""
    ck.reported, ck.outcome, ck.counts = True, outcome, counts
    return [*([log] if log else []), Release(), Report(written)]


def _ck_fail(state: StoreState, ck: CheckpointJob, reason: str, error: str = "", *,
             unremoved: tuple[str, ...] = (), unsynced: tuple[str, ...] = ()) -> list[Effect]:
    written = EntryWritten(job_id=ck.job_id, ok=False, reason=reason, unremoved=unremoved,
                           unsynced=unsynced)
    outcome = StoreResult(handle=ck.body.handle, stored=False, reason=reason)
    if reason == "over_cap":
        # NOTE: a refusal (no room under the cap), not a failed write.
        return _ck_end(state, ck, written, outcome, (Count("refused", reason=reason),), None)
    log = Log("checkpoint.write_failed", (("reason", reason), ("error", error)))
    return _ck_end(state, ck, written, outcome, (Count("failed"),), log)


def _ck_reserved(state: StoreState, ck: CheckpointJob, event: Reserved) -> list[Effect]:
    answer = event.answer
    if answer is None:
        return _ck_fail(state, ck, "internal_error")
    if not answer.ok:
        return _ck_fail(state, ck, answer.reason)
    return [Evict(answer.evict)]


def _ck_evicted(state: StoreState, ck: CheckpointJob, event: Evicted) -> list[Effect]:
    if event.failed or event.unsynced:
        return _ck_fail(state, ck, "evict_failed", unremoved=event.failed,
                        unsynced=event.unsynced)
    return [WriteCheckpoint(ck.body)]


def _checkpoint_written(state: StoreState, event: CheckpointWritten) -> list[Effect]:
    ck = _ck_job(state)
    record = ck.body.checkpoint
    assert record is not None
    # NOTE: after a failed write the previous file may be gone or damaged: the next is whole.
    state.ck_bases.pop(record.request_key, None)
    if not event.stored or event.path is None:
        return _ck_fail(state, ck, event.reason or "io_error", event.error)
    if record.writer:
        state.ck_bases[record.request_key] = (record.writer, event.path)
        while len(state.ck_bases) > MAX_CHECKPOINT_BASES:
            del state.ck_bases[next(iter(state.ck_bases))]
    written = EntryWritten(job_id=ck.job_id, ok=True, path=event.path,
                           file_bytes=event.file_bytes)
    outcome = StoreResult(handle=ck.body.handle, stored=True, path=event.path,
                          file_bytes=event.file_bytes)
    count = Count("written", nbytes=event.file_bytes, reused=event.reused_bytes)
    return _ck_end(state, ck, written, outcome, (count,), None)


def _ck_settled(state: StoreState, ck: CheckpointJob) -> list[Effect]:
    if not ck.reported or ck.outcome is None:
        raise ValueError("a settlement without a reported checkpoint write")
    return [*ck.counts, Answer(ck.outcome), *_done(state)]


def _checkpoints_removed(state: StoreState, event: CheckpointsRemoved) -> list[Effect]:
    request = state.request
    if request is None or not isinstance(request.body, RemoveCheckpoints):
        raise ValueError("a checkpoint removal outcome without a removal")
    if event.error:
        return [Log("checkpoint.remove_failed", (("error", event.error),)), *_done(state)]
    # NOTE: the index counts the key's files toward the cap until it hears they are gone.
    tell = [TellRemoved(FilesRemoved(removed=event.paths))] if event.paths else []
    return [Count("removed", n=event.count), *tell, *_done(state)]


def handle(state: StoreState, event: Event) -> tuple[StoreState, list[Effect]]:
    """Apply one event; return the state with the effects to perform, in order.

    An outcome that does not fit the message in progress raises before
    anything changes.
    """
    effects: list[Effect]
    match event:
        case Asked():
            effects = _asked(state, event)
        case Planned():
            effects = _planned(state, event)
        case SourceFailed() if state.ck is not None:
            effects = _ck_fail(state, _ck_job(state), "source_failed")
        case SourceFailed():
            effects = _fail(state, _job(state), "source_failed")
        case Reserved() if state.ck is not None:
            effects = _ck_reserved(state, _ck_job(state), event)
        case Reserved():
            effects = _reserved(state, event)
        case Evicted() if state.ck is not None:
            effects = _ck_evicted(state, _ck_job(state), event)
        case Evicted():
            effects = _evicted(state, event)
        case Begun():
            job = _job(state)
            effects = [WriteTensor(0)] if job.tensors else [Commit(job.body.path)]
        case TensorWritten(index=index):
            effects = _tensor_written(state, index)
        case Committed():
            effects = _committed(state)
        case WriteFailed():
            effects = _write_failed(state, event)
        case Crashed():
            effects = _crashed(state, event)
        case Settled() if state.ck is not None:
            effects = _ck_settled(state, state.ck)
        case Settled():
            effects = _settled(state, event)
        case Removed():
            effects = _removed(state, event)
        case CheckpointPlanned(file_bytes=nbytes):
            ck = _ck_job(state)
            ck.file_bytes = nbytes
            effects = [Reserve(ck.job_id, nbytes)]
        case CheckpointWritten():
            effects = _checkpoint_written(state, event)
        case CheckpointsRemoved():
            effects = _checkpoints_removed(state, event)
        case _:
            assert_never(event)
    return state, effects
