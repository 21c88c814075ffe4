"""The cold tier's index and rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

Pure Python over file metadata: no file access, no clock, no arrays. The
shell (``actors/ssd_writer/actor.py``) feeds it one :data:`Event` at a time
(a message: :class:`Received`; the startup scan: :class:`ScanLoaded`; an
outcome of one of its effects: :class:`WorkerGone`, :class:`ReaderGone`,
:class:`Removed`) and performs the effects in order. What the worker actors
observe arrives as messages (``ReserveSpace``, ``EntryWritten``,
``RestoreReport``, ``FilesRemoved``, ``ScrubReport``), and so do the
engine thread's landings (``LandingReport``, posted by the host staging).

Invariants kept here (``tests/actors/ssd_writer/test_core.py`` checks them
against a simple model):

- committed bytes plus leftover bytes plus the reservation of the file
  being written never exceed ``max_bytes`` once a write is allowed to start
  (victims are taken out of the index before the writer may create its temp
  file, and the writer removes them durably first);
- a file that leaves the index without being durably removed stays
  counted as a *leftover* until it is: a superseded file until its unlink
  and directory fsync are reported, a corrupt file the reader or scrubber
  could not remove, a file the startup scan could not read, a victim or a
  failed commit's final file whose directory fsync failed. So after any
  crash the valid files on disk fit the cap, and the startup never has to
  evict (the cap unchanged): it cannot drop an acknowledged entry in favour
  of one that was evicted or never acknowledged;
- at most one indexed file per (namespace, exact tokens), and at most one
  write of it at a time (a store of an entry being written waits for that
  write's outcome);
- a newly committed entry supersedes its strict prefix ancestors only when
  it is trimmable and may be trimmed down to the ancestor's length
  (``min_reusable_offset <= len(ancestor)``);
- ``Find`` never offers more than ``len(prompt) - 1`` tokens, nor an entry
  that would need a trim it cannot do, nor one adding fewer than
  ``min_restore_tokens`` to the caller's ``better_than``;
- every removal the rules decide is reported to the shell exactly once.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import sys
from array import array
from dataclasses import dataclass, field
from typing import Literal, assert_never

from actors.prompt_cache.core import common_prefix_len
from messages import (
    Body,
    Covers,
    CoversResult,
    EntryWritten,
    Envelope,
    Find,
    FindResult,
    ObservePrefill,
    ReserveSpace,
    Restore,
    RestoreChoice,
    RestoreReport,
    RestoreResult,
    SpaceReserved,
    SsdStats,
    SsdStatsRequest,
    Store,
    StoreResult,
    WriteCommitted,
)
from messages.kv_events import TierChange, TierChanged
from messages.spill_queue import RemoveCheckpoints
from messages.ssd_writer import (
    FilesRemoved,
    LandingReport,
    ScrubPick,
    ScrubReport,
    ScrubTarget,
    SsdIndex,
    SsdIndexEntry,
    SsdIndexRequest,
)

__all__ = [
    "CHECKPOINT_MAX_AGE_NS",
    "ENTRY_SUFFIX",
    "MIN_RESTORE_TOKENS",
    "PRIOR_DISK_BPS",
    "PRIOR_LAND_BPS",
    "PRIOR_LAND_FIXED_S",
    "PRIOR_PREFILL_TPS",
    "PRIOR_READ_FIXED_S",
    "Answer",
    "CostLine",
    "Effect",
    "Estimator",
    "Event",
    "ForwardCheckpoint",
    "IndexEntry",
    "IndexState",
    "Log",
    "ReaderGone",
    "Received",
    "RefuseCheckpoint",
    "RemoveFiles",
    "RemoveNow",
    "Removed",
    "ReportTier",
    "ScanLoaded",
    "ScanResult",
    "ScannedCheckpoint",
    "ScannedFile",
    "StartRead",
    "StartWrite",
    "StoreJob",
    "UnknownSsdWriterMessage",
    "WorkerGone",
    "checkpoint_job_id",
    "covers",
    "entry_name",
    "find",
    "handle",
    "index_listing",
    "namespace_dir",
    "new_state",
    "stats",
    "usable_tokens",
]

ENTRY_SUFFIX = ".kvt"
"""Committed entry files end with this; temp files end with ``.kvt.tmp``."""


class UnknownSsdWriterMessage(TypeError):
    """A body the SSD writer's index has no rule for."""


def namespace_dir(namespace: str) -> str:
    """The directory name of ``namespace`` under the fingerprint directory (16 hex digits).

    NOTE: a digest, not the namespace itself: adapter names may hold path
    separators or be long; the header keeps the namespace and the scan checks
    that it hashes to the directory it was found in.
    """
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=8).hexdigest()


