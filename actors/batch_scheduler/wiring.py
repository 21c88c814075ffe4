"""How the engine's wiring builds the batch lane (``actors/engine/wiring.py`` calls these).

:func:`batch_refusal` decides whether the batch lane exists: ``max_batch``
above 1 and the model's cache kinds and KV scheme passing the batching gates
(``kernels.engine.batch_gate``). :func:`batch_factory` builds the scheduler
from the engine's ``Parts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from actors.checkpoints import CheckpointPort
from actors.engine_thread import BackgroundSteps, Executor
from actors.engine_thread.memory_guard import MemoryGuard
from kernels import CacheRegistry, KvScheme
from kernels.engine import blas_tune_enabled, model_batch_gate

from .actor import BatchScheduler
from .engine import BatchEngine, RestorePort

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig

__all__ = ["BATCH_ADDRESS", "Parts", "batch_factory", "batch_refusal"]

BATCH_ADDRESS = "batch"

_log = structlog.get_logger("kvtier.batch")


class Parts(Protocol):
    """What the batch lane is built from: the engine wiring's ``Parts`` has each of these.

    NOTE: a protocol, so this package does not import the engine's wiring
    (which imports it).
    """

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        ...

    @property
    def backend(self) -> object:
        """The serial lane's backend (the batch lane serves only ``MlxBackend``)."""
        ...

    @property
    def executor(self) -> Executor:
        """The engine thread."""
        ...

    @property
    def cold(self) -> object | None:
        """The cold tier (``None``: none)."""
        ...

    @property
    def memory_guard(self) -> MemoryGuard | None:
        """The in-turn memory checks (``None``: none)."""
        ...

    @property
    def after_step(self) -> Callable[[], object] | None:
        """Runs on the engine thread after every batch step."""
        ...

    @property
    def steps(self) -> BackgroundSteps:
        """The background-step registry (steps the gateway lends to a running chain)."""
        ...


def _backend_parts(
    backend: object,
) -> tuple[Any, Any, CacheRegistry | None, int, KvScheme | None] | None:
    """Model, tokenizer, registry, prefill step and KV scheme of the MLX backend (``None``: another backend)."""
    from actors.backend.mlx import MlxBackend

    if not isinstance(backend, MlxBackend):
        return None
    return (
        backend.model,
        backend.tokenizer,
        backend.registry,
        backend.prefill_step_size,
        backend.kv_scheme,
    )


def _restore_port(backend: object) -> RestorePort | None:
    """The serial lane's restore of a cold-tier hit (``None``: no cold tier on this backend)."""
    from actors.backend.mlx import MlxBackend

    return backend.restore_port() if isinstance(backend, MlxBackend) else None


def _observe_address(parts: Parts) -> str | None:
    """Where measured prefills go: the cold tier's index (``None``: no cold tier)."""
    from actors.ssd_writer import SSD_WRITER_ADDRESS

    return SSD_WRITER_ADDRESS if parts.cold is not None else None


def batch_refusal(parts: Parts) -> str | None:
    """Why the batch lane is off for these parts (``None``: it is on)."""
    cfg = parts.config
    if cfg.max_batch <= 1:
        return "max_batch=1"
    found = _backend_parts(parts.backend)
    if found is None:
        return "backend_not_mlx"
    model, _, _, _, scheme = found
    gate = model_batch_gate(model, scheme)
    if gate.refusal is not None:
        _log.warning("batch.refused", reason=gate.refusal, detail=gate.detail)
        return gate.refusal
    return None


def batch_factory(
    parts: Parts,
    *,
    gateway: str,
    prompt_cache: str | None,
    checkpoints: CheckpointPort | None = None,
) -> Callable[[], BatchScheduler] | None:
    """The batch scheduler's factory (``None`` when :func:`batch_refusal` says no).

    ``checkpoints``: generation checkpoints of batch rows (``None``: off; they
    need the prompt cache's registry, which owns the snapshots).
    """
    if batch_refusal(parts) is not None:
        return None
    found = _backend_parts(parts.backend)
    assert found is not None
    model, tokenizer, registry, step, scheme = found
    cfg = parts.config
    backend = parts.backend
    point = backend.snapshot_boundary if hasattr(backend, "snapshot_boundary") else None
    engine = BatchEngine(
        model,
        tokenizer,
        max_rows=cfg.max_batch,
        prefill_step_size=step,
        prefill_budget=cfg.prefill_budget or step,
        registry=registry if prompt_cache is not None else None,
        snapshot_point=None if point is None else (lambda prompt: point().stable_prefix(prompt)),
        snapshot_min_new_tokens=cfg.snapshot_min_new_tokens,
        restore=_restore_port(backend) if prompt_cache is not None else None,
        guard=parts.memory_guard,
        kv_scheme=scheme,
        blas_tuning=blas_tune_enabled(),
        checkpoint_every=checkpoints.every if checkpoints is not None and registry is not None
        and prompt_cache is not None else 0,
    )
    scheduler = BatchScheduler(
        gateway=gateway,
        executor=parts.executor,
        engine=engine,
        max_rows=cfg.max_batch,
        max_queue=cfg.max_queue,
        prompt_cache=prompt_cache,
        # NOTE: with a cold tier, steps that only prefilled teach its
        # restore-or-recompute estimator (the serial lane reports per request).
        observe_prefill=_observe_address(parts),
        after_step=parts.after_step,
        stream_write_timeout_s=cfg.stream_write_timeout_s,
        gather_s=cfg.batch_gather_s,
        checkpoints=checkpoints if registry is not None and prompt_cache is not None else None,
        steps=parts.steps,
    )
    # NOTE: "resume" keeps this one instance (its rows) when a handler raises.
    return lambda: scheduler
