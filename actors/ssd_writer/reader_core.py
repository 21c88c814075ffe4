"""The reader's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

One read per ``ReadEntry``: open the file (header checked against the
index's facts), stage it open under a new ``staging_id``, answer the
``Restore`` asker, pass over the tensors, report to the index. The shell
(``actors/ssd_writer/reader.py``) holds the open file, performs each effect
and feeds its outcome back as the next event; every effect whose outcome
the rules need (:class:`Open`, :class:`Stage`, :class:`Offer`,
:class:`Pass`, :class:`RemoveBad`) comes last in its batch.

Rules kept here (``tests/actors/ssd_writer/test_reader_core.py``):

- every read ends with exactly one ``RestoreReport`` to the index, and the
  asker gets exactly one answer (none after it was offered the file);
- a corrupt or mismatched file is removed durably unless the index said
  the tier is read-only, and reported with whether it was;
- an entry staged for an asker who left, or whose pass failed, is dropped
  from the staging (its file closed), so it never waits for a landing;
- only a pass that read the file teaches the index a read speed: its
  ``seconds`` run from the ``ReadEntry`` to the end of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, assert_never

from messages import Envelope, ReadEntry, RestoreReport, RestoreResult

__all__ = [
    "Abandon",
    "Answer",
    "BadRemoved",
    "Delivered",
    "Discard",
    "Effect",
    "Event",
    "Log",
    "Offer",
    "Open",
    "OpenFailed",
    "Opened",
    "Pass",
    "Passed",
    "ReadAsked",
    "ReaderState",
    "RemoveBad",
    "Report",
    "Stage",
    "Staged",
    "handle",
]


@dataclass
class ReadJob:
    """The read in progress."""

    request: Envelope
    body: ReadEntry
    started: float
    staging_id: str | None = None
    offer: RestoreResult | None = None
    """The answer made when the file opened, sent once it is staged."""
    offered: bool = False
    error: str = ""


@dataclass
class ReaderState:
    """The read in progress (one at a time) and lifetime counters."""

    read: ReadJob | None = None
    reads: int = 0
    removed: int = 0


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadAsked:
    """A ``ReadEntry`` arrived (``request`` is its envelope)."""

    request: Envelope
    now: float


@dataclass(frozen=True, slots=True)
class OpenFailed:
    """:class:`Open` failed: the header is bad or mismatched, the file is gone, or an OS error."""

    reason: Literal["corrupt", "gone", "io_error"]
    now: float
    error: str = ""


@dataclass(frozen=True, slots=True)
class Opened:
    """:class:`Open` succeeded; ``staging_id`` is the new id the shell drew for the entry."""

    staging_id: str
    entry_tokens: int
    nbytes: int
    now: float


@dataclass(frozen=True, slots=True)
class Staged:
    """The outcome of :class:`Stage` (``False``: the staging is closed; the file was released)."""

    ok: bool
    now: float


@dataclass(frozen=True, slots=True)
class Delivered:
    """The outcome of :class:`Offer` (``False``: the asker left)."""

    ok: bool
    now: float


@dataclass(frozen=True, slots=True)
class Passed:
    """The outcome of :class:`Pass`.

    ``ok``: ``nbytes`` read (0: all in the page cache), ``touched`` the mtime;
    ``corrupt``: a hash disagreed; ``stopped``: the entry was closed during
    the pass (pushed out, dropped, a failed landing); ``io_error``.
    """

    outcome: Literal["ok", "corrupt", "stopped", "io_error"]
    now: float
    nbytes: int = 0
    touched: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True)
class BadRemoved:
    """The outcome of :class:`RemoveBad`: ``removed`` durably (unlink and directory fsync)."""

    removed: bool
    now: float


Event = ReadAsked | OpenFailed | Opened | Staged | Delivered | Passed | BadRemoved


# --- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Check the file's header against the index's facts and open it -> Opened | OpenFailed."""

    path: str
    namespace: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stage:
    """Put the open file in the host staging under ``staging_id`` -> :class:`Staged`."""

    staging_id: str


@dataclass(frozen=True, slots=True)
class Offer:
    """Answer the asker with the staged entry -> :class:`Delivered`."""

    body: RestoreResult


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the asker (a failure: nothing staged for it)."""

    body: RestoreResult


@dataclass(frozen=True, slots=True)
class Pass:
    """Pass over the open file's tensors (``touch``: set its mtime after) -> :class:`Passed`."""

    touch: bool


@dataclass(frozen=True, slots=True)
class Discard:
    """Drop ``staging_id`` from the staging if it is still there (its file is closed)."""

    staging_id: str


@dataclass(frozen=True, slots=True)
class Abandon:
    """End the open file's pass without running it (``reason``), waking any landing behind it."""

    reason: str


@dataclass(frozen=True, slots=True)
class RemoveBad:
    """Remove the file durably -> :class:`BadRemoved`."""

    path: str


@dataclass(frozen=True, slots=True)
class Report:
    """Tell the index how the read went."""

    body: RestoreReport


@dataclass(frozen=True, slots=True)
class Log:
    """Write one warning: ``event`` about ``path`` (``error``; ``removed`` for a bad file)."""

    event: str
    path: str
    error: str = ""
    removed: bool | None = None


Effect = Open | Stage | Offer | Answer | Pass | Discard | Abandon | RemoveBad | Report | Log


# --- rules ---------------------------------------------------------------------------------


