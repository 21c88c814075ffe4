"""What ``Engine.start`` builds before the actors run: the model, the RAM and SSD tiers' parts,
the memory guard, the engine thread's executor; then the actor system and the wiring.

Every MLX call here runs ON the engine thread (``thread.run``); file-system
checks run on worker threads. ``kernels`` is imported inside the functions,
so that ``import actors.engine`` stays cheap for tools that only need the
types (the HTTP app's unit tests, ``kvtier replay``).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import structlog

from actors.engine_thread import Backend, BackgroundSteps
from actors.engine_thread.memory_guard import MemoryGauge, MemoryGuard, stated_margin
from actors.runtime import ActorSystem

from . import wiring
from .config import ConfigError, EngineConfig
from .memory import HeapTrim, ProcessMemory

if TYPE_CHECKING:
    from actors.backend import MlxBackend
    from actors.ssd_writer import ColdTier, FileIdentity, HostStaging
    from kernels import CacheRegistry, EngineThread, KvScheme, ModelIdentity
    from kernels.cache import FilePort
    from kernels.model import FusionReport

__all__ = [
    "ModelParts",
    "Running",
    "SamplingExecutor",
    "context_limit",
    "load_model",
    "release_mlx_state",
    "start",
]

T = TypeVar("T")

_log = structlog.get_logger("kvtier.engine")


@dataclass(frozen=True, slots=True)
class ModelParts:
    """The served model: the mlx-lm module and tokenizer (the engine thread owns the module),
    its identity and context length.

    ``model``/``tokenizer``: mlx-lm's module and ``TokenizerWrapper`` (their
    libraries ship no types). ``identity`` ``None``: given a loaded model
    without one (no SSD tier then). ``fusion``: ``kernels.FusionReport`` of a
    model the Engine loaded. ``max_context`` ``None``: not checked.
    """

    model: object
    tokenizer: object
    model_id: str
    identity: ModelIdentity | None = None
    fusion: FusionReport | None = None
    max_context: int | None = None
    path: Path | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """What :func:`start` built: the actor system and its wiring, and the parts the Engine keeps."""

    system: ActorSystem
    wired: wiring.Wired
    registry: CacheRegistry | None
    cold: ColdTier | None
    guard: MemoryGuard | None


def context_limit(config: Mapping[str, Any]) -> int | None:
    """The model's context length from its ``config.json`` (``None``: it names none)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model(model_arg: str | Path | None, config: EngineConfig) -> ModelParts:
    """Load ``model_arg`` (``None``: the default model) ON the engine thread."""
    import kernels

    path = model_arg if model_arg is not None else kernels.ensure_default_model()
    # NOTE: before anything is computed: the weights, the tiers' buffers and the
    # memory defaults (configure_mlx_memory) follow the device chosen here.
    kernels.select_device(config.device)
    if config.tensor_parallel:
        from actors.distributed import load_shard

        # NOTE: every rank of the mlx.launch group loads its shard now (docs/tensor-parallel.md).
        loaded = load_shard(path)
    else:
        loaded = kernels.load_model(path)
        fusion = loaded.fusion
        if fusion is not None and fusion.few_row_status:
            # NOTE: one line says whether one-token CPU steps use kvtier's few-row
            # product, and why not (docs/batching.md "Few-row products (CPU)").
            _log.info("engine.few_row", products=fusion.few_row, status=fusion.few_row_status)
        if fusion is not None and fusion.few_row_status:
            # NOTE: the same for CPU attention's native softmax (docs/operations.md);
            # its status is decided at load, on the CPU only (as the few-row product's).
            from kernels.native import softmax_status

            _log.info("engine.native_softmax", status=softmax_status())
        if kernels.model.compiled_decode_of(loaded.model) is not None:
            # NOTE: an opt-in switch (KVTIER_COMPILED_DECODE): say it took.
            _log.info("engine.compiled_decode", status="on")
    return ModelParts(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_id=loaded.identity.name if model_arg is None else str(model_arg),
        identity=loaded.identity,
        fusion=loaded.fusion,
        max_context=context_limit(loaded.config),
        path=loaded.path,
    )


