"""What the turn runner's engine jobs do ON the engine thread.

:class:`EngineWork` keeps each started request's generation state (the
backend's object, by request id) and performs the three kinds of request
work: a step (opening the generation on the first one), keeping a stopped
request's cache as a prompt-cache entry, and dropping it.

NOTE: every method runs ON the engine thread, one job at a time (the runner
never has two jobs in flight), so ``_gens`` needs no lock; the loop reads
only ``decode_steps`` (an int, atomic to read).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from actors.checkpoints import Captured, CheckpointBackend
from actors.engine_thread.memory_guard import DECODE_CHECK_EVERY, MemoryGuard
from actors.engine_thread.ports import Backend, Registered
from messages.gateway import Generate
from messages.prompt_cache import EntryRole

from .burst import StepOutput

__all__ = ["EngineWork", "Opening"]

_log = structlog.get_logger("kvtier.gateway")


@dataclass(frozen=True, slots=True)
class Opening:
    """How a request's first step opens its generation: the request and the lookup to materialize.

    ``handle``: a RAM entry; ``staging_id``: restored bytes of an SSD entry
    (waiting in host memory); either way its first ``cached_tokens`` are reused.
    """

    request: Generate
    handle: str | None = None
    cached_tokens: int = 0
    staging_id: str | None = None
    checkpoint: bool = False
    """Take generation checkpoints of this request (it has a key)."""
    resume: Any = None
    """A found checkpoint (``actors.checkpoints.ResumeFrom``) to resume instead of a fresh open."""


@dataclass(slots=True)
class _Gen:
    request: Generate
    state: Any
    cached_tokens: int
    decoded: int = 0
    checked_at: int = 0
    checkpoint: bool = False
    resumed_at: int = -1


class EngineWork:
    """The engine-thread half of the runner over a :class:`~actors.engine_thread.ports.Backend`.

    ``keep_entries``: a prompt cache takes registered entries (else a
    finished request's arrays are simply dropped). A chat request whose
    prefill completes with at least ``snapshot_min_new_tokens`` uncached
    prompt tokens also registers a prompt-boundary snapshot. ``guard``
    (the memory-pressure guard) is asked before a request's generation opens
    and every ``DECODE_CHECK_EVERY`` decode tokens; it raises
    ``MemoryPressure``, which fails the request like any failed step.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        keep_entries: bool,
        snapshot_min_new_tokens: int = 64,
        guard: MemoryGuard | None = None,
        clock: Callable[[], float] = time.perf_counter,
        checkpoint_every: int = 0,
    ) -> None:
        self._backend = backend
        # NOTE: generation checkpoints need a backend that can take and resume them.
        self._ckpt = backend if checkpoint_every > 0 and isinstance(backend, CheckpointBackend) \
            else None
        self._every = checkpoint_every
        self._clock = clock
        self._guard = guard
        self._keep = keep_entries
        self._snapshot_min = snapshot_min_new_tokens
        self._gens: dict[str, _Gen] = {}
        self.decode_steps = 0

    def _publish_growth(self) -> None:
        """Tell the guard's ledger what this lane's open requests may still add, to their ``max_tokens``.

        NOTE: after every step and drop: the batch lane's joins are checked
        beside it (and this lane's openings beside the batch's figure).
        """
        if self._guard is not None:
            self._guard.publish_growth("serial", (
                (gen.request, len(gen.request.prompt_tokens) + gen.decoded)
                for gen in self._gens.values()))

    def step(self, request_id: str, opening: Opening | None) -> StepOutput:
        """One prefill chunk or decode step of ``request_id`` (opening its generation first if asked)."""
        backend = self._backend
        try:
            cached: int | None = None
            open_s = 0.0
            resumed: int | None = None
            guard = self._guard
            if opening is not None and opening.resume is not None and self._ckpt is not None:
                resumed = self._resume(request_id, opening)
            if opening is not None and resumed is not None and resumed >= 0:
                cached = len(opening.request.prompt_tokens)
            elif opening is not None:
                if guard is not None:
                    guard.before_prefill(opening.request, opening.cached_tokens)
                opened_at = self._clock()
                if opening.staging_id is not None:
                    # NOTE: the restored bytes become MLX arrays here, inside
                    # the request's own first turn (never in a background one).
                    state = backend.open(
                        opening.request, None, opening.cached_tokens, staging_id=opening.staging_id
                    )
                else:
                    reuse = opening.cached_tokens if opening.handle else 0
                    state = backend.open(opening.request, opening.handle, reuse)
                # NOTE: the opening is not prefill; the runner leaves it out
                # of the prefill speed it reports (a restored request too).
                open_s = max(0.0, self._clock() - opened_at)
                # NOTE: the backend may have fallen back to a cold prefill; report what it reused.
                cached = int(state.cached_tokens)
                self._gens[request_id] = _Gen(opening.request, state, cached,
                                              checkpoint=opening.checkpoint)
            gen = self._gens[request_id]
            if guard is not None and gen.decoded and gen.decoded % DECODE_CHECK_EVERY == 0 \
                    and gen.checked_at != gen.decoded:
                # NOTE: before the step, so a refusal loses no produced token.
                gen.checked_at = gen.decoded
                guard.during_decode(gen.request, len(gen.request.prompt_tokens) + gen.decoded)
            result = backend.step(gen.state)
            entries: list[tuple[EntryRole, Registered]] = []
            captured: Captured | None = None
            if result.phase == "decode":
                self.decode_steps += 1
                gen.decoded += 1
                if gen.checkpoint and result.finish_reason is None \
                        and gen.decoded % self._every == 0 and gen.decoded != gen.resumed_at:
                    captured = self._capture(gen)
            point = result.prefill_complete if result.snapshot_point is None else result.snapshot_point
            if point and self._wants_snapshot(gen):
                snap = self._cache_call("snapshot", gen, backend.snapshot)
                if snap is not None:
                    entries.append(("snapshot", snap))
            if result.finish_reason is not None:
                del self._gens[request_id]
                if self._keep:
                    entry = self._cache_call("register", gen, backend.register)
                    if entry is not None:
                        entries.append(("completion", entry))
                else:
                    # NOTE: nobody would own a registered entry: drop the arrays here.
                    backend.discard(gen.state)
            return StepOutput(result, tuple(entries), cached, open_s, captured, resumed)
        finally:
            self._publish_growth()
            backend.end_turn()

    def drop(self, request_id: str, *, keep: bool) -> Registered | None:
        """End ``request_id``'s generation: register its cache as an entry (``keep``) or free it."""
        backend = self._backend
        gen = self._gens.pop(request_id, None)
        try:
            if gen is None:
                return None
            if keep and self._keep:
                return self._cache_call("register", gen, backend.register)
            backend.discard(gen.state)
            return None
        finally:
            self._publish_growth()
            backend.end_turn()

    def _resume(self, request_id: str, opening: Opening) -> int:
        """Resume ``opening``'s checkpoint: tokens it replays, or -1 (unusable: open fresh)."""
        ckpt = self._ckpt
        assert ckpt is not None
        found = opening.resume
        try:
            if self._guard is not None:
                self._guard.before_prefill(opening.request, len(opening.request.prompt_tokens))
            state = ckpt.resume(opening.request, found.header, found.host)
        except Exception as exc:  # noqa: BLE001 - NOTE: a checkpoint that does not fit is a fresh run.
            _log.warning("checkpoint.resume_failed", request_id=opening.request.request_id,
                         path=found.path, error=repr(exc))
            return -1
        if opening.staging_id is not None:
            ckpt.forget_staged(opening.staging_id)
        emitted = int(found.emitted)
        self._gens[request_id] = _Gen(opening.request, state, len(opening.request.prompt_tokens),
                                      checkpoint=opening.checkpoint, resumed_at=emitted)
        return emitted

    def _capture(self, gen: _Gen) -> Captured | None:
        ckpt = self._ckpt
        assert ckpt is not None
        # NOTE: a checkpoint is an optimisation: a failure here is a lost
        # restart point, never a failed request.
        try:
            taken = ckpt.capture_checkpoint(gen.state)
        except Exception as exc:  # noqa: BLE001
            _log.warning("checkpoint.capture_failed", request_id=gen.request.request_id,
                         error=repr(exc))
            return None
        if taken is None:
            return None
        point, reg = taken
        return Captured(reg.handle, reg.meta, reg.tokens, point.prompt_len, point.pending_token,
                        point.rng_key, writer=gen.request.request_id)

    def _wants_snapshot(self, gen: _Gen) -> bool:
        request = gen.request
        new_tokens = len(request.prompt_tokens) - gen.cached_tokens
        return self._keep and request.snapshots_prompt and new_tokens >= self._snapshot_min

    @staticmethod
    def _cache_call(what: str, gen: _Gen, fn: Callable[[Any], Registered | None]) -> Registered | None:
        # NOTE: keeping an entry is an optimisation: a failure here is a future
        # miss, never a failed request (the tokens were already produced).
        try:
            return fn(gen.state)
        except Exception as exc:  # noqa: BLE001
            _log.warning(f"prompt_cache.{what}_failed", request_id=gen.request.request_id, error=repr(exc))
            return None
