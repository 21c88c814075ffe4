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


@dataclass(slots=True)
class _Gen:
    request: Generate
    state: Any
    cached_tokens: int
    decoded: int = 0
    checked_at: int = 0


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
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._guard = guard
        self._keep = keep_entries
        self._snapshot_min = snapshot_min_new_tokens
        self._gens: dict[str, _Gen] = {}
        self.decode_steps = 0

    def step(self, request_id: str, opening: Opening | None) -> StepOutput:
        """One prefill chunk or decode step of ``request_id`` (opening its generation first if asked)."""
        backend = self._backend
        try:
            cached: int | None = None
            open_s = 0.0
            guard = self._guard
            if opening is not None:
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
                self._gens[request_id] = _Gen(opening.request, state, cached)
            gen = self._gens[request_id]
            if guard is not None and gen.decoded and gen.decoded % DECODE_CHECK_EVERY == 0 \
                    and gen.checked_at != gen.decoded:
                # NOTE: before the step, so a refusal loses no produced token.
                gen.checked_at = gen.decoded
                guard.during_decode(gen.request, len(gen.request.prompt_tokens) + gen.decoded)
            result = backend.step(gen.state)
            entries: list[tuple[EntryRole, Registered]] = []
            if result.phase == "decode":
                self.decode_steps += 1
                gen.decoded += 1
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
            return StepOutput(result, tuple(entries), cached, open_s)
        finally:
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
            backend.end_turn()

    def _wants_snapshot(self, gen: _Gen) -> bool:
        request = gen.request
        new_tokens = len(request.prompt_tokens) - gen.cached_tokens
        return self._keep and request.chat and new_tokens >= self._snapshot_min

    @staticmethod
    def _cache_call(what: str, gen: _Gen, fn: Callable[[Any], Registered | None]) -> Registered | None:
        # NOTE: keeping an entry is an optimisation: a failure here is a future
        # miss, never a failed request (the tokens were already produced).
        try:
            return fn(gen.state)
        except Exception as exc:  # noqa: BLE001
            _log.warning(f"prompt_cache.{what}_failed", request_id=gen.request.request_id, error=repr(exc))
            return None
