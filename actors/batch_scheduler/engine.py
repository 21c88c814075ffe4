"""What a batch step does ON the engine thread: join, cancel, step, register caches.

:class:`BatchEngine` owns the one :class:`kernels.engine.BatchGeneration` and
turns a ``SubmitStep`` into a ``StepOut`` of plain data: the lent prefixes
are materialized from the cache registry (a RAM hit) or copied from a
cold-tier hit's host buffers into MLX arrays (an SSD hit, through the same
restore the serial lane's first turn uses); a lookup that cannot be
materialized or restored is a miss: the row joins cold. Cancelled rows leave
first, the kernel steps once, and every cache a row hands back (finished,
cancelled, or a prompt-boundary snapshot) is registered so the scheduler can
``Put`` it.

The memory-pressure guard (``actors/engine_thread/memory_guard.py``) is asked
before each row's prefill (at its join) and every ``DECODE_CHECK_EVERY``
tokens of each decoding row (before the step); a row it refuses leaves the
batch alone (``RowFailure`` with ``MemoryPressure``), the others go on.

Generation checkpoints (docs/cold-tier.md): a row joined with ``checkpoint``
hands back every ``checkpoint_every`` emitted tokens an owned snapshot of its
caches, registered here (``Captured``) for the scheduler to hand to the spill
queue; a row joined with ``resume`` (a checkpoint found at admission, read
into host memory) is restored from those bytes and joins without a forward
(``BatchGeneration.join_resumed``); one that does not fit joins cold.

NOTE: every method runs ON the engine thread, one job at a time (the
scheduler never has two steps in flight), so nothing here needs a lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from actors.checkpoints import Captured, ResumeFrom
from actors.engine_thread.memory_guard import DECODE_CHECK_EVERY, MemoryGuard
from actors.engine_thread.ports import Registered
from actors.errors import MemoryPressure
from kernels import CacheRegistry, InvalidPrompt, KvScheme
from kernels.cache import (
    EntryPlan,
    KvFileHeader,
    delta_enabled,
    materialize,
    plan_entry,
    read_ahead,
    read_ahead_enabled,
    tail_starts,
)
from kernels.engine import (
    BatchGeneration,
    BlasTuning,
    CheckpointPoint,
    RowCheckpoint,
    RowExit,
    RowSnapshot,
    StepTuning,
    make_blas_tuning,
)
from messages.gateway import Generate

from .core import ExitOut, JoinRow, RowFailure, StepOut, TokenOut

__all__ = ["BatchEngine", "RestorePort", "SnapshotPoint"]

_log = structlog.get_logger("kvtier.batch")

SnapshotPoint = Callable[[Sequence[int]], int]
"""The prompt's stable boundary (tokens) for a chat request's prompt-boundary snapshot."""

RestorePort = Callable[[Generate, str, int], list[Any] | None]
"""``restore(request, staging_id, tokens)``: a cold-tier hit's staged host bytes as MLX caches
holding exactly ``request.prompt_tokens[:tokens]`` (``None``: lost, mismatched or failed: a miss).
The serial lane's restore (``MlxBackend._restore``): takes the staged entry, checks its tokens,
materializes it (each host buffer freed once copied) and trims it; engine thread only."""


@dataclass(slots=True)
class _Live:
    """A row in the kernel's batch: its request and how far the memory guard has looked."""

    request: Generate
    emitted: int = 0
    checked_at: int = 0


