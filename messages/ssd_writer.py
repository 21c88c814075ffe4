"""Messages of the SSD cold tier (``actors.ssd_writer``).

The tier is four actors: ``ssd_writer`` keeps the in-memory index of the
files on disk and decides (find, cap, supersession, restore-or-recompute);
``ssd_writer.store`` writes one file at a time and removes the files the
index decides to remove; ``ssd_writer.read`` reads files back;
``ssd_writer.scrub`` re-verifies them while the engine is idle. Only the
index actor is addressed from outside; the others speak the internal
messages at the end of this module, and the host staging posts
``LandingReport`` to the index.

Tensors never travel here. A store names the cache ``handle`` whose tensors
the writer reads back one engine turn at a time (through the ``TensorSource``
port); a restore answers with a ``staging_id`` under which the checked,
open file waits (``actors.ssd_writer.HostStaging``) until the caller's
engine turn lands it into MLX arrays.

Public protocol (``docs/cold-tier.md``):

- ``Find`` (ask): the longest usable prefix on disk -> ``FindResult``, with
  the restore-or-recompute advice. Index only; no file is touched.
- ``Restore`` (ask): read a found file into host buffers -> ``RestoreResult``.
- ``Store`` (ask, sent by the spill queue): write an entry -> ``StoreResult``.
  The writer never disposes the handle; the spill queue owns it.
- ``Covers`` (ask): is this exact prefix servable from disk? -> ``CoversResult``.
- ``ObservePrefill`` (tell): a measured prefill, feeding the estimator.
- ``SsdStatsRequest`` (ask) -> ``SsdStats``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request
from .prompt_cache import EntryMeta
from .spill_queue import CheckpointRecord, SpillSource

__all__ = [
    "Covers",
    "CoversResult",
    "EntryWritten",
    "FilesRemoved",
    "Find",
    "FindResult",
    "LandingReport",
    "ObservePrefill",
    "ReadEntry",
    "RemoveEntries",
    "ReserveSpace",
    "Restore",
    "RestoreChoice",
    "RestoreReport",
    "RestoreResult",
    "ScrubPick",
    "ScrubReport",
    "ScrubTarget",
    "ScrubWake",
    "SpaceReserved",
    "SsdIndex",
    "SsdIndexEntry",
    "SsdIndexRequest",
    "SsdStats",
    "SsdStatsRequest",
    "Store",
    "StoreResult",
    "WriteCommitted",
    "WriteEntry",
]

RestoreChoice = Literal["restore", "recompute", "miss"]
"""``miss``: no usable file; ``restore``: read it (predicted faster, or no
estimate yet); ``recompute``: a file exists but prefilling is predicted faster."""


# --- public protocol ----------------------------------------------------------


class Find(Request):
    """Ask for the longest usable prefix of ``tokens`` on disk (index only).

    Only files stored under ``namespace`` are candidates (cache isolation:
    ``messages.prompt_cache.cache_namespace``).
    ``better_than``: usable tokens the caller already has (from the RAM
    tier); only a strictly longer file prefix counts, and the estimator
    weighs restoring it against prefilling the extra tokens only.
    """

    kind: Literal["ssd_writer.find"] = "ssd_writer.find"
    tokens: tuple[int, ...]
    namespace: str = ""
    better_than: int = Field(default=0, ge=0)


class FindResult(Body):
    """Answer to :class:`Find`.

    ``cached_tokens`` (<= len(prompt) - 1) is the usable prefix of the file at
    ``path``, whose entry covers ``entry_tokens`` tokens (more means a trim
    after restore). ``choice`` is the estimator's advice; ``recompute`` still
    names the file so a caller may decide otherwise.
    """

    kind: Literal["ssd_writer.find_result"] = "ssd_writer.find_result"
    choice: RestoreChoice = "miss"
    path: str | None = None
    cached_tokens: int = Field(default=0, ge=0)
    entry_tokens: int = Field(default=0, ge=0)
    file_bytes: int = Field(default=0, ge=0)
    predicted_restore_s: float | None = None
    predicted_prefill_s: float | None = None


class Restore(Request):
    """Read the file at ``path`` (from a :class:`FindResult`) into host buffers.

    ``namespace`` is the one the :class:`Find` asked in: a file indexed under
    another namespace is answered ``gone``, never read (cache isolation).
    ``ticket`` is the caller's and comes back in the :class:`RestoreResult`
    (the reader answers, so the answer's causation is not this message).
    """

    kind: Literal["ssd_writer.restore"] = "ssd_writer.restore"
    path: str
    namespace: str = ""
    ticket: str = ""


class RestoreResult(Body):
    """Answer to :class:`Restore`.

    On success the file waits open under ``staging_id`` in the tier's
    ``HostStaging`` (its header checked; the reader's pass over its tensors
    may still run); the caller takes it (once) and its engine turn lands it
    straight into MLX arrays, right behind the pass (a pass that fails makes
    that landing a miss). ``read_s``: time to the answer (header and open).
    On failure ``reason`` is ``gone`` (no longer indexed or removed
    meanwhile), ``corrupt`` (the header failed a check; the file was
    removed), ``io_error``, ``stopped``; every failure is a cache miss,
    never an error.
    """

    kind: Literal["ssd_writer.restore_result"] = "ssd_writer.restore_result"
    ok: bool
    path: str
    ticket: str = ""
    staging_id: str | None = None
    entry_tokens: int = Field(default=0, ge=0)
    bytes: int = Field(default=0, ge=0)
    read_s: float = Field(default=0.0, ge=0.0)
    reason: str = ""


class Store(Request):
    """Persist the entry behind ``handle`` (reads its tensors in engine turns).

    Sent by the spill queue, which keeps the handle's ownership: the writer
    reads the tensors but never disposes the handle. Reply: :class:`StoreResult`.
    """

    kind: Literal["ssd_writer.store"] = "ssd_writer.store"
    handle: str
    namespace: str = ""
    tokens: tuple[int, ...]
    meta: EntryMeta
    source: SpillSource = "evict"
    checkpoint: CheckpointRecord | None = None
    """Set: write a generation checkpoint file (``actors.checkpoints``), not an index entry."""


class StoreResult(Body):
    """Answer to :class:`Store` (for ``handle``): ``stored``, or why not (never an error).

    Reasons when not stored: ``read_only`` (another server holds the
    directory), ``disabled``, ``invalid``, ``too_large`` (the file alone
    exceeds the cap), ``disk_full``, ``io_error``, ``fsync_failed``,
    ``source_failed`` (the tensors could not be read back), ``evict_failed``.
    """

    kind: Literal["ssd_writer.store_result"] = "ssd_writer.store_result"
    handle: str
    stored: bool
    reason: str = "stored"
    path: str | None = None
    file_bytes: int = Field(default=0, ge=0)
    replaced: int = Field(default=0, ge=0)
    superseded: int = Field(default=0, ge=0)
    evicted: int = Field(default=0, ge=0)


class Covers(Request):
    """Is the exact prefix ``tokens`` servable from a committed file? (durability checks)."""

    kind: Literal["ssd_writer.covers"] = "ssd_writer.covers"
    tokens: tuple[int, ...]
    namespace: str = ""


class CoversResult(Body):
    """Answer to :class:`Covers`; ``entry_tokens`` is the covering entry's length (0 if none)."""

    kind: Literal["ssd_writer.covers_result"] = "ssd_writer.covers_result"
    covered: bool
    entry_tokens: int = Field(default=0, ge=0)


class ObservePrefill(Body):
    """A measured prefill: ``tokens`` computed in ``seconds`` (feeds restore-or-recompute)."""

    kind: Literal["ssd_writer.observe_prefill"] = "ssd_writer.observe_prefill"
    tokens: int = Field(ge=0)
    seconds: float = Field(ge=0.0)


class SsdStatsRequest(Request):
    """Ask for :class:`SsdStats`."""

    kind: Literal["ssd_writer.stats_request"] = "ssd_writer.stats_request"


class SsdStats(Body):
    """Gauges and lifetime counters of the cold tier's index and writer.

    ``bytes`` counts committed files; ``reserved_bytes`` the temp file being
    written; ``leftover_bytes`` files that are on disk (or may come back
    after a crash) but not indexed: unreadable at the startup scan, not yet
    durably removed, or whose removal failed (``leftover_files`` of them).
    The three together never exceed ``max_bytes`` once a write starts. ``restore_ms_last`` is
    the file read of the last restore (materializing is the caller's).
    ``choices_*`` count the restore-or-recompute advice given by ``Find``.
    ``scrubbed``/``scrubbed_bytes``: files (bytes) the idle scrubber
    re-verified; ``scrub_corrupt``: files it found bad (removed, and also
    counted in ``corrupt_removed`` when the unlink succeeded).
    ``landings``/``land_failures``: restored files landed into MLX memory in
    their engine turn (timed for the estimator), and landings that failed.
    ``checkpoint_bytes``: the generation checkpoint files, counted in
    ``bytes`` and under ``max_bytes`` too; ``checkpoints_expired``: those the
    startup scan removed for age.
    """

    kind: Literal["ssd_writer.stats"] = "ssd_writer.stats"
    ready: bool
    read_only: bool
    entries: int = Field(ge=0)
    bytes: int = Field(ge=0)
    reserved_bytes: int = Field(ge=0)
    max_bytes: int = Field(ge=0)
    finds: int = Field(ge=0)
    restores: int = Field(ge=0)
    restore_failures: int = Field(ge=0)
    restore_ms_last: float = Field(ge=0.0)
    spills: int = Field(ge=0)
    store_failures: int = Field(ge=0)
    too_large: int = Field(ge=0)
    disk_full: int = Field(ge=0)
    evicted: int = Field(ge=0)
    replaced: int = Field(ge=0)
    superseded: int = Field(ge=0)
    corrupt_removed: int = Field(ge=0)
    orphans_reaped: int = Field(ge=0)
    foreign_dirs: int = Field(ge=0)
    choices_restore: int = Field(ge=0)
    choices_recompute: int = Field(ge=0)
    disk_read_gbps: float | None = None
    prefill_tok_s: float | None = None
    longest_entry_tokens: int = Field(default=0, ge=0)
    scrubbed: int = Field(default=0, ge=0)
    scrubbed_bytes: int = Field(default=0, ge=0)
    scrub_corrupt: int = Field(default=0, ge=0)
    leftover_files: int = Field(default=0, ge=0)
    leftover_bytes: int = Field(default=0, ge=0)
    landings: int = Field(default=0, ge=0)
    land_failures: int = Field(default=0, ge=0)
    checkpoint_bytes: int = Field(default=0, ge=0)
    checkpoints_expired: int = Field(default=0, ge=0)


class SsdIndexRequest(Request):
    """Ask for :class:`SsdIndex`: every indexed file and every leftover (tests, tools)."""

    kind: Literal["ssd_writer.index_request"] = "ssd_writer.index_request"


class SsdIndexEntry(Body):
    """One indexed file of :class:`SsdIndex`."""

    kind: Literal["ssd_writer.index_entry"] = "ssd_writer.index_entry"
    path: str
    namespace: str
    tokens: tuple[int, ...]
    file_bytes: int = Field(ge=0)
    trimmable: bool = False
    min_reusable_offset: int = Field(default=0, ge=0)


class SsdIndex(Body):
    """Answer to :class:`SsdIndexRequest`: the index's files (path order) and its leftovers.

    ``leftovers``: files not indexed that still count toward the cap
    (path, bytes), in path order. ``jobs``: the writes in progress (job ids).
    """

    kind: Literal["ssd_writer.index"] = "ssd_writer.index"
    entries: tuple[SsdIndexEntry, ...] = ()
    leftovers: tuple[tuple[str, int], ...] = ()
    jobs: tuple[str, ...] = ()


# --- internal: index <-> store worker / reader --------------------------------


class WriteEntry(Body):
    """Index -> store worker: write job ``job_id`` to ``path`` (through a temp file beside it)."""

    kind: Literal["ssd_writer.write_entry"] = "ssd_writer.write_entry"
    job_id: str
    handle: str
    namespace: str
    tokens: tuple[int, ...]
    path: str


class ReserveSpace(Request):
    """Store worker -> index: the planned file needs ``file_bytes``; make room under the cap."""

    kind: Literal["ssd_writer.reserve"] = "ssd_writer.reserve"
    job_id: str
    file_bytes: int = Field(ge=0)


class SpaceReserved(Body):
    """Index -> store worker: write (``ok``) after unlinking ``evict``, or give up (``reason``)."""

    kind: Literal["ssd_writer.reserved"] = "ssd_writer.reserved"
    ok: bool
    reason: str = ""
    evict: tuple[str, ...] = ()


class EntryWritten(Request):
    """Store worker -> index: job ``job_id`` ended (committed at ``path``, or ``reason``).

    ``unremoved``: eviction victims whose unlink failed (still on disk).
    ``unsynced``: eviction victims unlinked, but their directory's fsync
    failed (they may come back after a crash). ``leftover_path`` (with
    ``leftover_bytes``): the job's own final file after a commit whose
    directory fsync failed: removed again, but not durably.
    """

    kind: Literal["ssd_writer.entry_written"] = "ssd_writer.entry_written"
    job_id: str
    ok: bool
    reason: str = ""
    path: str | None = None
    file_bytes: int = Field(default=0, ge=0)
    trimmable: bool = False
    min_reusable_offset: int = Field(default=0, ge=0)
    unremoved: tuple[str, ...] = ()
    unsynced: tuple[str, ...] = ()
    leftover_path: str | None = None
    leftover_bytes: int = Field(default=0, ge=0)


class WriteCommitted(Body):
    """Index -> store worker: the job is settled; unlink ``remove`` (superseded files)."""

    kind: Literal["ssd_writer.write_committed"] = "ssd_writer.write_committed"
    remove: tuple[str, ...] = ()


class FilesRemoved(Body):
    """Store worker -> index: what became of the files a ``WriteCommitted`` asked it to remove.

    ``removed``: unlinked (or already gone) and their directory fsynced: they
    cannot come back. ``failed``: still on disk, or their removal is not
    durable; the index keeps counting them.
    """

    kind: Literal["ssd_writer.files_removed"] = "ssd_writer.files_removed"
    removed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


class ReadEntry(Request):
    """Index -> reader: read ``path``; reply to the ``Restore`` asker's slot (``reply_to``).

    ``read_only``: the index writes and removes nothing in this run (another
    server holds the directory, or the scan was incomplete): the reader then
    neither touches the file's mtime nor removes it when it is corrupt.
    """

    kind: Literal["ssd_writer.read_entry"] = "ssd_writer.read_entry"
    path: str
    namespace: str
    tokens: tuple[int, ...]
    ticket: str = ""
    read_only: bool = False


class RemoveEntries(Body):
    """Index -> store worker: remove ``paths`` durably (unlink, directory fsync); ``reason`` is logged.

    The worker answers with :class:`FilesRemoved`. NOTE: the store worker
    runs it in its mailbox order, so the removal of a path never overtakes
    a later write of the same path (names derive from the tokens).
    """

    kind: Literal["ssd_writer.remove_entries"] = "ssd_writer.remove_entries"
    paths: tuple[str, ...]
    reason: str = ""


class LandingReport(Body):
    """Host staging -> index: one restore's landing in its engine turn.

    ``nbytes`` landed in ``seconds`` (engine-thread time) when ``ok``;
    otherwise the file at ``path`` failed the landing's checks
    (``corrupt``: it changed or a hash disagrees; the index removes it).
    Posted from the engine thread through the event loop
    (``actors.ssd_writer.HostStaging``).
    """

    kind: Literal["ssd_writer.landing_report"] = "ssd_writer.landing_report"
    path: str
    nbytes: int = Field(default=0, ge=0)
    seconds: float = Field(default=0.0, ge=0.0)
    ok: bool
    corrupt: bool = False


class RestoreReport(Body):
    """Reader -> index: how a read went (feeds the index, the estimator and the counters).

    ``touched``: the reader set the file's mtime to now (the LRU touch of a hit).
    ``removed``: the reader found the file corrupt or mismatched, unlinked it
    and fsynced its directory (``False``: the file, or its return after a
    crash, still takes room).
    """

    kind: Literal["ssd_writer.restore_report"] = "ssd_writer.restore_report"
    path: str
    ok: bool
    reason: str = ""
    bytes: int = Field(default=0, ge=0)
    seconds: float = Field(default=0.0, ge=0.0)
    touched: bool = False
    removed: bool = False


# --- internal: index <-> scrubber ---------------------------------------------


class ScrubWake(Body):
    """The scrubber's alarm went off (sent to itself)."""

    kind: Literal["ssd_writer.scrub_wake"] = "ssd_writer.scrub_wake"


class ScrubPick(Request):
    """Scrubber -> index: which file to re-verify next? -> :class:`ScrubTarget`."""

    kind: Literal["ssd_writer.scrub_pick"] = "ssd_writer.scrub_pick"


class ScrubTarget(Body):
    """Index -> scrubber: the next file in turn (``path`` ``None``: nothing to scrub)."""

    kind: Literal["ssd_writer.scrub_target"] = "ssd_writer.scrub_target"
    path: str | None = None
    namespace: str = ""
    tokens: tuple[int, ...] = ()
    file_bytes: int = Field(default=0, ge=0)
    read_only: bool = False
    """The tier writes and removes nothing in this run: the scrubber stops asking."""


class ScrubReport(Body):
    """Scrubber -> index: how the re-verification of ``path`` went.

    ``reason``: ``ok``, ``corrupt`` (a check failed; ``removed`` says whether
    the scrubber unlinked it and fsynced its directory), ``gone`` (no longer
    on disk), ``io_error``.
    """

    kind: Literal["ssd_writer.scrub_report"] = "ssd_writer.scrub_report"
    path: str
    ok: bool
    reason: str = "ok"
    bytes: int = Field(default=0, ge=0)
    removed: bool = False