class SamplingExecutor:
    """An ``Executor`` that reads the memory in use at the end of every engine job (engine thread).

    ``heap`` runs first: it trims the C heap when MLX has freed enough since
    the last trim, so the reading after it is what the process holds.

    A loop-only port the turn runner and the batch lane share: it holds no
    state of its own; :meth:`submit` is called on the event loop and the
    engine thread runs the jobs one at a time in submission order.
    """

    def __init__(self, inner: EngineThread, gauge: MemoryGauge | None, heap: HeapTrim) -> None:
        self._inner = inner
        self._gauge = gauge
        self._heap = heap

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` on the engine thread, followed by a memory reading."""
        gauge, heap = self._gauge, self._heap

        def job() -> T:
            try:
                return fn(*args)
            finally:
                heap.after_job()
                if gauge is not None:
                    gauge.sample()

        future: asyncio.Future[T] = self._inner.submit(job)
        return future


@dataclass(frozen=True, slots=True)
class _ColdSettings:
    """Where and under which fingerprint the SSD tier keeps its files."""

    root: str
    identity: FileIdentity
    max_bytes: int
    staging: HostStaging


async def _cold_settings(
    thread: EngineThread, config: EngineConfig, identity: ModelIdentity | None, scheme: KvScheme
) -> _ColdSettings | None:
    """The SSD tier's directory, file identity and cap (``None``: tier off)."""
    if config.ssd_cache is None:
        return None
    if identity is None:
        raise ConfigError(
            "the SSD tier (ssd_cache) needs the model's identity to key its files; "
            "pass identity= to Engine.from_loaded, or leave ssd_cache off"
        )
    from actors.backend import runtime_identity
    from actors.ssd_writer import (
        FileIdentity,
        HostStaging,
        check_tier_dirs,
        cold_fingerprint,
        default_max_bytes,
    )
    from kernels import UntrustedPath
    from kernels.cache import FORMAT_VERSION

    runtime = await thread.run(runtime_identity)
    fingerprint = cold_fingerprint(
        model=identity.fingerprint,
        kv_scheme=scheme.cache_key,
        runtime=runtime,
        format_version=FORMAT_VERSION,
    )
    root = await anyio.to_thread.run_sync(os.path.expanduser, str(config.ssd_cache))
    try:
        # NOTE: files others could plant there would be served as this model's KV.
        await anyio.to_thread.run_sync(check_tier_dirs, root, fingerprint)
    except UntrustedPath as exc:
        raise ConfigError(f"the SSD tier cannot use {root}: {exc}") from exc
    max_bytes = config.ssd_cache_max_bytes
    if max_bytes is None:
        max_bytes = await anyio.to_thread.run_sync(default_max_bytes, root)
    return _ColdSettings(
        root=root,
        identity=FileIdentity(
            model_id=str(identity.model_id),
            fingerprint=fingerprint,
            tokenizer_hash=str(identity.tokenizer_hash),
        ),
        max_bytes=max_bytes,
        staging=HostStaging(max_entries=config.ssd_staging_entries),
    )


async def _memory_guard(
    thread: EngineThread, model: object, scheme: KvScheme, config: EngineConfig
) -> tuple[MemoryGuard, ProcessMemory] | None:
    """The memory-pressure guard: budget, the model's footprint, a first reading (engine thread)."""
    from kernels import device_used_bytes, on_cuda
    from kernels.cache import UnsupportedCacheKind

    from .memory import (
        default_budget_bytes,
        mlx_cache_limit_bytes,
        mlx_memory_parts,
        model_footprint,
        settle_memory,
    )

    budget = config.memory_budget_bytes
    if budget is None:
        budget = await thread.run(default_budget_bytes)
    try:
        footprint = await thread.run(model_footprint, model, scheme, config.prefill_step_size)
    except (UnsupportedCacheKind, ValueError) as exc:
        # NOTE: a cache kind the geometry does not know: serve without the guard, say so.
        _log.warning("engine.memory_guard_off", reason=repr(exc))
        return None
    # NOTE: the reading's start figures, on the engine thread, once what
    # loading freed has left RSS (memory.py: ProcessMemory).
    await thread.run(settle_memory)
    # NOTE: under CUDA the device's memory in use by every process is one more
    # floor of the reading (another process on the card takes from the budget).
    device = device_used_bytes if await thread.run(on_cuda) else None
    reading = await thread.run(functools.partial(ProcessMemory, parts=mlx_memory_parts,
                                                 device=device))
    gauge = MemoryGauge(reading.read)
    await thread.run(gauge.sample)
    margin = stated_margin(await thread.run(mlx_cache_limit_bytes))
    guard = MemoryGuard(budget=budget, footprint=footprint, gauge=gauge, settle=settle_memory,
                        margin=margin)
    return guard, reading


def _warm_wanted(setting: str) -> bool:
    """``--warm-up``: on, off, or (auto) where MLX computes on CUDA (engine thread)."""
    import kernels

    return setting == "on" or (setting == "auto" and kernels.on_cuda())


async def _warm_up(thread: EngineThread, loaded: ModelParts, config: EngineConfig,
                   scheme: KvScheme) -> None:
    """Run ``kernels.engine.warm_up`` before the actors start, where ``--warm-up`` asks for it.

    NOTE: not under tensor parallelism: every rank must run the same
    engine-thread calls in step (``actors.distributed``), and this pass is
    rank 0's alone.
    """
    import kernels.engine

    if config.tensor_parallel or not await thread.run(_warm_wanted, config.warm_up):
        return
    try:
        report = await thread.run(
            functools.partial(kernels.engine.warm_up, loaded.model, loaded.tokenizer, kv_scheme=scheme,
                              prefill_step_size=config.prefill_step_size)
        )
    except Exception:
        # NOTE: not hidden: the start fails with the pass's error; the line says
        # how to start without the pass (its rows are ones the batch lane serves).
        _log.error("engine.warm_up_failed", hint="--warm-up off (KVTIER_WARM_UP=off) starts without it")
        raise
    _log.info("engine.warm_up", skipped=report.skipped, steps=report.steps, rows=report.rows,
              warm_rows=report.warm_rows, seconds=round(report.seconds, 3))


def _backend(
    loaded: ModelParts, config: EngineConfig, scheme: KvScheme, registry: CacheRegistry | None,
    staging: HostStaging | None,
) -> MlxBackend:
    from actors.backend import MlxBackend

    return MlxBackend(
        loaded.model,
        loaded.tokenizer,
        prefill_step_size=config.prefill_step_size,
        kv_scheme=scheme,
        registry=registry,
        staging=staging,
    )


async def start(
    thread: EngineThread,
    loaded: ModelParts,
    config: EngineConfig,
    steps: BackgroundSteps,
    *,
    file_port: FilePort | None = None,
) -> Running:
    """Configure MLX, build the tiers' parts and the guard, enter an actor system and spawn the wiring.

    Runs in the task that will later close the system (``Engine.start``).
    """
    import kernels

    limit = config.mlx_cache_limit_bytes
    weights = await thread.run(kernels.weights_bytes, loaded.model) if limit is None else 0
    await thread.run(
        functools.partial(
            kernels.configure_mlx_memory, cache_limit_bytes="default" if limit is None else limit,
            weights_bytes=weights,
        )
    )
    scheme = kernels.resolve_kv_scheme(config.kv_quant, loaded.path, missing_config="error")
    # NOTE: refuse a scheme this model's cache cannot take now, not in every request.
    await thread.run(kernels.cache.check_kv_scheme, loaded.model, scheme)
    await _warm_up(thread, loaded, config, scheme)
    cap = config.prompt_cache_bytes
    if cap is None:
        cap = kernels.default_prompt_cache_bytes(await thread.run(kernels.prompt_cache_room_bytes))
    registry = kernels.CacheRegistry() if cap > 0 else None
    cold = (
        await _cold_settings(thread, config, loaded.identity, scheme)
        if registry is not None else None
    )
    backend: Backend = _backend(loaded, config, scheme, registry,
                            None if cold is None else cold.staging)
    if config.tensor_parallel:
        from actors.distributed import lead

        # NOTE: every engine-thread call is mirrored to the other ranks.
        backend = await thread.run(lead, backend, registry)
    memory = await _memory_guard(thread, loaded.model, scheme, config)
    guard, reading = (None, None) if memory is None else memory
    # NOTE: freed MLX buffers stay in the C heap until trimmed (memory.py: HeapTrim).
    heap = HeapTrim()
    system = ActorSystem()
    await system.__aenter__()
    try:
        tier = None
        source = None
        cloner = None
        if cold is not None and registry is not None:
            from actors.durability import RegistryCloner

            tier, source = wiring.cold_tier(
                config,
                root=cold.root,
                identity=cold.identity,
                max_bytes=cold.max_bytes,
                system=system,
                steps=steps,
                caches=registry,
                staging=cold.staging,
                port=file_port,
            )
            cloner = RegistryCloner(registry)
        identity = loaded.identity
        parts = wiring.Parts(
            config=config,
            # NOTE: every engine job reads the memory in use when it ends, on
            # the engine thread, for the memory actor's check before admission.
            executor=SamplingExecutor(thread, None if guard is None else guard.gauge, heap),
            memory_guard=guard,
            backend=backend,
            registry=registry,
            prompt_cache_bytes=cap,
            steps=steps,
            cold=tier,
            tensor_source=source,
            cloner=cloner,
            after_step=heap.after_job,
            memory_reading=reading,
            heap_trim=heap,
            # NOTE: the KV events' block-hash namespace (docs/scale-out.md).
            kv_identity=(
                identity.fingerprint if identity is not None else f"model-id:{loaded.model_id}",
                scheme.cache_key,
            ),
        )
        wired = wiring.start(system, parts)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await system.__aexit__(None, None, None)
        raise
    return Running(system=system, wired=wired, registry=registry, cold=tier, guard=guard)


def release_mlx_state(registry: CacheRegistry | None) -> None:
    """Dispose and drop every registry entry, then collect MLX memory (engine thread, at close)."""
    if registry is not None:
        for handle in list(registry.entries()):
            registry.dispose(handle)
        registry.drain()
    from kernels import release_mlx_memory

    release_mlx_memory()