class BatchEngine:
    """The engine-thread half of the batch lane.

    ``registry`` ``None``: no prompt cache (rows join cold, exits are
    dropped). A chat row whose uncached prompt part is at least
    ``snapshot_min_new_tokens`` gets a prompt-boundary snapshot at
    ``snapshot_point(prompt)`` (the serial lane's rule). ``restore``: how a
    cold-tier hit becomes MLX caches (``None``: no cold tier; such a row
    joins cold). ``guard``: the memory-pressure guard's in-step checks.
    ``kv_scheme``: the server's KV scheme (quantizing: transitioning rows).
    ``blas_tuning``: let the decode steps choose their BLAS thread count by
    measuring them (``kernels.engine._blas_threads``; CPU with OpenBLAS only);
    the choice outlives each batch. ``checkpoint_every``: emitted tokens
    between a checkpointed row's snapshots (0: none; needs ``registry``).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_rows: int,
        prefill_step_size: int,
        prefill_budget: int | None = None,
        registry: CacheRegistry | None = None,
        snapshot_point: SnapshotPoint | None = None,
        snapshot_min_new_tokens: int = 64,
        restore: RestorePort | None = None,
        guard: MemoryGuard | None = None,
        kv_scheme: KvScheme | None = None,
        blas_tuning: bool = False,
        checkpoint_every: int = 0,
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        self._every = checkpoint_every if registry is not None else 0
        self._model = model
        self._tokenizer = tokenizer
        self._max_rows = max_rows
        self._step_size = prefill_step_size
        self._budget = prefill_budget
        self._registry = registry
        self._point = snapshot_point
        self._snapshot_min = snapshot_min_new_tokens
        self._restore = restore
        self._guard = guard
        self._scheme = kv_scheme
        self._batch: BatchGeneration | None = None
        self._tune = blas_tuning
        self._tuning: StepTuning | None = None
        self._live: dict[str, _Live] = {}
        self.steps_run = 0
        # NOTE: where host reads migrate (CUDA) and KVTIER_CHECKPOINT_READ_AHEAD is not off,
        # a step's checkpoints are read back together (_read_ahead); each row's
        # previous checkpoint's plan header gives the next one's delta tails.
        self._read_ahead = self._every > 0 and read_ahead_enabled()
        self._ck_headers: dict[str, KvFileHeader] = {}

    def _kernel(self) -> BatchGeneration:
        if self._batch is None:
            if self._tune and self._tuning is None:
                self._tuning = make_blas_tuning()
                _log.info("batch.blas_tuning", enabled=self._tuning is not None)
            self._batch = BatchGeneration(
                self._model,
                self._tokenizer,
                max_rows=self._max_rows,
                prefill_step_size=self._step_size,
                prefill_budget=self._budget,
                kv_scheme=self._scheme,
                tuning=self._tuning,
            )
        return self._batch

    def blas_stats(self) -> dict[str, int] | None:
        """The BLAS thread tuning's state (``threads`` now, ``trials``, ``skipped``, ``switches``), ``None`` while off.

        NOTE: read from the loop; plain ints written by the engine thread (atomic under the GIL).
        """
        tuning = self._tuning
        if not isinstance(tuning, BlasTuning):
            return None
        c = tuning.chooser
        return {
            "threads": tuning.threads,
            "chosen": c.current,
            "trials": c.trials,
            "skipped": c.skipped,
            "switches": c.switches,
        }

    def idle(self) -> bool:
        """Whether the kernel's batch holds no row (a chain has nothing left to step); engine thread."""
        return self._batch is None or self._batch.idle

    def step(self, joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
        """Cancel, join, step once; register what rows hand back."""
        began = time.perf_counter()
        try:
            batch = self._kernel()
            exits: list[ExitOut] = []
            failed: list[RowFailure] = []
            for rid in cancels:
                if rid in batch:
                    gone = batch.cancel(rid)
                    self._live.pop(rid, None)
                    exits.append(
                        ExitOut(rid, "cancelled", gone.completion_tokens, self._keep(gone))
                    )
            joined: list[tuple[str, int]] = []
            resumed: list[tuple[str, int]] = []
            restored: list[str] = []
            restore_failed: list[str] = []
            # NOTE: the joins (landings, prefix copies) are not prefill; the
            # scheduler leaves their time out of the prefill speed it reports.
            joins_began = time.perf_counter()
            # NOTE: the joins' prefill runs in the step below, after every
            # check: each join is checked beside the demand of those before it,
            # and (the guard's ledger, published at the last step's end) beside
            # what the requests already running may still grow by (the reading
            # shows their KV so far only): admitting a row must not leave a
            # running one short later, when its decode check would fail it
            # mid-answer. A join refused so ends with MemoryShortAtStart: the
            # engine API takes it back to admission, where a relief can run.
            pending = 0
            # NOTE: one settle a step: a second refusal in the same step finds
            # nothing more freed (each settle clears MLX's cache and trims the heap).
            settles = self._guard.settled if self._guard is not None else 0
            for join in joins:
                rid = join.request.request_id
                fresh = self._guard is None or self._guard.settled == settles
                refusal, demand = self._refused_before_prefill(join, pending, fresh)
                if refusal is not None:
                    failed.append(refusal)
                    continue
                replayed = (
                    self._resume(batch, join, pending)
                    if isinstance(join.resume, ResumeFrom) else None
                )
                pending += demand
                if replayed is not None:
                    resumed.append((rid, replayed))
                if replayed is not None and replayed >= 0:
                    cached, outcome = len(join.request.prompt_tokens), "resumed"
                else:
                    cached, outcome = self._join(batch, join)
                self._live[rid] = _Live(join.request, emitted=max(0, replayed or 0))
                joined.append((rid, cached))
                if outcome == "restored":
                    restored.append(rid)
                elif outcome == "restore_failed":
                    restore_failed.append(rid)
            join_s = time.perf_counter() - joins_began
            failed.extend(self._decode_checks(batch))
            result = batch.step()
            self.steps_run += 1
            violated = self._grammar_failures(batch, result.exits, failed)
            # NOTE: what the rows really reuse: a group aligning its suffixes
            # re-forwards the last few lent tokens of its shorter rows.
            left = {e.row_id: e.cached_tokens for e in result.exits}
            joined = [
                (rid, batch.reused(rid) if rid in batch else left.get(rid, cached))
                for rid, cached in joined
            ]
            for t in result.tokens:
                if (live := self._live.get(t.row_id)) is not None:
                    live.emitted = t.index + 1
            for e in result.exits:
                self._live.pop(e.row_id, None)
            self._publish_growth()
            tokens = tuple(
                TokenOut(
                    t.row_id,
                    t.index,
                    t.output.token_id,
                    t.output.text,
                    t.output.logprob,
                    t.output.finish_reason,
                    t.output.top_logprobs,
                )
                for t in result.tokens
                if t.row_id not in violated
            )
            exits.extend(
                ExitOut(e.row_id, e.reason, e.completion_tokens, self._keep(e))
                for e in result.exits
                if e.row_id not in violated
            )
            snapshots: list[tuple[str, Registered]] = []
            for snap in result.snapshots:
                entry = self._keep(snap)
                if entry is not None:
                    snapshots.append((snap.row_id, entry))
            captured = [
                (c.row_id, cap) for c in result.checkpoints if (cap := self._captured(c)) is not None
            ]
            if self._read_ahead:
                self._read_checkpoints_ahead(captured)
            return StepOut(
                tokens=tokens,
                exits=tuple(exits),
                snapshots=tuple(snapshots),
                joined=tuple(joined),
                prefilled=result.joined,
                decode_rows=result.decode_rows,
                prefill_tokens=result.prefill_tokens,
                restored=tuple(restored),
                restore_failed=tuple(restore_failed),
                failed=tuple(failed),
                join_s=join_s,
                checkpoints=tuple(captured),
                resumed=tuple(resumed),
                step_s=time.perf_counter() - began,
                since_clear=result.since_clear,
                cleared=result.cleared,
                cleared_bytes=result.cleared_bytes,
                clear_s=result.clear_s,
            )
        except BaseException:
            # NOTE: a failed forward leaves the batch's arrays in an unknown
            # state; the scheduler fails every joined row, so start afresh.
            self.reset()
            raise
        finally:
            if self._registry is not None:
                self._registry.drain()

    def reset(self) -> None:
        """Drop the kernel's batch (and every row's arrays), on the engine thread."""
        if self._batch is not None:
            self._batch.close()
        self._batch = None
        self._live.clear()
        self._publish_growth()

    def _publish_growth(self) -> None:
        """Tell the guard's ledger what the rows in the batch may still add, to their ``max_tokens``.

        NOTE: once a step, at its end (the rows it joined included): the next
        step's joins and the serial lane's openings are checked beside it.
        """
        if self._guard is not None:
            self._guard.publish_growth("batch", (
                (live.request, len(live.request.prompt_tokens) + live.emitted)
                for live in self._live.values()))

    def _refused_before_prefill(self, join: JoinRow, pending: int,
                                settle: bool) -> tuple[RowFailure | None, int]:
        """The guard's check before a row's prefill beside ``pending`` bytes of this step's earlier
        joins (``settle``: it may settle memory first): the refusal (``None``: it fits, or no
        guard) and the demand it counted."""
        if self._guard is None:
            return None, 0
        try:
            demand = self._guard.before_prefill(join.request, join.cached_tokens, pending,
                                                settle)
        except MemoryPressure as exc:
            # NOTE: before the restore: an SSD hit's host bytes stay staged and
            # go when the scheduler releases the row's lease.
            return RowFailure(join.request.request_id, type(exc).__name__, str(exc)), 0
        return None, demand

    def _grammar_failures(self, batch: BatchGeneration, exits: Sequence[Any],
                          failed: list[RowFailure]) -> frozenset[str]:
        """Rows whose grammar failed in the step just run: removed alone, each a ``RowFailure``.

        NOTE: their token of this step was sampled from unmasked logits: the
        caller drops it (and an exit it caused); the cache is dropped, the
        other rows go on. The serial lane fails such a request at the same
        point (``GrammarViolation``).
        """
        violations = batch.grammar_violations()
        if not violations:
            return frozenset()
        left = {e.row_id for e in exits}
        for rid, detail in violations:
            if rid not in left:
                batch.cancel(rid)
            self._live.pop(rid, None)
            failed.append(RowFailure(rid, "GrammarViolation", detail))
        return frozenset(rid for rid, _ in violations)

    def _decode_checks(self, batch: BatchGeneration) -> list[RowFailure]:
        """Every ``DECODE_CHECK_EVERY`` tokens of a decoding row, ask the guard (before the step).

        NOTE: before the step, so a refusal loses no produced token; a refused
        row leaves the batch alone and its cache is dropped (not kept: the
        memory is what is short).
        """
        guard = self._guard
        if guard is None:
            return []
        failed: list[RowFailure] = []
        for rid in batch.decoding:
            live = self._live.get(rid)
            if live is None or not live.emitted or live.emitted % DECODE_CHECK_EVERY:
                continue
            if live.checked_at == live.emitted:
                continue
            live.checked_at = live.emitted
            request = live.request
            try:
                guard.during_decode(request, len(request.prompt_tokens) + live.emitted)
            except MemoryPressure as exc:
                batch.cancel(rid)
                self._live.pop(rid, None)
                failed.append(RowFailure(rid, MemoryPressure.__name__, str(exc)))
        return failed

    def _resume(self, batch: BatchGeneration, join: JoinRow, pending: int) -> int:
        """Join ``join``'s row from its checkpoint: tokens it replays, or -1 (it does not fit: join cold).

        NOTE: the host bytes become MLX arrays here, in the batch step the row
        joins (as an SSD hit's landing). The memory guard sees the whole
        covered length before the copy.
        """
        request = join.request
        found = join.resume
        ck = found.header.checkpoint
        try:
            if ck is None:
                raise InvalidPrompt("not a checkpoint file")
            if self._guard is not None:
                self._guard.before_prefill(request, len(request.prompt_tokens), pending)
            caches = materialize(found.header, found.host, consume=True)
            point = CheckpointPoint(ck.prompt_len, tuple(found.header.tokens[ck.prompt_len:]),
                                    ck.pending_token, ck.rng_key)
            batch.join_resumed(request.request_id, request.prompt_tokens, request.params,
                               cache=caches, point=point,
                               checkpoint_every=self._every if join.checkpoint else 0)
        except Exception as exc:  # noqa: BLE001 - NOTE: a checkpoint that does not fit is a cold join.
            _log.warning("checkpoint.resume_failed", request_id=request.request_id,
                         path=found.path, error=repr(exc))
            return -1
        return len(point.generated)

    def _read_checkpoints_ahead(self, captured: Sequence[tuple[str, Captured]]) -> None:
        """Read a step's checkpoints back to host memory in one read-back, kept with their handles.

        NOTE: the rows of a batch reach their checkpoint boundaries in the
        same step; on CUDA one read-back for all of them (one gather, one copy
        to managed memory) instead of one per views turn measured 1.13 x
        checkpoints off at 8 streams on an H100, against 0.95 x. Each read holds the tails
        after the row's previous checkpoint here (a delta on that file, as the
        store writes it when that file is the answer's base); the views turn
        takes it only when its own plan and base ask for exactly those bytes
        (``kernels.cache.read_fits``), else it reads as before. The read's
        host bytes live with the registry entry until that turn takes them or
        the entry is disposed (a checkpoint the spill queue drops): MLX's
        memory, which the memory guard's reading counts, but not the spill
        queue's byte budget, which bills the entry's own bytes.
        """
        registry = self._registry
        assert registry is not None
        for rid in [r for r in self._ck_headers if r not in self._live]:
            del self._ck_headers[rid]
        if not captured:
            return
        plans: list[tuple[str, EntryPlan, dict[int, int]]] = []
        try:
            for row_id, cap in captured:
                # NOTE: the tensors and their cuts depend only on the caches and
                # the tokens; the identity fields are the header's, not read here.
                plan = plan_entry(registry.get(cap.handle), model_id="", fingerprint="",
                                  namespace="", tokenizer_hash="", tokens=cap.tokens)
                prev = self._ck_headers.get(row_id) if delta_enabled() else None
                tails = tail_starts(plan.header, prev) if prev is not None else {}
                self._ck_headers[row_id] = plan.header
                plans.append((cap.handle, plan, tails))
            reads = read_ahead([(plan, tails) for _, plan, tails in plans])
        except Exception as exc:  # noqa: BLE001 - NOTE: an optimisation: the views turn reads instead.
            _log.warning("checkpoint.read_ahead_failed", error=repr(exc))
            return
        finally:
            for _, plan, _ in plans:
                plan.release_arrays()
        for (handle, _, _), read in zip(plans, reads, strict=True):
            registry.attach_read(handle, read)

    def _captured(self, ck: RowCheckpoint) -> Captured | None:
        """Register a row's checkpoint snapshot (``None``: it cannot be kept; a lost restart point)."""
        if self._registry is None:
            return None
        try:
            reg = self._registry.register(ck.cache, offset=len(ck.cache_tokens))
        except Exception as exc:  # noqa: BLE001 - NOTE: a checkpoint is an optimisation.
            _log.warning("checkpoint.capture_failed", request_id=ck.row_id, error=repr(exc))
            return None
        return Captured(reg.handle, reg.meta, ck.cache_tokens, ck.prompt_len, ck.pending_token,
                        ck.rng_key, writer=ck.row_id)

    def _join(self, batch: BatchGeneration, join: JoinRow) -> tuple[int, str]:
        """Join one row with its lent prefix; (prompt tokens reused, how: ram/restored/restore_failed/cold)."""
        request = join.request
        cache: list[Any] | None = None
        cached = 0
        outcome = "cold"
        if join.staging_id is not None and join.cached_tokens > 0:
            cache = self._restored(join)
            if cache is not None:
                cached, outcome = join.cached_tokens, "restored"
            else:
                outcome = "restore_failed"
        elif join.handle is not None and join.cached_tokens > 0 and self._registry is not None:
            try:
                cache = self._registry.materialize(join.handle, join.cached_tokens)
                cached, outcome = join.cached_tokens, "ram"
            except Exception as exc:  # noqa: BLE001 - NOTE: a cache-tier failure is a miss.
                _log.warning("prompt_cache.materialize_failed", handle=join.handle, error=repr(exc))
        snapshot_at = self._snapshot_at(request.prompt_tokens, request.snapshots_prompt, cached)
        try:
            batch.join(
                request.request_id,
                request.prompt_tokens,
                request.params,
                cache=cache,
                cached_tokens=cached,
                snapshot_at=snapshot_at,
                checkpoint_every=self._every if join.checkpoint else 0,
            )
        except InvalidPrompt as exc:
            # NOTE: a lent cache the batch cannot take (a layer kind it cannot
            # merge, an offset that disagrees) is a miss: the row joins cold.
            if cache is None:
                raise
            _log.warning("batch.join_cold", request_id=request.request_id, error=repr(exc))
            cached = 0
            outcome = "restore_failed" if outcome == "restored" else "cold"
            batch.join(
                request.request_id,
                request.prompt_tokens,
                request.params,
                snapshot_at=self._snapshot_at(request.prompt_tokens, request.snapshots_prompt, 0),
                checkpoint_every=self._every if join.checkpoint else 0,
            )
        return cached, outcome

    def _restored(self, join: JoinRow) -> list[Any] | None:
        """A cold-tier hit's host bytes as MLX caches of ``cached_tokens`` tokens (``None``: a miss).

        NOTE: the copy into MLX arrays happens here, inside the batch step
        the row joins (an engine turn of the batch lane, never a background
        one), as the serial lane does in the request's first turn.
        """
        assert join.staging_id is not None
        if self._restore is None:
            _log.warning("ssd_cache.restore_unavailable", staging_id=join.staging_id)
            return None
        try:
            return self._restore(join.request, join.staging_id, join.cached_tokens)
        except Exception as exc:  # noqa: BLE001 - NOTE: a cache-tier failure is a miss.
            _log.warning(
                "ssd_cache.materialize_failed", staging_id=join.staging_id, error=repr(exc)
            )
            return None

    def _snapshot_at(self, prompt: Sequence[int], snapshots: bool, cached: int) -> int | None:
        if self._registry is None or self._point is None or not snapshots:
            return None
        if len(prompt) - cached < self._snapshot_min:
            return None
        point = min(self._point(prompt), len(prompt) - 1)
        return point if point > cached else None

    def _keep(self, row: RowExit | RowSnapshot) -> Registered | None:
        """Register a row's cache for the prompt cache (``None``: no cache, or it cannot be kept)."""
        if self._registry is None or not row.cache_tokens or not row.cache:
            return None
        try:
            reg = self._registry.register(row.cache, offset=len(row.cache_tokens))
        except Exception as exc:  # noqa: BLE001 - NOTE: keeping an entry is an optimisation.
            _log.warning("prompt_cache.register_failed", request_id=row.row_id, error=repr(exc))
            return None
        return Registered(reg.handle, reg.meta, tuple(row.cache_tokens[: reg.meta.offset]))