def _job(state: ReaderState) -> ReadJob:
    if state.read is None:
        raise ValueError("an outcome without a read in progress")
    return state.read


def _fail(job: ReadJob, reason: str) -> RestoreResult:
    return RestoreResult(ok=False, path=job.body.path, reason=reason, ticket=job.body.ticket)


def _end(state: ReaderState, report: RestoreReport) -> list[Effect]:
    state.read = None
    return [Report(report)]


def _failed(state: ReaderState, job: ReadJob, reason: str) -> list[Effect]:
    """Answer the asker (unless it was offered the file already) and report ``reason``."""
    answer: list[Effect] = [] if job.offered else [Answer(_fail(job, reason))]
    return [*answer, *_end(state, RestoreReport(path=job.body.path, ok=False, reason=reason))]


def _corrupt(state: ReaderState, job: ReadJob, error: str) -> list[Effect]:
    """A corrupt or mismatched file: remove it unless read-only."""
    if not job.body.read_only:
        job.error = error
        return [RemoveBad(job.body.path)]
    return _bad_reported(state, job, removed=False)


def _bad_reported(state: ReaderState, job: ReadJob, *, removed: bool) -> list[Effect]:
    path = job.body.path
    if removed:
        state.removed += 1
    answer: list[Effect] = [] if job.offered else [Answer(_fail(job, "corrupt"))]
    report = RestoreReport(path=path, ok=False, reason="corrupt", removed=removed)
    return [Log("ssd_cache.corrupt", path, job.error, removed=removed), *answer,
            *_end(state, report)]


def _read_asked(state: ReaderState, event: ReadAsked) -> list[Effect]:
    body = event.request.body
    if not isinstance(body, ReadEntry):
        raise TypeError(f"reader has no rule for {body.kind!r}")
    if state.read is not None:
        raise ValueError("a read while another is in progress")
    state.read = ReadJob(request=event.request, body=body, started=event.now)
    state.reads += 1
    return [Open(body.path, body.namespace, body.tokens)]


def _open_failed(state: ReaderState, event: OpenFailed) -> list[Effect]:
    job = _job(state)
    match event.reason:
        case "corrupt":
            return _corrupt(state, job, event.error)
        case "gone":
            return _failed(state, job, "gone")
        case "io_error":
            return [Log("ssd_cache.read_failed", job.body.path, event.error),
                    *_failed(state, job, "io_error")]
        case _:
            assert_never(event.reason)


def _opened(state: ReaderState, event: Opened) -> list[Effect]:
    job = _job(state)
    job.staging_id = event.staging_id
    # NOTE: ``read_s`` is the time to the open file (header checked); the
    # pass runs after the answer.
    job.offer = RestoreResult(
        ok=True,
        path=job.body.path,
        staging_id=event.staging_id,
        entry_tokens=event.entry_tokens,
        bytes=event.nbytes,
        read_s=max(0.0, event.now - job.started),
        ticket=job.body.ticket,
    )
    return [Stage(event.staging_id)]


def _staged(state: ReaderState, event: Staged) -> list[Effect]:
    job = _job(state)
    if not event.ok or job.offer is None:
        return _failed(state, job, "stopped")
    job.offered = True
    return [Offer(job.offer)]


def _delivered(state: ReaderState, event: Delivered) -> list[Effect]:
    job = _job(state)
    assert job.staging_id is not None
    if not event.ok:
        # NOTE: the asker left; close the file now.
        return [Discard(job.staging_id), Abandon("the asker left"),
                *_end(state, RestoreReport(path=job.body.path, ok=False, reason="stopped"))]
    return [Pass(touch=not job.body.read_only)]


def _passed(state: ReaderState, event: Passed) -> list[Effect]:
    job = _job(state)
    path = job.body.path
    assert job.staging_id is not None
    match event.outcome:
        case "ok":
            # NOTE: only a pass that read the file teaches the estimator a read
            # speed (``bytes=0`` is ignored there): one that found the file in
            # the page cache read nothing, and its time says nothing of the disk.
            seconds = max(0.0, event.now - job.started)
            report = RestoreReport(
                path=path, ok=True, bytes=event.nbytes, seconds=seconds, touched=event.touched
            )
            return _end(state, report)
        case "corrupt":
            return [Discard(job.staging_id), *_corrupt(state, job, event.error)]
        case "stopped":
            # NOTE: the entry was closed during its pass (pushed out, dropped,
            # a landing that failed): nothing is known against the file.
            return _end(state, RestoreReport(path=path, ok=False, reason="stopped"))
        case "io_error":
            return [Discard(job.staging_id), Log("ssd_cache.read_failed", path, event.error),
                    *_end(state, RestoreReport(path=path, ok=False, reason="io_error"))]
        case _:
            assert_never(event.outcome)


def handle(state: ReaderState, event: Event) -> tuple[ReaderState, list[Effect]]:
    """Apply one event; return the state with the effects to perform, in order."""
    effects: list[Effect]
    match event:
        case ReadAsked():
            effects = _read_asked(state, event)
        case OpenFailed():
            effects = _open_failed(state, event)
        case Opened():
            effects = _opened(state, event)
        case Staged():
            effects = _staged(state, event)
        case Delivered():
            effects = _delivered(state, event)
        case Passed():
            effects = _passed(state, event)
        case BadRemoved(removed=removed):
            effects = _bad_reported(state, _job(state), removed=removed)
        case _:
            assert_never(event)
    return state, effects
