"""What a batch step does ON the engine thread: join, cancel, step, register caches.

:class:`BatchEngine` owns the one :class:`kernels.engine.BatchGeneration` and
turns a ``SubmitStep`` into a ``StepOut`` of plain data: the lent prefixes
are materialized from the cache registry (a lookup that cannot be
materialized is a miss: the row joins cold), cancelled rows leave first, the
kernel steps once, and every cache a row hands back (finished, cancelled, or
a prompt-boundary snapshot) is registered so the scheduler can ``Put`` it.

NOTE: every method runs ON the engine thread, one job at a time (the
scheduler never has two steps in flight), so nothing here needs a lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog

from actors.gateway.ports import Registered
from kernels import CacheRegistry, InvalidPrompt
from kernels.engine import BatchGeneration, RowExit, RowSnapshot

from .core import ExitOut, JoinRow, StepOut, TokenOut

__all__ = ["BatchEngine", "SnapshotPoint"]

_log = structlog.get_logger("kvtier.batch")

SnapshotPoint = Callable[[Sequence[int]], int]
"""The prompt's stable boundary (tokens) for a chat request's prompt-boundary snapshot."""


class BatchEngine:
    """The engine-thread half of the batch lane.

    ``registry`` ``None``: no prompt cache (rows join cold, exits are
    dropped). A chat row whose uncached prompt part is at least
    ``snapshot_min_new_tokens`` gets a prompt-boundary snapshot at
    ``snapshot_point(prompt)`` (the serial lane's rule).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_rows: int,
        prefill_step_size: int,
        registry: CacheRegistry | None = None,
        snapshot_point: SnapshotPoint | None = None,
        snapshot_min_new_tokens: int = 64,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._max_rows = max_rows
        self._step_size = prefill_step_size
        self._registry = registry
        self._point = snapshot_point
        self._snapshot_min = snapshot_min_new_tokens
        self._batch: BatchGeneration | None = None
        self.steps_run = 0

    def _kernel(self) -> BatchGeneration:
        if self._batch is None:
            self._batch = BatchGeneration(
                self._model,
                self._tokenizer,
                max_rows=self._max_rows,
                prefill_step_size=self._step_size,
            )
        return self._batch

    def step(self, joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
        """Cancel, join, step once; register what rows hand back."""
        try:
            batch = self._kernel()
            exits: list[ExitOut] = []
            for rid in cancels:
                if rid in batch:
                    gone = batch.cancel(rid)
                    exits.append(
                        ExitOut(rid, "cancelled", gone.completion_tokens, self._keep(gone))
                    )
            joined = [(join.request.request_id, self._join(batch, join)) for join in joins]
            result = batch.step()
            self.steps_run += 1
            tokens = tuple(
                TokenOut(
                    t.row_id,
                    t.index,
                    t.output.token_id,
                    t.output.text,
                    t.output.logprob,
                    t.output.finish_reason,
                )
                for t in result.tokens
            )
            exits.extend(
                ExitOut(e.row_id, e.reason, e.completion_tokens, self._keep(e))
                for e in result.exits
            )
            snapshots: list[tuple[str, Registered]] = []
            for snap in result.snapshots:
                entry = self._keep(snap)
                if entry is not None:
                    snapshots.append((snap.row_id, entry))
            return StepOut(
                tokens=tokens,
                exits=tuple(exits),
                snapshots=tuple(snapshots),
                joined=tuple(joined),
                prefilled=result.joined,
                decode_rows=result.decode_rows,
                prefill_tokens=result.prefill_tokens,
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

    def _join(self, batch: BatchGeneration, join: JoinRow) -> int:
        request = join.request
        cache: list[Any] | None = None
        cached = 0
        if join.handle is not None and join.cached_tokens > 0 and self._registry is not None:
            try:
                cache = self._registry.materialize(join.handle, join.cached_tokens)
                cached = join.cached_tokens
            except Exception as exc:  # noqa: BLE001 - NOTE: a cache-tier failure is a miss.
                _log.warning("prompt_cache.materialize_failed", handle=join.handle, error=repr(exc))
        snapshot_at = self._snapshot_at(request.prompt_tokens, request.chat, cached)
        try:
            batch.join(
                request.request_id,
                request.prompt_tokens,
                request.params,
                cache=cache,
                cached_tokens=cached,
                snapshot_at=snapshot_at,
            )
        except InvalidPrompt as exc:
            # NOTE: a lent cache the batch cannot take (a layer kind it cannot
            # merge, an offset that disagrees) is a miss: the row joins cold.
            if cache is None:
                raise
            _log.warning("batch.join_cold", request_id=request.request_id, error=repr(exc))
            cached = 0
            batch.join(
                request.request_id,
                request.prompt_tokens,
                request.params,
                snapshot_at=self._snapshot_at(request.prompt_tokens, request.chat, 0),
            )
        return cached

    def _snapshot_at(self, prompt: Sequence[int], chat: bool, cached: int) -> int | None:
        if self._registry is None or self._point is None or not chat:
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
