"""The MLX backend of request turns: ``kernels.Generation`` driven one step per turn.

Every method runs ON the engine thread (the turn runner submits them through
``kernels.EngineThread``); nothing here is called from the event loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from actors.engine_thread.ports import Registered, StepResult, StepToken
from kernels import (
    CacheRegistry,
    Generation,
    KvScheme,
    convert_caches,
)
from kernels.cache import (
    CacheNotTrimmable,
    CacheOffsetMismatch,
    KvFileHeader,
    caches_trimmable,
    materialize,
    snapshot_cuttable,
    trim_caches,
)
from kernels.engine import SnapshotBoundary, probe_snapshot_boundary
from kernels.engine._blas_threads import serial_threads
from kernels.engine._checkpoint import (
    CheckpointPoint,
    checkpoint_point,
    replay_step,
    resume_generation,
)
from messages.gateway import Generate

_log = structlog.get_logger("kvtier.backend")

__all__ = ["MlxBackend", "RestoredEntries", "StagedEntryLike", "runtime_identity"]


class StagedEntryLike(Protocol):
    """A restored file waiting for its turn (``actors.ssd_writer.StagedEntry``): checked, held open."""

    @property
    def header(self) -> KvFileHeader:
        """The file's validated header."""
        ...


class RestoredEntries(Protocol):
    """Where restored entries wait (``actors.ssd_writer.HostStaging``); thread-safe."""

    def take(self, staging_id: str) -> StagedEntryLike | None:
        """Remove and return the entry (``None``: unknown, taken or pushed out); the taker owns it."""
        ...

    def land(self, entry: Any, *, step: int = 256) -> list[Any]:
        """Read a taken entry straight into MLX arrays and build its caches; closes its file."""
        ...

    def release(self, entry: Any) -> None:
        """Close a taken entry's file off this thread (idempotent)."""
        ...


def runtime_identity() -> str:
    """The runtime's numerical identity: MLX version, device type and architecture (engine thread).

    NOTE: part of the cold tier's fingerprint: KV computed by another MLX
    release or on another device may differ in its last bits, so a runtime
    change selects a new directory instead of reusing old files.
    """
    import mlx.core as mx

    device = mx.default_device()
    info = mx.device_info()
    arch = info.get("architecture", "unknown") if isinstance(info, dict) else "unknown"
    version = getattr(mx, "__version__", "unknown")
    return f"mlx-{version}/{device.type}/{arch}"