def entry_name(tokens: tuple[int, ...]) -> str:
    """The file name of the entry for ``tokens``: a 128-bit digest of the ids, plus ``.kvt``.

    NOTE: derived from the tokens rather than random (a uuid): the same
    entry always gets the same name, so a rewrite replaces the old file
    atomically (``rename`` over it) instead of leaving two, and a recorded
    trace (paths travel in messages) replays exactly. The header still
    carries the tokens, and every read checks them against the index.
    """
    # NOTE: each id as 8 little-endian bytes, packed in C (a 5,000-token
    # entry: 38 us against 424 for a Python pass, on the event loop, per
    # store); the bytes are the format (golden names in the tests).
    ids = array("Q", tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest() + ENTRY_SUFFIX


@dataclass
class IndexEntry:
    """One committed file: what the rules need without opening it.

    ``last_used`` orders the LRU: the file's mtime (ns) as scanned at start,
    then the index's counter, which starts above every scanned mtime and
    advances on each store and restore. NOTE: the files' mtimes follow the
    same order (a commit and the reader's ``utime`` on a hit set them to
    now), so the order survives a restart without wall-clock times ever
    travelling in a message (a recorded trace replays exactly).
    """

    path: str
    namespace: str
    tokens: tuple[int, ...]
    file_bytes: int
    last_used: int
    trimmable: bool
    min_reusable_offset: int


@dataclass(frozen=True, slots=True)
class ScannedFile:
    """One ``*.kvt`` file the startup scan read a header from (or failed to).

    ``problem`` is ``None`` for a valid header, ``corrupt`` or ``incompatible``
    (with ``reason``) when the header is bad, ``unreadable`` when an OS error
    (permissions, EIO) kept the scan from reading it: no proof of corruption,
    so the file is kept, but counted. For a valid header ``entry`` holds its
    facts. ``file_bytes``: the size the directory listing gave.
    """

    path: str
    directory: str
    problem: Literal["corrupt", "incompatible", "unreadable"] | None
    reason: str = ""
    entry: IndexEntry | None = None
    file_bytes: int = 0


CHECKPOINT_MAX_AGE_NS = 24 * 3600 * 10**9
"""A generation checkpoint file older than this is removed (the startup scan, by mtime; in a
run, at the scrubber's next pick).

NOTE: a cancelled answer's checkpoint is kept for an identical retry; a
retry a day later is not the crash-and-retry case checkpoints serve, and
without a bound such files would only go when an identical request completes.
"""


@dataclass(frozen=True, slots=True)
class ScannedCheckpoint:
    """One ``*.kvc`` file the startup scan listed: its path, size and mtime (ns since the epoch)."""

    path: str
    file_bytes: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What the startup scan observed in ``<root>``.

    ``foreign_dirs``: fingerprint directories other than ours (never touched).
    ``orphans``: ``*.tmp`` files in our namespace directories, with their
    sizes in ``orphan_bytes`` (same order). ``directories``: our namespace
    directories. ``incomplete``: a directory could not be listed, so files
    the scan does not know may take room. ``checkpoints``: the generation
    checkpoint files; ``now_ns``: the wall time of the scan (their age).
    """

    files: tuple[ScannedFile, ...] = ()
    orphans: tuple[str, ...] = ()
    foreign_dirs: int = 0
    orphan_bytes: tuple[int, ...] = ()
    directories: tuple[str, ...] = ()
    incomplete: bool = False
    checkpoints: tuple[ScannedCheckpoint, ...] = ()
    now_ns: int = 0


MIN_RESTORE_TOKENS = 64
"""The fewest tokens a file must add to what RAM already serves for ``Find`` to offer it.

A restore reads the whole file however few of its tokens are reused, and
copies it into MLX arrays, while the prefill saved below this floor is small
(docs/cold-tier.md "Restore or recompute"). Without it a prompt sharing
only its BOS token with a stored conversation would read that
conversation's whole file to reuse one token. Above it the estimator decides.
"""

PRIOR_DISK_BPS = 1e9
"""Disk read speed (bytes/s) the estimator assumes until it has timed a restore."""

PRIOR_READ_FIXED_S = 0.0
"""A read's fixed cost (open, header, thread hops) assumed until reads of different sizes tell it
apart from the speed: none, so an unmeasured tier advises as the speed-only estimate did."""

PRIOR_LAND_BPS = math.inf
"""Landing speed (bytes/s into MLX memory, hashed) assumed until a landing was timed: free.

NOTE: no guess: the landing is memory-bound and its speed differs between devices by more than
an order of magnitude (unified memory vs a CPU VM); the first landing measures it."""

PRIOR_LAND_FIXED_S = 0.0
"""A landing's fixed cost (per-tensor allocations, hand-offs) assumed until sizes tell it apart."""

PRIOR_PREFILL_TPS = 1000.0
"""Prefill speed (tokens/s) the estimator assumes until it has timed a prefill.

Together the two priors advise a restore while the file holds at most about
1 MB per token it saves (an 8B model's bf16 KV takes 128 KiB per token, so a
file of up to about 7.6 times the tokens it saves): a long entry is not read
to save a few dozen of its tokens. Real devices differ from the priors in
both directions (this CPU prefills the default model at about 140 tokens/s;
an H200 prefills an 8B model at 25,000 tokens/s and read its KV back at
0.87 GB/s), so each prior gives way to the first measurement.
"""


class CostLine:
    """A cost model ``seconds = fixed_s + nbytes / bps`` fitted to timed samples.

    Exponentially weighted least squares: each new sample's weight is 1 and
    every older one's shrinks by ``1 - alpha``, so the line follows a device
    whose speed drifts. NOTE: the two parameters can only be told apart when
    the sizes differ; while the weighted sizes spread by less than
    ``min_spread`` (coefficient of variation), or the fit is not a rising
    line, the fixed part stays at its prior (capped at the mean time) and the
    speed explains the rest. A speed-only model (the old estimator) reads
    the fixed overhead of small files as a slow disk and then overrates
    every large file's cost, and underrates every small file's.
    """

    def __init__(
        self,
        *,
        prior_fixed_s: float,
        prior_bps: float,
        alpha: float = 0.2,
        min_spread: float = 0.25,
    ) -> None:
        if prior_fixed_s < 0 or prior_bps <= 0 or not 0 < alpha <= 1:
            raise ValueError("prior_fixed_s >= 0, prior_bps > 0 and 0 < alpha <= 1")
        self.prior_fixed_s = prior_fixed_s
        self.prior_bps = prior_bps
        self.alpha = alpha
        self.min_spread = min_spread
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._fit = (prior_fixed_s, prior_bps)

    def observe(self, nbytes: int, seconds: float) -> None:
        """One timed operation on ``nbytes`` (ignored unless both are positive)."""
        if nbytes <= 0 or seconds <= 0:
            return
        keep = 1.0 - self.alpha
        x, y = float(nbytes), seconds
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self.samples += 1
        self._fit = self._solve()

    def _solve(self) -> tuple[float, float]:
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = max(0.0, self._xx / self._w - mean_x * mean_x)
        cov = self._xy / self._w - mean_x * mean_y
        if var > (self.min_spread * mean_x) ** 2 and cov > 0:
            slope = cov / var
            fixed = mean_y - slope * mean_x
            if fixed >= 0:
                return fixed, 1.0 / slope
        fixed = min(self.prior_fixed_s, mean_y)
        return fixed, mean_x / (mean_y - fixed) if mean_y > fixed else math.inf

    def pin(self, bps: float, fixed_s: float = 0.0) -> None:
        """Set the line outright (tests, tools): as if measured, forgetting the samples."""
        if bps <= 0 or fixed_s < 0:
            raise ValueError("bps > 0 and fixed_s >= 0")
        self.samples = max(self.samples, 1)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._fit = (fixed_s, bps)

    @property
    def fixed_s(self) -> float:
        """The fitted fixed cost per operation (seconds)."""
        return self._fit[0]

    @property
    def bps(self) -> float:
        """The fitted speed of the size-dependent part (bytes/s; ``inf`` when it looks free)."""
        return self._fit[1]

    def predict(self, nbytes: int) -> float:
        """Predicted seconds for ``nbytes``."""
        return self._fit[0] + nbytes / self._fit[1]


class Estimator:
    """Running estimates of a restore's cost and of prefill speed; restore or recompute?

    A restore costs its read (the reader's pass over the file: open,
    header, every tensor checked; :class:`CostLine` ``read``, fed by
    ``RestoreReport``) plus its landing (the request's engine turn reading
    the bytes into MLX memory and hashing them again; ``land``, fed by the
    staging's landing observations). Each is a fixed cost plus bytes over a
    speed, so a small file's per-read overhead neither hides in nor skews
    the speed. Prefill speed is an exponentially weighted average (``alpha``
    on the newest sample). A quantity not measured yet is its prior
    (:data:`PRIOR_DISK_BPS`, :data:`PRIOR_READ_FIXED_S`,
    :data:`PRIOR_LAND_BPS`, :data:`PRIOR_LAND_FIXED_S`,
    :data:`PRIOR_PREFILL_TPS`); reading is the only way to learn the disk, so
    with the prefill measured and the disk not, the priors decide whether a
    first read is risked.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        prior_disk_bps: float = PRIOR_DISK_BPS,
        prior_read_fixed_s: float = PRIOR_READ_FIXED_S,
        prior_land_bps: float = PRIOR_LAND_BPS,
        prior_land_fixed_s: float = PRIOR_LAND_FIXED_S,
        prior_prefill_tps: float = PRIOR_PREFILL_TPS,
        always_restore: bool = False,
    ) -> None:
        if prior_disk_bps <= 0 or prior_prefill_tps <= 0 or prior_land_bps <= 0:
            raise ValueError("the priors must be positive")
        # NOTE: ``--ssd-restore always``: every usable file is read, whatever
        # the predictions say (the speeds are still learned and reported).
        self.always_restore = always_restore
        self.alpha = alpha
        self.read = CostLine(prior_fixed_s=prior_read_fixed_s, prior_bps=prior_disk_bps)
        self.land = CostLine(prior_fixed_s=prior_land_fixed_s, prior_bps=prior_land_bps)
        self.prior_prefill_tps = prior_prefill_tps
        self.prefill_tps: float | None = None

    @property
    def disk_bps(self) -> float | None:
        """The fitted read speed (``None`` until a read was timed)."""
        return self.read.bps if self.read.samples else None

    @disk_bps.setter
    def disk_bps(self, bps: float) -> None:
        self.read.pin(bps)

    def _mix(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A reader's pass over a file of ``nbytes`` tensor bytes took ``seconds``."""
        self.read.observe(nbytes, seconds)

    def observe_landing(self, nbytes: int, seconds: float) -> None:
        """An engine turn landed ``nbytes`` into MLX memory in ``seconds``."""
        self.land.observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` took ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)

    def restore_s(self, file_bytes: int) -> float:
        """Predicted seconds to restore a file of ``file_bytes``: read, then land.

        NOTE: the landing is engine-turn work, weighed against the prefill
        it replaces; it counts once the prefill speed has been measured on
        this device. Until then the prefill side is a prior (a guess for an
        unknown device: 7x too fast for this CPU, 25x too slow for an H200),
        and one landing timed on a busy machine (2.6 MB landed in 2-20 ms,
        once in 178 ms, at load 7.9) would decide against the prefill the
        tier exists to save, as a kill -9 loop's first turns after a
        restart (all served from disk, so no prefill is ever timed) showed.
        """
        land = self.land.predict(file_bytes) if self.prefill_tps is not None else 0.0
        return self.read.predict(file_bytes) + land

    def choose(
        self, file_bytes: int, saved_tokens: int
    ) -> tuple[RestoreChoice, float | None, float | None]:
        """Advice for reading ``file_bytes`` to save prefilling ``saved_tokens``.

        A quantity not measured yet is its prior. Returns the choice and the
        two predictions (``None`` until a read and a prefill were timed).
        """
        prefill = self.prior_prefill_tps if self.prefill_tps is None else self.prefill_tps
        restore_s = self.restore_s(file_bytes)
        prefill_s = saved_tokens / prefill
        faster = restore_s < prefill_s
        choice: RestoreChoice = "restore" if faster or self.always_restore else "recompute"
        if self.disk_bps is None or self.prefill_tps is None:
            return choice, None, None
        return choice, restore_s, prefill_s


@dataclass
class StoreJob:
    """A ``Store`` being written by the store worker (its ask waits in ``request``)."""

    job_id: str
    request: Envelope
    handle: str
    namespace: str
    tokens: tuple[int, ...]
    reserved: int = 0
    evicting: list[IndexEntry] = field(default_factory=list)
    freeing: dict[str, int] = field(default_factory=dict)
    """Leftover files taken as victims (path -> bytes), no longer counted while the job runs."""
    followers: list[tuple[Envelope, str]] = field(default_factory=list)
    """Stores of the same entry that arrived while this job ran (request, handle): they get
    this job's outcome."""
    checkpoint: bool = False
    """A generation checkpoint write: not an index entry; the store worker answers its Store."""


# --- effects (core -> shell) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply ``body`` to ``request``."""

    request: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class StartWrite:
    """Tell the store worker to write job ``job_id`` (the handle's tensors) to ``path``."""

    job_id: str
    handle: str
    namespace: str
    tokens: tuple[int, ...]
    path: str
    correlation_id: str


@dataclass(frozen=True, slots=True)
class StartRead:
    """Tell the reader to read ``path``, answering the ``Restore`` in ``request`` itself.

    ``read_only``: the reader must neither touch nor remove the file. Not
    delivered (the reader is gone or full): the shell feeds :class:`ReaderGone`.
    """

    request: Envelope
    path: str
    namespace: str
    tokens: tuple[int, ...]
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class RemoveFiles:
    """Have the store worker unlink ``paths`` durably (``reason`` for the log).

    They are leftovers until the worker's ``FilesRemoved`` says they are
    gone; not delivered, the shell feeds :class:`Removed` with them failed.
    """

    paths: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class RemoveNow:
    """Unlink ``paths`` durably in the start hook, before the first message (scan decisions).

    NOTE: only :class:`ScanLoaded` returns it: the start hook already waits
    on file work (lock, scan), and the store worker may not be spawned yet.
    The shell feeds the outcome back as :class:`Removed`.
    """

    paths: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ForwardCheckpoint:
    """Hand the checkpoint write or removal in ``request`` to the store worker (not an index entry).

    Not delivered, a write's job ``job_id`` is abandoned (:class:`WorkerGone`).
    """

    request: Envelope
    job_id: str = ""


@dataclass(frozen=True, slots=True)
class RefuseCheckpoint:
    """Answer the checkpoint ``Store`` in ``request`` not stored (``reason``), counting the failure."""

    request: Envelope
    reason: str


@dataclass(frozen=True, slots=True)
class ReportTier:
    """Tell the KV-event publisher what entered and left the index (medium ``DISK``)."""

    body: TierChanged


@dataclass(frozen=True, slots=True)
class Log:
    """Write one warning (``event`` with ``detail``)."""

    event: str
    detail: str


Effect = (
    Answer
    | StartWrite
    | StartRead
    | RemoveFiles
    | RemoveNow
    | ForwardCheckpoint
    | RefuseCheckpoint
    | ReportTier
    | Log
)


# --- events (shell -> core) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    """A message arrived at ``now``."""

    envelope: Envelope
    now: float


@dataclass(frozen=True, slots=True)
class ScanLoaded:
    """The start hook scanned the fingerprint directory.

    ``locked``: it holds the directory's lock (``False``: another server holds
    it, or it could not be created: the tier stores and removes nothing).
    """

    scan: ScanResult
    locked: bool
    now: float


@dataclass(frozen=True, slots=True)
class WorkerGone:
    """The ``StartWrite`` of job ``job_id`` was not delivered (the store worker is gone or full)."""

    job_id: str
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class ReaderGone:
    """The ``StartRead`` for the ``Restore`` in ``request`` was not delivered."""

    request: Envelope
    path: str
    now: float


@dataclass(frozen=True, slots=True)
class Removed:
    """What became of a removal (:class:`RemoveNow`, or a :class:`RemoveFiles` not delivered).

    ``removed``: durably gone. ``failed``: still on disk or not durably removed.
    """

    removed: tuple[str, ...]
    failed: tuple[str, ...]
    now: float


Event = Received | ScanLoaded | WorkerGone | ReaderGone | Removed


@dataclass
class IndexState:
    """The index and the counters (mutated in place and returned by :func:`handle`)."""

    root: str
    fingerprint: str
    max_bytes: int
    read_only: bool = False
    ready: bool = False
    report_tier: bool = False
    """Files entering and leaving the index are recorded for the KV-event publisher
    (a :class:`ReportTier` effect after each event)."""
    tier_changes: list[TierChange] = field(default_factory=list)
    entries: dict[str, IndexEntry] = field(default_factory=dict)
    by_namespace: dict[str, dict[tuple[int, ...], str]] = field(default_factory=dict)
    indexed_bytes: int = 0
    checkpoints: dict[str, int] = field(default_factory=dict)
    """Generation checkpoint files on disk (path -> bytes); they count toward the cap."""
    checkpoint_bytes: int = 0
    checkpoint_born: dict[str, float] = field(default_factory=dict)
    """When each checkpoint file was written, on the events' (monotonic) clock."""
    checkpoints_expired: int = 0
    leftovers: dict[str, int] = field(default_factory=dict)
    stuck: set[str] = field(default_factory=set)
    leftover_bytes: int = 0
    reserved_bytes: int = 0
    jobs: dict[str, StoreJob] = field(default_factory=dict)
    estimator: Estimator = field(default_factory=Estimator)
    min_restore_tokens: int = 1
    """``Find`` offers no file adding fewer tokens than this over ``better_than``
    (the tier's config sets :data:`MIN_RESTORE_TOKENS`; 1 here: any longer prefix)."""
    warned_disk_full: bool = False
    clock: int = 0
    finds: int = 0
    restores: int = 0
    restore_failures: int = 0
    restore_ms_last: float = 0.0
    spills: int = 0
    store_failures: int = 0
    too_large: int = 0
    disk_full: int = 0
    evicted: int = 0
    replaced: int = 0
    superseded: int = 0
    duplicates_skipped: int = 0
    corrupt_removed: int = 0
    orphans_reaped: int = 0
    foreign_dirs: int = 0
    choices_restore: int = 0
    choices_recompute: int = 0
    landings: int = 0
    land_failures: int = 0
    scrub_cursor: str = ""
    scrubbed: int = 0
    scrubbed_bytes: int = 0
    scrub_corrupt: int = 0

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError("max_bytes cannot be negative")
        if self.min_restore_tokens < 1:
            raise ValueError("min_restore_tokens must be >= 1")

    @property
    def fingerprint_dir(self) -> str:
        """``<root>/<fingerprint>``."""
        return os.path.join(self.root, self.fingerprint)

    def directory_of(self, namespace: str) -> str:
        """``<root>/<fingerprint>/<namespace digest>``."""
        return os.path.join(self.fingerprint_dir, namespace_dir(namespace))

    def path_of(self, namespace: str, tokens: tuple[int, ...]) -> str:
        """``<root>/<fingerprint>/<namespace digest>/<tokens digest>.kvt``."""
        return os.path.join(self.directory_of(namespace), entry_name(tokens))


# --- index bookkeeping ---------------------------------------------------------


def _index(state: IndexState, entry: IndexEntry) -> None:
    if state.report_tier:
        state.tier_changes.append(
            TierChange(op="stored", namespace=entry.namespace, tokens=entry.tokens)
        )
    state.entries[entry.path] = entry
    state.by_namespace.setdefault(entry.namespace, {})[entry.tokens] = entry.path
    state.indexed_bytes += entry.file_bytes


def _unindex(state: IndexState, entry: IndexEntry) -> None:
    if state.report_tier:
        state.tier_changes.append(
            TierChange(op="removed", namespace=entry.namespace, tokens=entry.tokens)
        )
    del state.entries[entry.path]
    same_ns = state.by_namespace[entry.namespace]
    if same_ns.get(entry.tokens) == entry.path:
        del same_ns[entry.tokens]
    if not same_ns:
        del state.by_namespace[entry.namespace]
    state.indexed_bytes -= entry.file_bytes


def _report_tier(state: IndexState) -> list[Effect]:
    """The index changes recorded since the last report (medium ``DISK``), and forget them.

    NOTE: :func:`handle` appends it after every event's effects, so changes
    made by any event (a message, the scan, a landing, an abandoned job)
    leave in the order they happened.
    """
    if not state.tier_changes:
        return []
    changes, state.tier_changes = tuple(state.tier_changes), []
    return [ReportTier(TierChanged(medium="DISK", changes=changes))]


def _add_leftover(state: IndexState, path: str, nbytes: int, *, stuck: bool = False) -> None:
    """Count ``path`` (not indexed) until it is durably gone; ``stuck``: its removal failed."""
    state.leftover_bytes += nbytes - state.leftovers.get(path, 0)
    state.leftovers[path] = nbytes
    if stuck:
        state.stuck.add(path)
    else:
        state.stuck.discard(path)


def _drop_leftover(state: IndexState, path: str) -> int:
    """Stop counting ``path``; the bytes it was counted for (0 when it was not a leftover)."""
    nbytes = state.leftovers.pop(path, 0)
    state.leftover_bytes -= nbytes
    state.stuck.discard(path)
    return nbytes


def _used(state: IndexState) -> int:
    """Bytes that count toward the cap: indexed files, checkpoints, leftovers, the file written."""
    return (state.indexed_bytes + state.checkpoint_bytes + state.leftover_bytes
            + state.reserved_bytes)


def checkpoint_job_id(handle: str) -> str:
    """The job id of the checkpoint ``Store`` of ``handle`` (the store worker derives it too)."""
    return f"checkpoint:{handle}"


def _checkpoint_key(path: str) -> str:
    """The request key in a checkpoint file's name (``<key>-<sample index>.kvc``)."""
    return os.path.basename(path).split("-", 1)[0]


def _count_checkpoint(state: IndexState, path: str, nbytes: int, born: float) -> None:
    state.checkpoint_bytes += nbytes - state.checkpoints.get(path, 0)
    state.checkpoints[path] = nbytes
    state.checkpoint_born[path] = born


def _reap_checkpoints(state: IndexState, now: float) -> list[Effect]:
    """Remove the checkpoint files older than :data:`CHECKPOINT_MAX_AGE_NS` (leftovers until gone).

    NOTE: a cancelled answer's checkpoint that no identical request retries
    would otherwise hold its room under the cap until the next start.
    """
    if state.read_only:
        return []
    max_age = CHECKPOINT_MAX_AGE_NS / 1e9
    expired = sorted(p for p, born in state.checkpoint_born.items() if now - born > max_age)
    for path in expired:
        nbytes = state.checkpoints.pop(path)
        del state.checkpoint_born[path]
        state.checkpoint_bytes -= nbytes
        _add_leftover(state, path, nbytes)
    state.checkpoints_expired += len(expired)
    return [RemoveFiles(tuple(expired), "checkpoint_expired")] if expired else []


def _forget_checkpoints(state: IndexState, key: str, *, keep: str | None = None) -> None:
    """Stop counting every checkpoint file of ``key`` but ``keep`` (they are durably gone).

    NOTE: by key, not by path: the resume path's lookup removes a key's
    older or corrupt files without telling the index, and both a committed
    write (older files) and a completion's removal leave no other file of
    the key on disk.
    """
    for path in [p for p in state.checkpoints if p != keep and _checkpoint_key(p) == key]:
        state.checkpoint_bytes -= state.checkpoints.pop(path)
        state.checkpoint_born.pop(path, None)


def _cap(state: IndexState) -> int:
    """The byte cap in force: ``max_bytes``, or no cap when it is 0 (``--ssd-cache-max 0``).

    NOTE: 0 means unlimited (docs/rules.md D5-2), never "store nothing":
    read as a cap of 0 bytes, the startup scan would delete every file as
    over the cap. Without a cap a full disk ends stores with ``disk_full``.
    """
    return state.max_bytes if state.max_bytes > 0 else sys.maxsize


def _lru(state: IndexState, *, exclude: str | None = None) -> list[IndexEntry]:
    """Indexed entries, least recently used first."""
    return sorted(
        (e for e in state.entries.values() if e.path != exclude),
        key=lambda e: (e.last_used, e.path),
    )


def _tick(state: IndexState) -> int:
    state.clock += 1
    return state.clock


# --- find / covers ----------------------------------------------------------------


def usable_tokens(entry: IndexEntry, prompt: tuple[int, ...]) -> int:
    """Tokens ``entry`` can serve for ``prompt`` (0 when it cannot serve).

    At most ``len(prompt) - 1`` (one token is left to compute the next
    logits); shorter than the entry only when the entry can be trimmed and
    not below its minimum reusable offset.
    """
    usable = min(common_prefix_len(entry.tokens, prompt), len(prompt) - 1)
    if usable <= 0:
        return 0
    if usable < len(entry.tokens) and (not entry.trimmable or usable < entry.min_reusable_offset):
        return 0
    return usable


def find(state: IndexState, msg: Find) -> FindResult:
    """The longest usable prefix in ``msg.namespace`` beyond ``msg.better_than``, with advice."""
    state.finds += 1
    best: IndexEntry | None = None
    best_usable = msg.better_than
    paths = state.by_namespace.get(msg.namespace, {})
    if len(msg.tokens) > 1:
        for path in paths.values():
            entry = state.entries[path]
            usable = usable_tokens(entry, msg.tokens)
            if usable <= msg.better_than:
                continue
            # NOTE: ties prefer the smaller file (less to read), then the newer.
            if best is None or (usable, -entry.file_bytes, entry.last_used) > (
                best_usable,
                -best.file_bytes,
                best.last_used,
            ):
                best, best_usable = entry, usable
    # NOTE: a file adding fewer than min_restore_tokens is no candidate at
    # all (a miss, not a recompute choice): most such hits are prompts
    # sharing a BOS token or a short preamble with an unrelated file.
    if best is None or best_usable - msg.better_than < state.min_restore_tokens:
        return FindResult()
    choice, restore_s, prefill_s = state.estimator.choose(
        best.file_bytes, best_usable - msg.better_than
    )
    if choice == "restore":
        state.choices_restore += 1
    else:
        state.choices_recompute += 1
    return FindResult(
        choice=choice,
        path=best.path,
        cached_tokens=best_usable,
        entry_tokens=len(best.tokens),
        file_bytes=best.file_bytes,
        predicted_restore_s=restore_s,
        predicted_prefill_s=prefill_s,
    )


def covers(state: IndexState, msg: Covers) -> CoversResult:
    """Whether a committed file serves exactly ``msg.tokens`` (itself or a trimmable descendant)."""
    n = len(msg.tokens)
    if n == 0:
        return CoversResult(covered=False)
    paths = state.by_namespace.get(msg.namespace, {})
    exact = paths.get(msg.tokens)
    if exact is not None:
        return CoversResult(covered=True, entry_tokens=n)
    best = 0
    for tokens, path in paths.items():
        entry = state.entries[path]
        if (
            len(tokens) > n
            and entry.trimmable
            and entry.min_reusable_offset <= n
            and tokens[:n] == msg.tokens
            and (best == 0 or len(tokens) < best)
        ):
            best = len(tokens)
    return CoversResult(covered=best > 0, entry_tokens=best)


# --- store ----------------------------------------------------------------------


def _store_refused(envelope: Envelope, msg: Store, reason: str) -> list[Effect]:
    return [Answer(envelope, StoreResult(handle=msg.handle, stored=False, reason=reason))]


def store(state: IndexState, envelope: Envelope, msg: Store) -> list[Effect]:
    """Start writing ``msg``'s entry, or answer why not at once."""
    if not msg.tokens or len(msg.tokens) != msg.meta.offset:
        state.store_failures += 1
        return _store_refused(envelope, msg, "invalid")
    if state.read_only:
        return _store_refused(envelope, msg, "read_only")
    existing = state.by_namespace.get(msg.namespace, {}).get(msg.tokens)
    if existing is not None:
        # NOTE: the same tokens under the same fingerprint are the same KV;
        # rewriting the file would cost a full write for nothing (an
        # eviction spill of an entry write-behind already persisted is the
        # common case). The committed file already is the durable copy.
        state.duplicates_skipped += 1
        return [
            Answer(
                envelope,
                StoreResult(
                    handle=msg.handle,
                    stored=True,
                    reason="duplicate",
                    path=existing,
                    file_bytes=state.entries[existing].file_bytes,
                ),
            )
        ]
    for running in state.jobs.values():
        if (not running.checkpoint and running.namespace == msg.namespace
                and running.tokens == msg.tokens):
            # NOTE: one write per entry at a time. A second write of the same
            # name would rename over the first file, and if its directory
            # fsync then failed, the writer's removal of its final file would
            # delete the first one, already answered stored. Same tokens are
            # the same KV: the running write's outcome answers both.
            running.followers.append((envelope, msg.handle))
            return []
    job = StoreJob(
        job_id=envelope.msg_id,
        request=envelope,
        handle=msg.handle,
        namespace=msg.namespace,
        tokens=msg.tokens,
    )
    state.jobs[job.job_id] = job
    return [
        StartWrite(
            job_id=job.job_id,
            handle=msg.handle,
            namespace=msg.namespace,
            tokens=msg.tokens,
            path=state.path_of(msg.namespace, msg.tokens),
            correlation_id=envelope.correlation_id,
        )
    ]


def reserve(state: IndexState, envelope: Envelope, msg: ReserveSpace) -> list[Effect]:
    """Make room for a planned file: take LRU victims out of the index, then reserve its bytes."""
    job = state.jobs.get(msg.job_id)
    if job is None:
        return [Answer(envelope, SpaceReserved(ok=False, reason="unknown_job"))]
    if job.reserved:
        return [Answer(envelope, SpaceReserved(ok=False, reason="already_reserved"))]
    # NOTE: a checkpoint that cannot get room is refused ``over_cap``: the
    # answer goes on uncheckpointed; checkpoints never evict each other.
    if msg.file_bytes > _cap(state):
        if job.checkpoint:
            return [Answer(envelope, SpaceReserved(ok=False, reason="over_cap"))]
        state.too_large += 1
        return [Answer(envelope, SpaceReserved(ok=False, reason="too_large"))]
    # NOTE: victims in this order: leftovers (they serve nothing; removing one
    # that is already unlinked only syncs its directory), then indexed entries
    # least recently used first, then leftovers whose removal already failed
    # once (so one undeletable file does not fail every later store).
    stuck = sorted(p for p in state.leftovers if p in state.stuck)
    candidates: list[str | IndexEntry] = [
        *sorted(p for p in state.leftovers if p not in state.stuck),
        *_lru(state),
        *stuck,
    ]
    victims: list[IndexEntry] = []
    freeing: dict[str, int] = {}
    evict: list[str] = []
    for candidate in candidates:
        if _used(state) + msg.file_bytes <= _cap(state):
            break
        if isinstance(candidate, IndexEntry):
            _unindex(state, candidate)
            victims.append(candidate)
            evict.append(candidate.path)
        else:
            freeing[candidate] = _drop_leftover(state, candidate)
            evict.append(candidate)
    if _used(state) + msg.file_bytes > _cap(state):
        # NOTE: only other reservations can be left (not with one store worker);
        # put the victims back rather than delete files for nothing.
        for victim in victims:
            _index(state, victim)
        for path, nbytes in freeing.items():
            _add_leftover(state, path, nbytes, stuck=path in stuck)
        reason = "over_cap" if job.checkpoint else "no_room"
        return [Answer(envelope, SpaceReserved(ok=False, reason=reason))]
    job.reserved = msg.file_bytes
    job.evicting = victims
    job.freeing = freeing
    state.reserved_bytes += msg.file_bytes
    return [Answer(envelope, SpaceReserved(ok=True, evict=tuple(evict)))]


def _supersede(state: IndexState, new: IndexEntry) -> tuple[list[IndexEntry], list[IndexEntry]]:
    """Entries ``new`` displaces: its exact duplicate and the ancestors it can serve."""
    same_ns = state.by_namespace.get(new.namespace, {})
    duplicates = [state.entries[p] for t, p in same_ns.items() if t == new.tokens]
    ancestors: list[IndexEntry] = []
    if new.trimmable:
        # NOTE: mirrors Put in the RAM tier: only a trimmable descendant that
        # may be cut down to the ancestor's length serves every prompt the
        # ancestor could; otherwise the ancestor (a prompt boundary) stays.
        for tokens, path in same_ns.items():
            if (
                len(tokens) < len(new.tokens)
                and new.min_reusable_offset <= len(tokens)
                and new.tokens[: len(tokens)] == tokens
            ):
                ancestors.append(state.entries[path])
    return duplicates, ancestors


def entry_written(
    state: IndexState, envelope: Envelope, msg: EntryWritten, now: float = 0.0
) -> list[Effect]:
    """Settle a write job: index the new file and supersede, or count the failure."""
    job = state.jobs.pop(msg.job_id, None)
    if job is None:
        return [Answer(envelope, WriteCommitted())]
    state.reserved_bytes -= job.reserved
    unremoved = set(msg.unremoved)
    unsynced = set(msg.unsynced)
    for victim in job.evicting:
        if victim.path in unremoved:
            _index(state, victim)  # NOTE: still on disk, still valid: keep serving it.
            continue
        state.evicted += 1
        if victim.path in unsynced:
            # NOTE: gone from the directory, but it may come back after a crash.
            _add_leftover(state, victim.path, victim.file_bytes, stuck=True)
    for path, nbytes in job.freeing.items():
        if path in unremoved or path in unsynced:
            _add_leftover(state, path, nbytes, stuck=True)
    if msg.leftover_path is not None:
        # NOTE: a commit whose directory fsync failed: the final file was
        # unlinked again, but neither its rename nor that unlink is durable.
        _add_leftover(state, msg.leftover_path, msg.leftover_bytes)
    if job.checkpoint:
        if msg.ok and msg.path is not None:
            _forget_checkpoints(state, _checkpoint_key(msg.path), keep=msg.path)
            _count_checkpoint(state, msg.path, msg.file_bytes, now)
        return [Answer(envelope, WriteCommitted())]
    effects: list[Effect] = []
    store_body = StoreResult(handle=job.handle, stored=False, reason=msg.reason or "io_error")
    remove: list[str] = []
    if msg.ok and msg.path is not None:
        new = IndexEntry(
            path=msg.path,
            namespace=job.namespace,
            tokens=job.tokens,
            file_bytes=msg.file_bytes,
            last_used=_tick(state),
            trimmable=msg.trimmable,
            min_reusable_offset=msg.min_reusable_offset,
        )
        duplicates, ancestors = _supersede(state, new)
        for old in (*duplicates, *ancestors):
            _unindex(state, old)
            if old.path != new.path:  # NOTE: the same name was replaced by the rename.
                remove.append(old.path)
                _add_leftover(state, old.path, old.file_bytes)
        # NOTE: the durable rename replaced whatever had this name before.
        _drop_leftover(state, new.path)
        _index(state, new)
        evicted = len(job.evicting) - len(unremoved)
        # NOTE: the reservation already made room for the planned size; this
        # only matters if the committed file came out larger than planned.
        excess = _used(state) - _cap(state)
        for victim in _lru(state, exclude=new.path):
            if excess <= 0:
                break
            _unindex(state, victim)
            _add_leftover(state, victim.path, victim.file_bytes)
            remove.append(victim.path)
            excess -= victim.file_bytes
            state.evicted += 1
            evicted += 1
        state.spills += 1
        state.replaced += len(duplicates)
        state.superseded += len(ancestors)
        store_body = StoreResult(
            handle=job.handle,
            stored=True,
            path=new.path,
            file_bytes=new.file_bytes,
            replaced=len(duplicates),
            superseded=len(ancestors),
            evicted=evicted,
        )
    else:
        state.store_failures += 1
        if msg.reason == "disk_full":
            state.disk_full += 1
            if not state.warned_disk_full:
                state.warned_disk_full = True
                effects.append(
                    Log(
                        "ssd_cache.disk_full",
                        f"the cold tier's disk is full under {state.root}; entries are not "
                        "stored until space frees up (warned once)",
                    )
                )
    effects.append(Answer(job.request, store_body))
    effects.extend(_answer_followers(state, job, store_body))
    effects.append(Answer(envelope, WriteCommitted(remove=tuple(remove))))
    return effects


def _answer_followers(state: IndexState, job: StoreJob, outcome: StoreResult) -> list[Effect]:
    """Answer the stores that waited for ``job`` with its outcome (a stored one as a duplicate)."""
    out: list[Effect] = []
    for request, handle in job.followers:
        if outcome.stored:
            state.duplicates_skipped += 1
            body = StoreResult(
                handle=handle,
                stored=True,
                reason="duplicate",
                path=outcome.path,
                file_bytes=outcome.file_bytes,
            )
        else:
            body = StoreResult(handle=handle, stored=False, reason=outcome.reason)
        out.append(Answer(request, body))
    return out


def _files_removed(
    state: IndexState, removed: tuple[str, ...], failed: tuple[str, ...]
) -> list[Effect]:
    """Stop counting leftovers that are durably gone; a failed removal is tried last from now."""
    for path in removed:
        _drop_leftover(state, path)
    failed_keys = {_checkpoint_key(p) for p in failed if p in state.checkpoints}
    for key in {_checkpoint_key(p) for p in removed if p in state.checkpoints} - failed_keys:
        _forget_checkpoints(state, key)
    for path in failed:
        if path in state.leftovers:
            state.stuck.add(path)
    return []


def _abandon_job(state: IndexState, job_id: str, reason: str) -> list[Effect]:
    """The store worker never got job ``job_id`` (it is gone): settle the ``Store`` as failed."""
    job = state.jobs.pop(job_id, None)
    if job is None:
        return []
    state.reserved_bytes -= job.reserved
    for victim in job.evicting:
        _index(state, victim)
    for path, nbytes in job.freeing.items():
        _add_leftover(state, path, nbytes)
    if job.checkpoint:
        return [RefuseCheckpoint(job.request, reason)]
    state.store_failures += 1
    failed = StoreResult(handle=job.handle, stored=False, reason=reason)
    return [Answer(job.request, failed), *_answer_followers(state, job, failed)]


# --- restore ----------------------------------------------------------------------


def restore(state: IndexState, envelope: Envelope, msg: Restore) -> list[Effect]:
    """Hand an indexed file to the reader (it answers the asker), or answer ``gone``."""
    if not msg.reply_to:
        return []  # NOTE: a told Restore has no one to hand the bytes to.
    entry = state.entries.get(msg.path)
    # NOTE: a path names its namespace's directory, but only by a 64-bit
    # digest; the index's namespace is the authority (cache isolation).
    if entry is None or entry.namespace != msg.namespace:
        state.restore_failures += 1
        gone = RestoreResult(ok=False, path=msg.path, reason="gone", ticket=msg.ticket)
        return [Answer(envelope, gone)]
    return [StartRead(envelope, entry.path, entry.namespace, entry.tokens, state.read_only)]


def _reader_gone(state: IndexState, event: ReaderGone) -> list[Effect]:
    """The reader never got the read: the ``Restore`` fails (a miss)."""
    request = event.request
    ticket = request.body.ticket if isinstance(request.body, Restore) else ""
    state.restore_failures += 1
    failed = RestoreResult(ok=False, path=event.path, reason="reader_unavailable", ticket=ticket)
    return [Answer(request, failed)]


def _drop_bad_file(state: IndexState, path: str, reason: str, *, removed: bool) -> None:
    """A read or a scrub found ``path`` ``corrupt`` or ``gone``: it leaves the index.

    NOTE: a corrupt file that could not be removed durably is still never
    offered again (every later Find would restore it and fail), but it is
    still on disk, or able to come back after a crash: it keeps counting
    toward the cap.
    """
    entry = state.entries.get(path)
    if entry is None or reason not in ("corrupt", "gone"):
        return
    _unindex(state, entry)
    if reason == "corrupt" and not removed and not state.read_only:
        _add_leftover(state, entry.path, entry.file_bytes, stuck=True)


def restore_report(state: IndexState, msg: RestoreReport) -> list[Effect]:
    """Account for a finished read: counters, estimator, LRU time, removals."""
    if msg.ok:
        state.restores += 1
        state.restore_ms_last = msg.seconds * 1000.0
        state.estimator.observe_read(msg.bytes, msg.seconds)
        entry = state.entries.get(msg.path)
        if entry is not None and msg.touched:
            entry.last_used = _tick(state)
        return []
    state.restore_failures += 1
    if msg.removed:
        state.corrupt_removed += 1
    _drop_bad_file(state, msg.path, msg.reason, removed=msg.removed)
    return []


def _landed(state: IndexState, msg: LandingReport) -> list[Effect]:
    """Account for a restore's landing in its engine turn (the staging's ``LandingReport``).

    A landed entry teaches the estimator the in-turn cost. A landing that
    found the file changed or a hash wrong is a failed restore: the file
    leaves the index, is counted as removed and is unlinked by this
    actor's workers (a leftover until they report it gone; the engine
    thread that found it does no file work). NOTE: the landing is where a
    restore checks the hashes (the reader's pass only reads ahead of it),
    so this is the usual way a bad file is found; a read-only tier only
    stops offering it.
    """
    path = msg.path
    if msg.ok:
        state.landings += 1
        state.estimator.observe_landing(msg.nbytes, msg.seconds)
        return []
    state.restore_failures += 1
    state.land_failures += 1
    entry = state.entries.get(path) if msg.corrupt else None
    if entry is None:
        return []
    if state.read_only:
        _drop_bad_file(state, path, "corrupt", removed=False)
        return [Log("ssd_cache.landing_corrupt", path)]
    _unindex(state, entry)
    _add_leftover(state, path, entry.file_bytes)
    state.corrupt_removed += 1
    return [Log("ssd_cache.landing_corrupt", path), RemoveFiles((path,), "corrupt")]


# --- scrub -------------------------------------------------------------------------


def scrub_pick(state: IndexState) -> ScrubTarget:
    """The next indexed file to re-verify: round robin in path order (none, flagged, when read-only).

    NOTE: path order, not LRU order, so every file comes up once per round
    however often restores touch some of them.
    """
    if state.read_only or not state.entries:
        return ScrubTarget(read_only=state.read_only)
    paths = sorted(state.entries)
    path = next((p for p in paths if p > state.scrub_cursor), paths[0])
    state.scrub_cursor = path
    entry = state.entries[path]
    return ScrubTarget(
        path=path, namespace=entry.namespace, tokens=entry.tokens, file_bytes=entry.file_bytes
    )


def scrub_report(state: IndexState, msg: ScrubReport) -> list[Effect]:
    """Account for a re-verified file; a bad or vanished one leaves the index."""
    if msg.ok:
        state.scrubbed += 1
        state.scrubbed_bytes += msg.bytes
        return []
    if msg.reason == "corrupt":
        state.scrubbed += 1
        state.scrub_corrupt += 1
        if msg.removed:
            state.corrupt_removed += 1
    _drop_bad_file(state, msg.path, msg.reason, removed=msg.removed)
    return []


# --- startup scan -------------------------------------------------------------------


def _load_scan(
    state: IndexState, scan: ScanResult, *, locked: bool, now: float = 0.0
) -> list[Effect]:
    """Build the index from the startup scan; decide which files go.

    Corrupt files, mismatches (another fingerprint or a namespace that does
    not hash to its directory) and temp orphans are removed and counted; of
    two files with the same tokens the newer stays; over the cap (it was
    lowered) files the scan could not read go first, then the least recently
    used. A file the scan could not read is otherwise kept and counted as a
    leftover. Every file to remove is a leftover until the shell reports it
    gone (:class:`Removed`). A read-only tier (another server holds the
    directory: ``locked`` false, or the scan could not list all of it)
    removes nothing and indexes only valid files.
    """
    if not locked:
        state.read_only = True
    state.foreign_dirs = scan.foreign_dirs
    effects: list[Effect] = []
    if scan.incomplete and not state.read_only:
        # NOTE: files the scan could not see take room the index cannot
        # count; writing on would break the cap. Restores still work.
        state.read_only = True
        effects.append(
            Log(
                "ssd_cache.scan_incomplete",
                f"a directory under {state.fingerprint_dir} could not be listed; the cold tier "
                "stores and removes nothing in this run",
            )
        )
    corrupt: list[ScannedFile] = []
    unreadable: list[ScannedFile] = []
    duplicates: list[IndexEntry] = []
    for f in scan.files:
        entry = f.entry
        if f.problem == "unreadable":
            unreadable.append(f)
            continue
        if f.problem is not None or entry is None:
            corrupt.append(f)
            continue
        if namespace_dir(entry.namespace) != os.path.basename(f.directory):
            corrupt.append(f)
            continue
        existing_path = state.by_namespace.get(entry.namespace, {}).get(entry.tokens)
        if existing_path is not None:
            existing = state.entries[existing_path]
            if (existing.last_used, existing.path) >= (entry.last_used, entry.path):
                duplicates.append(entry)
                continue
            _unindex(state, existing)
            duplicates.append(existing)
        _index(state, entry)
    state.clock = max([state.clock, *(e.last_used for e in state.entries.values())])
    if state.read_only:
        state.ready = True
        return effects
    for f in unreadable:
        _add_leftover(state, f.path, f.file_bytes)
    expired: list[str] = []
    for ck in scan.checkpoints:
        if scan.now_ns - ck.mtime_ns > CHECKPOINT_MAX_AGE_NS:
            expired.append(ck.path)
            _add_leftover(state, ck.path, ck.file_bytes)
        else:
            _count_checkpoint(state, ck.path, ck.file_bytes,
                              now - (scan.now_ns - ck.mtime_ns) / 1e9)
    state.checkpoints_expired += len(expired)
    over_cap: list[str] = []
    # NOTE: with the cap unchanged this never triggers: every removal is
    # durable before its room is reused, so a crash cannot bring back more
    # than the cap (docs/reliability.md).
    victims: list[str | IndexEntry] = [*sorted(f.path for f in unreadable), *_lru(state)]
    excess = _used(state) - _cap(state)
    for victim in victims:
        if excess <= 0:
            break
        if isinstance(victim, IndexEntry):
            _unindex(state, victim)
            _add_leftover(state, victim.path, victim.file_bytes)
            over_cap.append(victim.path)
            excess -= victim.file_bytes
        else:
            over_cap.append(victim)
            excess -= state.leftovers[victim]
    for f in corrupt:
        _add_leftover(state, f.path, f.file_bytes)
    for orphan, nbytes in itertools.zip_longest(scan.orphans, scan.orphan_bytes, fillvalue=0):
        _add_leftover(state, str(orphan), int(nbytes))
    for dup in duplicates:
        _add_leftover(state, dup.path, dup.file_bytes)
    state.evicted += len(over_cap)
    state.replaced += len(duplicates)
    state.corrupt_removed += len(corrupt)
    state.orphans_reaped += len(scan.orphans)
    for paths, reason in (
        ([f.path for f in corrupt], "corrupt"),
        (list(scan.orphans), "orphan"),
        ([d.path for d in duplicates], "duplicate"),
        (over_cap, "over_cap"),
        (expired, "checkpoint_expired"),
    ):
        if paths:
            effects.append(RemoveNow(tuple(paths), reason))
    state.ready = True
    return effects


# --- stats and dispatch ---------------------------------------------------------------


def stats(state: IndexState) -> SsdStats:
    """The stats snapshot of ``state``."""
    est = state.estimator
    return SsdStats(
        ready=state.ready,
        read_only=state.read_only,
        entries=len(state.entries),
        bytes=state.indexed_bytes + state.checkpoint_bytes,
        checkpoint_bytes=state.checkpoint_bytes,
        checkpoints_expired=state.checkpoints_expired,
        reserved_bytes=state.reserved_bytes,
        max_bytes=state.max_bytes,
        finds=state.finds,
        restores=state.restores,
        restore_failures=state.restore_failures,
        restore_ms_last=state.restore_ms_last,
        spills=state.spills,
        store_failures=state.store_failures,
        too_large=state.too_large,
        disk_full=state.disk_full,
        evicted=state.evicted,
        replaced=state.replaced,
        superseded=state.superseded,
        corrupt_removed=state.corrupt_removed,
        orphans_reaped=state.orphans_reaped,
        foreign_dirs=state.foreign_dirs,
        choices_restore=state.choices_restore,
        choices_recompute=state.choices_recompute,
        disk_read_gbps=None if est.disk_bps is None else est.disk_bps / 1e9,
        prefill_tok_s=est.prefill_tps,
        longest_entry_tokens=max((len(e.tokens) for e in state.entries.values()), default=0),
        scrubbed=state.scrubbed,
        scrubbed_bytes=state.scrubbed_bytes,
        scrub_corrupt=state.scrub_corrupt,
        leftover_files=len(state.leftovers),
        leftover_bytes=state.leftover_bytes,
        landings=state.landings,
        land_failures=state.land_failures,
    )


def index_listing(state: IndexState) -> SsdIndex:
    """Every indexed file and every leftover, in path order (``SsdIndexRequest``)."""
    entries = tuple(
        SsdIndexEntry(
            path=e.path,
            namespace=e.namespace,
            tokens=e.tokens,
            file_bytes=e.file_bytes,
            trimmable=e.trimmable,
            min_reusable_offset=e.min_reusable_offset,
        )
        for _, e in sorted(state.entries.items())
    )
    return SsdIndex(
        entries=entries,
        leftovers=tuple(sorted(state.leftovers.items())),
        jobs=tuple(sorted(state.jobs)),
    )


def _checkpoint(state: IndexState, envelope: Envelope) -> list[Effect]:
    """A checkpoint write or removal: the store worker's, unless the tier writes nothing.

    NOTE: checkpoint files are not index entries (no prefix lookup finds
    them); the store worker runs writes and removals in arrival order, so
    a completion's removal never overtakes its key's write.
    """
    body = envelope.body
    if state.read_only or not state.ready:
        if isinstance(body, Store):
            return [RefuseCheckpoint(envelope, "read_only")]
        return []
    if isinstance(body, Store):
        job_id = checkpoint_job_id(body.handle)
        if job_id in state.jobs:
            return [RefuseCheckpoint(envelope, "busy")]
        # NOTE: registered so the store worker's ReserveSpace finds it: the
        # file's size is known only once the worker has planned it.
        state.jobs[job_id] = StoreJob(job_id=job_id, request=envelope, handle=body.handle,
                                      namespace=body.namespace, tokens=body.tokens,
                                      checkpoint=True)
        return [ForwardCheckpoint(envelope, job_id)]
    return [ForwardCheckpoint(envelope)]


def _received(state: IndexState, envelope: Envelope, now: float) -> list[Effect]:
    body = envelope.body
    if isinstance(body, Find):
        return [Answer(envelope, find(state, body))]
    if isinstance(body, Covers):
        return [Answer(envelope, covers(state, body))]
    if isinstance(body, Restore):
        return restore(state, envelope, body)
    if isinstance(body, Store):
        if body.checkpoint is not None:
            return _checkpoint(state, envelope)
        return store(state, envelope, body)
    if isinstance(body, RemoveCheckpoints):
        return _checkpoint(state, envelope)
    if isinstance(body, ReserveSpace):
        return reserve(state, envelope, body)
    if isinstance(body, EntryWritten):
        return entry_written(state, envelope, body, now)
    if isinstance(body, RestoreReport):
        return restore_report(state, body)
    if isinstance(body, LandingReport):
        return _landed(state, body)
    if isinstance(body, ObservePrefill):
        state.estimator.observe_prefill(body.tokens, body.seconds)
        return []
    if isinstance(body, SsdStatsRequest):
        return [Answer(envelope, stats(state))]
    if isinstance(body, SsdIndexRequest):
        return [Answer(envelope, index_listing(state))]
    if isinstance(body, ScrubPick):
        return [*_reap_checkpoints(state, now), Answer(envelope, scrub_pick(state))]
    if isinstance(body, ScrubReport):
        return scrub_report(state, body)
    if isinstance(body, FilesRemoved):
        return _files_removed(state, body.removed, body.failed)
    raise UnknownSsdWriterMessage(f"ssd writer has no rule for {body.kind!r}")


def new_state(
    *,
    root: str,
    fingerprint: str,
    max_bytes: int,
    min_restore_tokens: int = MIN_RESTORE_TOKENS,
    always_restore: bool = False,
    report_tier: bool = False,
) -> IndexState:
    """An empty index (not ready until :class:`ScanLoaded`)."""
    return IndexState(
        root=root,
        fingerprint=fingerprint,
        max_bytes=max_bytes,
        min_restore_tokens=min_restore_tokens,
        estimator=Estimator(always_restore=always_restore),
        report_tier=report_tier,
    )


def handle(state: IndexState, event: Event) -> tuple[IndexState, list[Effect]]:
    """Apply one event to ``state``; return it with the effects to perform, in order.

    The KV-event report of the index changes the event made, if any, comes last.
    """
    effects: list[Effect]
    match event:
        case Received(envelope=envelope, now=now):
            effects = _received(state, envelope, now)
        case ScanLoaded(scan=scan, locked=locked, now=now):
            effects = _load_scan(state, scan, locked=locked, now=now)
        case WorkerGone(job_id=job_id, reason=reason):
            effects = _abandon_job(state, job_id, reason)
        case ReaderGone():
            effects = _reader_gone(state, event)
        case Removed(removed=removed, failed=failed):
            effects = _files_removed(state, removed, failed)
        case _:
            assert_never(event)
    effects.extend(_report_tier(state))
    return state, effects