class MlxBackend:
    """Opens and steps ``kernels.Generation`` objects; registers their caches for the prompt cache.

    Chat requests get a snapshot point: the prompt's stable boundary, found by
    probing the chat template once (``kernels.probe_snapshot_boundary``, with
    the template's default options; points before the prompt's last token
    come from templates with a generation tail that history renders
    differently, e.g. a thinking opener). The step whose chunk reaches it reports
    ``snapshot_point`` so the runner snapshots the prompt the next turn will
    repeat. Where every layer can be cut back exactly
    (``kernels.cache.snapshot_cuttable``: plain or quantized KV, no KV
    scheme converting during the prefill) the chunk runs past the point and
    the snapshot is cut to it; otherwise (rotating rings, recurrent state,
    a converting scheme) the chunk ends exactly there.
    NOTE: an early chunk end is a second forward over the whole prefix:
    on the H200 (8B shape) a row's 24-token join over a cached 5,100 took
    47-49 ms with a snapshot point inside against 18-20 ms without.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        prefill_step_size: int,
        kv_scheme: KvScheme | None = None,
        registry: CacheRegistry | None = None,
        staging: RestoredEntries | None = None,
        snapshot_boundary: SnapshotBoundary | None = None,
    ) -> None:
        """``snapshot_boundary``: the chat template's, when known (else probed on first use)."""
        self._model = model
        self._staging = staging
        self.restores = 0
        self.restore_failures = 0
        self._tokenizer = tokenizer
        self._step_size = prefill_step_size
        self._scheme = kv_scheme if kv_scheme is not None and kv_scheme.quantized else None
        self._registry = registry
        self._boundary = snapshot_boundary
        # NOTE: (snapshot point, prompt length, cut) per open chat generation;
        # weak so a generation dropped by any path leaves nothing behind.
        self._points: weakref.WeakKeyDictionary[Generation, tuple[int, int, bool]] = (
            weakref.WeakKeyDictionary()
        )

    def snapshot_boundary(self) -> SnapshotBoundary:
        """The chat template's probed boundary (probed on first use; tokenizer work only)."""
        if self._boundary is None:
            self._boundary = probe_snapshot_boundary(self._tokenizer)
        return self._boundary

    # --- what the batch lane serves the same model with (read once, at wiring) ---

    @property
    def model(self) -> Any:
        """The loaded model both lanes run."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self._tokenizer

    @property
    def registry(self) -> CacheRegistry | None:
        """The engine-owned cache registry the prompt cache's entries live in (``None``: no RAM tier)."""
        return self._registry

    @property
    def prefill_step_size(self) -> int:
        """Tokens per prefill chunk."""
        return int(self._step_size)

    @property
    def kv_scheme(self) -> KvScheme | None:
        """The quantized KV scheme caches are converted to (``None``: the model's dtype)."""
        return self._scheme

    def restore_port(self) -> Callable[[Generate, str, int], list[Any] | None] | None:
        """The first turn's restore of a cold-tier hit (``None``: no cold tier).

        NOTE: the batch lane restores exactly like the serial lane (the same
        token and trim checks, the same landing, the same restore counters),
        so it borrows this method rather than keep a second copy of those rules.
        """
        return self._restore if self._staging is not None else None

    def _hook(self, caches: list[Any]) -> None:
        assert self._scheme is not None
        convert_caches(caches, self._scheme)

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> Generation:
        """A generation for ``request``; its first ``cached_tokens`` come from ``handle`` (RAM)
        or from the restored SSD entry under ``staging_id``, if given."""
        cache: list[Any] | None = None
        if staging_id is not None and cached_tokens > 0:
            cache = self._restore(request, staging_id, cached_tokens)
            if cache is None:
                cached_tokens = 0
        elif handle is not None and cached_tokens > 0 and self._registry is not None:
            try:
                cache = self._registry.materialize(handle, cached_tokens)
            except Exception as exc:  # noqa: BLE001 - NOTE: a cache-tier failure is a miss.
                _log.warning("prompt_cache.materialize_failed", handle=handle, error=repr(exc))
                cache, cached_tokens = None, 0
        else:
            cached_tokens = 0
        gen = Generation(
            self._model,
            self._tokenizer,
            request.prompt_tokens,
            request.params,
            prefill_step_size=self._step_size,
            cache=cache,
            cached_tokens=cached_tokens,
            cache_hook=self._hook if self._scheme is not None else None,
        )
        if request.chat and self._registry is not None:
            point = self.snapshot_boundary().stable_prefix(request.prompt_tokens)
            if point > cached_tokens:
                cut = self._scheme is None and snapshot_cuttable(gen.cache)
                self._points[gen] = (point, len(request.prompt_tokens), cut)
        return gen

    def _restore(self, request: Generate, staging_id: str, tokens: int) -> list[Any] | None:
        """The restored entry's caches holding exactly the prompt's first ``tokens`` (or ``None``).

        The checked, open file is read straight into MLX arrays here (plain
        KV with step-rounded slack, every byte hashed again in the memory the
        arrays own; ``kernels.cache.land_entry``), then the caches are
        trimmed to ``tokens``. The file is closed on every path. Any failure
        is a miss.
        """
        staging = self._staging
        staged = staging.take(staging_id) if staging is not None else None
        if staging is None or staged is None:
            self.restore_failures += 1
            _log.warning("ssd_cache.restore_lost", staging_id=staging_id)
            return None
        try:
            return self._land(staging, staged, request, staging_id, tokens)
        finally:
            # NOTE: a no-op after a landing (it released the file); on the
            # refusal paths this closes it, on a landing thread.
            staging.release(staged)

    def _land(
        self,
        staging: RestoredEntries,
        staged: StagedEntryLike,
        request: Generate,
        staging_id: str,
        tokens: int,
    ) -> list[Any] | None:
        header = staged.header
        # NOTE: the index matched these tokens; checking again is cheap and a
        # mismatch would mean KV of other tokens, never to be served.
        if header.tokens[:tokens] != request.prompt_tokens[:tokens] or tokens > len(header.tokens):
            self.restore_failures += 1
            _log.warning("ssd_cache.restore_mismatch", staging_id=staging_id)
            return None
        extra = len(header.tokens) - tokens
        if extra > 0 and (not header.trimmable or tokens < header.min_reusable_offset):
            self.restore_failures += 1
            _log.warning("ssd_cache.restore_untrimmable", staging_id=staging_id)
            return None
        try:
            caches = staging.land(staged)
            if extra > 0:
                if not caches_trimmable(caches):
                    raise ValueError("a restored layer cannot be trimmed")
                trim_caches(caches, extra)
        except Exception as exc:  # noqa: BLE001 - NOTE: a cache-tier failure is a miss.
            self.restore_failures += 1
            _log.warning("ssd_cache.materialize_failed", staging_id=staging_id, error=repr(exc))
            return None
        self.restores += 1
        return caches

    def step(self, gen: Generation) -> StepResult:
        """One prefill chunk while prompt tokens remain, else one decode step.

        A chat prompt's chunk never runs past its snapshot point; the step
        that ends there reports ``snapshot_point=True``.
        """
        # NOTE: on the process's default BLAS thread count, whatever the batch
        # lane chose for its steps: the same request gives the same bits
        # (a resumed checkpoint continues exactly as the uninterrupted run).
        serial_threads()
        if not gen.prefill_done:
            forwarded = gen.prefill_remaining > 1
            target = self._points.get(gen)
            limit: int | None = None
            held = 0
            if target is not None:
                point, length, cut = target
                held = length - gen.prefill_remaining
                limit = point - held if point > held and not cut else None
            done = gen.prefill_step(limit)
            if forwarded:
                reached = target is not None and \
                    held < target[0] <= target[1] - gen.prefill_remaining
                return StepResult(phase="prefill", prefill_complete=done, snapshot_point=reached)
            # NOTE: nothing was left to prefill (prompt suffix of one token):
            # do not waste a turn; decode right away.
        # NOTE: a resumed generation first replays its saved tokens (no
        # forward); otherwise this is ``gen.decode_step()``.
        out = replay_step(gen)
        return StepResult(
            phase="decode",
            token=StepToken(out.token_id, out.text, out.logprob, out.top_logprobs,
                            out.prompt_logprobs),
            finish_reason=out.finish_reason,
        )

    def resume(self, request: Generate, header: KvFileHeader, host: Any) -> Generation:
        """A generation resumed from a checkpoint file's header and host bytes (``ResumeFrom``).

        Raises (``InvalidPrompt``, ``CacheFileCorrupt``, ...) when the file
        does not fit the request; the caller then opens a fresh generation.
        """
        ck = header.checkpoint
        if ck is None:
            raise ValueError("not a checkpoint file")
        caches = materialize(header, host, consume=True)
        point = CheckpointPoint(ck.prompt_len, header.tokens[ck.prompt_len:], ck.pending_token,
                                ck.rng_key)
        return resume_generation(
            self._model, self._tokenizer, request.prompt_tokens, request.params, caches, point,
            prefill_step_size=self._step_size,
            cache_hook=self._hook if self._scheme is not None else None,
        )

    def forget_staged(self, staging_id: str) -> None:
        """Close the restored SSD entry ``staging_id`` (a resumed request does not land it)."""
        staging = self._staging
        staged = staging.take(staging_id) if staging is not None else None
        if staging is not None and staged is not None:
            staging.release(staged)

    def capture_checkpoint(self, gen: Generation) -> tuple[CheckpointPoint, Registered] | None:
        """An owned snapshot of ``gen``'s caches at its checkpoint boundary (``None``: none now).

        NOTE: the registry's snapshot is a clone the live generation never
        writes into again, so the SSD writer may read it in later idle turns.
        """
        if self._registry is None:
            return None
        point = checkpoint_point(gen)
        if point is None:
            return None
        tokens = (*gen.prompt_tokens, *point.generated)
        try:
            reg = self._registry.snapshot(gen.cache, offset=len(tokens))
        except CacheOffsetMismatch as exc:
            _log.warning("checkpoint.snapshot_refused", error=str(exc))
            return None
        return point, Registered(reg.handle, reg.meta, tuple(tokens))

    def snapshot(self, gen: Generation) -> Registered | None:
        """Register a prompt-only clone of the live cache (the prompt-boundary snapshot).

        A chunk that ran past the snapshot point (cut caches) is cut back to it.
        """
        if self._registry is None:
            return None
        tokens = gen.cache_tokens
        target = self._points.get(gen)
        keep = target[0] if target is not None and target[2] and target[0] < len(tokens) else None
        try:
            reg = self._registry.snapshot(gen.cache, offset=len(tokens), tokens=keep)
        except (CacheOffsetMismatch, CacheNotTrimmable) as exc:
            _log.warning("prompt_cache.snapshot_refused", error=str(exc))
            return None
        return Registered(reg.handle, reg.meta, tokens if keep is None else tokens[:keep])

    def register(self, gen: Generation) -> Registered | None:
        """Hand the live cache to the registry as an entry (``None`` if it holds nothing)."""
        if self._registry is None or not gen.cache_tokens:
            return None
        covered = gen.cache_tokens
        try:
            # NOTE: the registry compares every layer's real offset with the
            # token record; a disagreement is never indexed (a future miss).
            reg = self._registry.register(gen.cache, offset=len(covered))
        except CacheOffsetMismatch as exc:
            _log.warning("prompt_cache.register_refused", error=str(exc))
            return None
        return Registered(reg.handle, reg.meta, covered)

    def discard(self, gen: Generation) -> None:
        """Nothing to keep: the caller drops its reference here, on the engine thread."""

    def end_turn(self) -> None:
        """Drop arrays of handles the prompt cache disposed since the last turn."""
        if self._registry is not None:
            self._registry.drain()
