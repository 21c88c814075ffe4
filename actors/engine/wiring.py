"""The ONE place that spawns and supervises kvtier's actors.

:data:`ACTORS` is the table: for each actor its address, how to build it
from the engine's :class:`Parts`, its mailbox size, its supervision policy
and the statistics ask ``/stats`` sends it. :func:`start` spawns the table in
order (the runtime stops actors in reverse order, so an actor is listed
after those it sends to). Adding an actor means: its folder under
``actors/`` (core + shell), its message module under ``messages/``, and one
``ActorSpec`` here.

Statistics are asked, not read: :meth:`Wired.stats` sends each actor its
stats request with a short deadline (``EngineConfig.stats_timeout_s``), all
at once, so ``/stats`` answers within one deadline even when an actor is busy
(the turn runner answers only between turns); an actor that did not answer
is listed under ``unavailable`` instead of holding the response.

Tests spawn single actors through the same specs (:func:`spawn_prompt_cache`,
:func:`spawn_spill_queue`, :func:`spawn_ssd_writer`), so they run with
production's mailbox size and supervision.

The cold tier (``EngineConfig.ssd_cache`` set) adds five actors in front of
the prompt cache: the SSD index and its store, read and scrub workers
(``actors/ssd_writer``) and the spill queue (``actors/spill_queue``). They
share one :class:`~actors.ssd_writer.ColdTier`, built by the engine before
the wiring starts (:func:`cold_tier`), and the prompt cache then spills to
the queue, asks the index in ``Take`` and demotes idle entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from actors.batch_scheduler import BATCH_ADDRESS, batch_factory, batch_refusal
from actors.checkpoints import CheckpointCounters, CheckpointHandoff, CheckpointPort, checkpoint_dir
from actors.durability import (
    DURABILITY_ADDRESS,
    Cloner,
    DurabilityConfig,
    DurabilityCoordinator,
    DurabilityState,
    DurabilityTargets,
)
from actors.durability.ports import Alarm, GatewaySteps, StepRegistry
from actors.engine_thread import Backend, BackgroundSteps, Executor
from actors.engine_thread.memory_guard import MemoryGuard
from actors.gateway import Gateway, GatewayTurns, TurnRunner
from actors.gateway.core import DEFAULT_BACKGROUND_SHARE
from actors.kv_events import KV_EVENTS_ADDRESS, KvEvents
from actors.kv_events import core as kv_events_core
from actors.memory import (
    MEMORY_ADDRESS,
    AdmissionCheck,
    GuardGauges,
    MemoryActor,
    MemoryConfig,
    MemoryState,
    MemoryTargets,
)
from actors.memory.ports import HeapTrims, Reading
from actors.prompt_cache import DRAIN_STEP, PROMPT_CACHE_ADDRESS, HandleDisposer, PromptCache
from actors.prompt_cache import core as prompt_cache_core
from actors.runtime import Actor, ActorRef, ActorSystem, RuntimeFailure, Supervision
from actors.spill_queue import SPILL_QUEUE_ADDRESS, HandleReleaser, SpillQueue
from actors.spill_queue import core as spill_queue_core
from actors.ssd_writer import (
    SSD_WRITER_ADDRESS,
    CacheSource,
    ColdTier,
    EngineTensorSource,
    FileIdentity,
    HostStaging,
    IndexKeep,
    IoRunner,
    Reader,
    RearmingTurns,
    Scrubber,
    SsdWriter,
    SsdWriterConfig,
    StoreWorker,
    TensorSource,
    build_cold_tier,
)
from kernels.cache import FilePort
from messages import (
    Body,
    DurabilityStats,
    DurabilityStatsRequest,
    PromptCacheStats,
    PromptCacheStatsRequest,
    Request,
    SpillQueueStats,
    SpillQueueStatsRequest,
    SsdStats,
    SsdStatsRequest,
)
from messages.batch_scheduler import BatchStats, BatchStatsRequest
from messages.gateway import GatewayStats, GatewayStatsRequest, RunnerStats, RunnerStatsRequest
from messages.kv_events import KvEventsStats, KvEventsStatsRequest
from messages.memory import MemoryStats, MemoryStatsRequest

from .config import EngineConfig
from .memory import release_freed_memory

__all__ = [
    "ACTORS",
    "DURABILITY",
    "GATEWAY",
    "KV_EVENTS",
    "MEMORY",
    "MEMORY_RELEASE_STEP",
    "MEMORY_SETTLE_STEP",
    "PROMPT_CACHE",
    "RUNNER",
    "SCRUB_GATE_STEP",
    "SPILL_QUEUE",
    "SSD_READ",
    "SSD_SCRUB",
    "SSD_STORE",
    "SSD_WRITER",
    "ActorSpec",
    "Parts",
    "StatsAsk",
    "Wired",
    "cold_tier",
    "spawn_durability",
    "spawn_prompt_cache",
    "spawn_spill_queue",
    "spawn_ssd_writer",
    "start",
]

GATEWAY = "gateway"
RUNNER = "gateway.runner"
PROMPT_CACHE = PROMPT_CACHE_ADDRESS
SSD_WRITER = SSD_WRITER_ADDRESS
SSD_STORE = f"{SSD_WRITER}.store"
SSD_READ = f"{SSD_WRITER}.read"
SSD_SCRUB = f"{SSD_WRITER}.scrub"
SPILL_QUEUE = SPILL_QUEUE_ADDRESS
DURABILITY = DURABILITY_ADDRESS
KV_EVENTS = KV_EVENTS_ADDRESS
MEMORY = MEMORY_ADDRESS

MEMORY_SETTLE_STEP = "memory.settle"
"""A standing background step: drop freed memory the guard's reading still counts."""

MEMORY_RELEASE_STEP = "memory.release"
"""A standing background step: drop released arrays (the registry's drain), then freed memory."""

SCRUB_INTERVAL_S = 60.0
"""The idle scrubber re-verifies one stored file per minute (at most 32 MiB/s on average)."""

SCRUB_GATE_STEP = "ssd_writer.scrub_gate"
"""A standing no-op background step: its grant tells the scrubber the engine is idle."""


@dataclass(frozen=True, slots=True)
class Parts:
    """What the actors are built from; ``Engine.start`` makes them.

    ``registry`` ``None`` means the prompt cache is off (``prompt_cache_bytes``
    is then ignored); the cold tier needs it (``EngineConfig`` refuses
    ``--prompt-cache 0`` with ``--ssd-cache``). ``steps`` is the turn runner's background-step registry
    (the ``Engine`` registers ``run_when_idle`` callables there and keeps the
    typed handles; docs/engine-turn.md).
    """

    config: EngineConfig
    executor: Executor
    backend: Backend
    registry: HandleDisposer | None
    prompt_cache_bytes: int
    steps: BackgroundSteps = field(default_factory=BackgroundSteps)
    cold: ColdTier | None = None
    """The cold tier's shared state (:func:`cold_tier`); ``None``: no cold tier."""
    tensor_source: TensorSource | None = None
    """The store worker's tensor read-backs (:func:`cold_tier`); with ``cold``."""
    cloner: Cloner | None = None
    """Clones RAM entries for write-behind snapshots (``RegistryCloner``); with ``cold``."""
    memory_guard: MemoryGuard | None = None
    """The in-turn memory-pressure checks (``actors/engine_thread/memory_guard.py``); ``None``: none."""
    after_step: Callable[[], object] | None = None
    """Runs on the engine thread after every batch step (``memory.HeapTrim.after_job``)."""
    memory_reading: Reading | None = None
    """The guard's reading (``memory.ProcessMemory``): its parts go to ``/stats``."""
    heap_trim: HeapTrims | None = None
    """The C-heap trims (``memory.HeapTrim``): their counters go to ``/stats``."""
    kv_identity: tuple[str, str] | None = None
    """The model fingerprint and the KV scheme's cache key: with each entry's cache
    namespace, the namespace of the KV events' block hashes (``--kv-events``)."""
    checkpoint_handoff: CheckpointHandoff = field(default_factory=CheckpointHandoff)
    """Loaded generation checkpoints on their way from the gateway (which loads them at
    admission) to the runner (which claims them): shared by every ``CheckpointPort``."""


Factory = Callable[[], Actor]


@dataclass(frozen=True, slots=True)
class StatsAsk:
    """How ``/stats`` asks an actor: the request, the expected reply, and the section it fills.

    ``render`` turns the reply into the section's fields (default: every field).
    """

    request: Callable[[], Request]
    reply: type[Body]
    section: str
    render: Callable[[Body], dict[str, Any]] | None = None

    def fields(self, body: Body) -> dict[str, Any]:
        """The section fields of ``body``."""
        if self.render is not None:
            return self.render(body)
        return body.model_dump(mode="json", exclude={"kind", "reply_to"})


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """One actor of the wiring.

    ``build`` returns the factory the runtime calls at spawn and on every
    restart, or ``None`` when ``Parts`` leave the actor out.
    ``capacity``: the mailbox size for a config. ``supervision``: what a
    failing handler does (docs/runtime.md).
    """

    name: str
    build: Callable[[Parts], Factory | None]
    capacity: Callable[[EngineConfig], int]
    supervision: Supervision
    stats: StatsAsk | None = None


def _prompt_cache_factory(
    cap_bytes: int,
    registry: HandleDisposer,
    *,
    spill_to: str | None,
    turns: str | None,
    cold: ColdTier | None = None,
    config: EngineConfig | None = None,
    durability: str | None = None,
    kv_events: str | None = None,
) -> Factory:
    # NOTE: one state shared by every instance the factory makes, so a
    # restart after a failing message does not orphan the handles the cache
    # owns (they would never be disposed otherwise).
    cfg = config or EngineConfig()
    demote = cfg.ssd_demote_idle if cold is not None else 0.0
    state = prompt_cache_core.CoreState(
        cap_bytes=cap_bytes,
        spill_enabled=spill_to is not None,
        drain_step=DRAIN_STEP if turns is not None else None,
        cold_lookups=cold is not None,
        cold_timeout_s=cfg.ask_timeout_s,
        # NOTE: a lookup past the cap is answered from RAM alone, so a burst
        # of SSD hits bigger than it would join cold.
        max_cold_lookups=cfg.max_cold_lookups,
        cold_min_gain=cold.config.min_restore_tokens if cold is not None else 1,
        demote_idle_s=demote,
        # NOTE: one idle scan per quarter of the idle time (within 50 ms..30 s),
        # a few entries per scan: the spill queue receives demotions gradually.
        demote_scan_s=min(max(demote / 4, 0.05), 30.0),
    )
    staging = cold.staging if cold is not None else None
    cold_address = cold.name if cold is not None else None
    state.notify_puts = durability is not None
    state.report_tier = kv_events is not None
    return lambda: PromptCache(
        cap_bytes=cap_bytes,
        registry=registry,
        spill_to=spill_to,
        turns=turns,
        cold=cold_address,
        staging=staging,
        durability=durability,
        state=state,
        kv_events=kv_events,
    )


def _prompt_cache(parts: Parts) -> Factory | None:
    registry = parts.registry
    if registry is None:
        return None
    # NOTE: after disposing entries the cache asks the gateway for this
    # standing background step (a RunWhenIdle message; the callable stays
    # with the runner's step registry), so their arrays go on an idle server
    # too. Without a cold tier spill_to is None: evictions are disposed.
    parts.steps.add(DRAIN_STEP, registry.drain, standing=True)
    cold = parts.cold
    return _prompt_cache_factory(
        parts.prompt_cache_bytes,
        registry,
        spill_to=SPILL_QUEUE if cold is not None else None,
        turns=GATEWAY,
        cold=cold,
        config=parts.config,
        durability=DURABILITY if _durable(parts) else None,
        kv_events=KV_EVENTS if parts.config.kv_events is not None else None,
    )


# --- KV events -----------------------------------------------------------------------


def _kv_events(parts: Parts) -> Factory | None:
    cfg = parts.config
    if cfg.kv_events is None:
        return None
    from actors.kv_events import ZmqSockets

    model, scheme = parts.kv_identity or ("", "")
    state = kv_events_core.CoreState(
        model=model,
        kv_scheme=scheme,
        wire_format=cfg.kv_events_format,
        endpoint=cfg.kv_events,
        replay_endpoint=cfg.kv_events_replay,
    )
    # NOTE: bound here, so a taken port or a bad endpoint fails the start;
    # one instance ("resume"): its sockets and stream survive a failing message.
    actor = KvEvents(state=state, sockets=ZmqSockets(cfg.kv_events, cfg.kv_events_replay))
    return lambda: actor


# --- the cold tier ---------------------------------------------------------------------


def cold_tier(
    config: EngineConfig,
    *,
    root: str,
    identity: FileIdentity,
    max_bytes: int,
    system: ActorSystem,
    steps: BackgroundSteps,
    caches: CacheSource,
    staging: HostStaging,
    port: FilePort | None = None,
) -> tuple[ColdTier, TensorSource]:
    """The cold tier's shared state and the store worker's tensor source, for :class:`Parts`.

    Its actors are spawned by :func:`start`.

    The store worker's tensor read-backs run as idle engine turns it asks
    the gateway for itself (:class:`~actors.gateway.GatewayTurns` over
    ``system`` and the runner's ``steps``; a busy engine re-arms the wait
    instead of failing the store); ``caches`` is the registry whose handles
    the spill queue carries; ``staging`` is where restored bytes wait for
    the backend, which takes them in the request's first turn.
    """
    turns = GatewayTurns(
        system, steps, timeout=config.shutdown_timeout, gateway=GATEWAY,
        label="ssd_writer.store", prefix="ssd-store-",
    )
    settings = SsdWriterConfig(
        root=root,
        identity=identity,
        max_bytes=max_bytes,
        verify=config.ssd_cache_verify,
        always_restore=config.ssd_restore == "always",
        ask_timeout=config.ask_timeout_s,
        # NOTE: the Engine passes its own staging (sized the same way); this
        # is the bound when none is passed.
        staging_entries=config.ssd_staging_entries,
        scrub_interval_s=SCRUB_INTERVAL_S,
    )
    source = EngineTensorSource(RearmingTurns(turns), caches, identity)
    return build_cold_tier(config=settings, port=port, staging=staging), source


def _ssd_writer(parts: Parts) -> Factory | None:
    tier = parts.cold
    if tier is None:
        return None
    events = KV_EVENTS if parts.config.kv_events is not None else None
    # NOTE: one keep for every instance the factory makes: a restart goes on
    # with the same index and directory lock instead of scanning again.
    keep = IndexKeep.fresh(tier.config, report_tier=events is not None)
    return lambda: SsdWriter(tier, keep=keep, kv_events=events)


def _ssd_store(parts: Parts) -> Factory | None:
    tier, source = parts.cold, parts.tensor_source
    if tier is None:
        return None
    assert source is not None, "a cold tier needs the store worker's tensor source"
    return lambda: StoreWorker(tier, source)


def _ssd_read(parts: Parts) -> Factory | None:
    tier = parts.cold
    return None if tier is None else lambda: Reader(tier)


def _ssd_scrub(parts: Parts) -> Factory | None:
    tier = parts.cold
    if tier is None or tier.config.scrub_interval_s <= 0:
        return None
    # NOTE: a no-op step; the gateway grants it only when no request runs or waits.
    parts.steps.add(SCRUB_GATE_STEP, _idle_gate, standing=True)
    return lambda: Scrubber(tier, gateway=GATEWAY, gate_step=SCRUB_GATE_STEP)


def _idle_gate() -> None:
    return None


def _spill_queue_factory(
    state: spill_queue_core.QueueState,
    releaser: HandleReleaser,
    writer: str,
    turns: str | None = None,
) -> Factory:
    # NOTE: the state is built once and handed to every instance, so a
    # restart after a failing message does not orphan the handles the queue
    # owns (they would never be released otherwise).
    return lambda: SpillQueue(state=state, releaser=releaser, writer=writer, turns=turns)


def _spill_queue(parts: Parts) -> Factory | None:
    if parts.cold is None or parts.registry is None:
        return None
    # NOTE: released handles' arrays are freed by the registry's drain, the
    # prompt cache's standing DRAIN_STEP (registered in _prompt_cache).
    # NOTE: with generation checkpoints on, a quarter of the spill budget is
    # theirs (design §5.7 splits the one budget between the two producers).
    share = CHECKPOINT_SHARE if _checkpoints(parts) is not None else 0.0
    state = spill_queue_core.QueueState(
        cap_bytes=parts.config.ssd_spill_queue_bytes, drain_step=DRAIN_STEP,
        checkpoint_share=share,
    )
    return _spill_queue_factory(state, parts.registry, parts.cold.name, turns=GATEWAY)


def _spill_queue_fields(body: Body) -> dict[str, Any]:
    assert isinstance(body, SpillQueueStats)
    return {
        "pending_spills": body.pending,
        "pending_spill_bytes": body.pending_bytes,
        "pending_checkpoints": body.pending_checkpoints,
        "dropped_spills": body.dropped,
        "failed_spills": body.failed,
        "spill_queue_cap_bytes": body.cap_bytes,
    }


def _durable(parts: Parts) -> bool:
    return parts.cold is not None and parts.cloner is not None


def _durability_factory(
    state: DurabilityState,
    cloner: Cloner,
    steps: StepRegistry,
    *,
    alarm: Alarm | None = None,
    targets: DurabilityTargets | None = None,
) -> Factory:
    # NOTE: "resume" keeps this one instance (its clone slots, its dirty
    # records) when a handler raises: losing records would let a later flush
    # claim durability it does not have.
    coordinator = DurabilityCoordinator(
        state=state, cloner=cloner, steps=steps, alarm=alarm, targets=targets or _TARGETS
    )
    return lambda: coordinator


_TARGETS = DurabilityTargets(
    ssd_writer=SSD_WRITER, spill_queue=SPILL_QUEUE, gateway=GATEWAY, prompt_cache=PROMPT_CACHE
)


def _durability(parts: Parts) -> Factory | None:
    cloner = parts.cloner
    if not _durable(parts) or cloner is None:
        return None
    config = DurabilityConfig(write_behind=parts.config.ssd_writebehind)
    return _durability_factory(DurabilityState(config=config), cloner, GatewaySteps(parts.steps))


def _durability_fields(body: Body) -> dict[str, Any]:
    assert isinstance(body, DurabilityStats)
    last = body.last_flush
    return {
        "writebehind_dirty": body.dirty,
        "pending_snapshots": body.pending_snapshots,
        "writebehind_written": body.written,
        "writebehind_stored": body.stored,
        "writebehind_evicted_unwritten": body.evicted_unwritten,
        "flushes": body.flushes,
        "last_flush_durable": None if last is None else last.durable,
        "longest_durable_prefix_tokens": None if last is None else last.longest_durable_prefix_tokens,
    }


# --- memory relief -------------------------------------------------------------------


def _memory_config(parts: Parts) -> MemoryConfig:
    guard, registry = parts.memory_guard, parts.registry
    return MemoryConfig(
        budget=None if guard is None else guard.budget,
        footprint=None if guard is None else guard.footprint,
        margin=0 if guard is None else guard.margin,
        settle_step=MEMORY_SETTLE_STEP if guard is not None and guard.settle is not None else None,
        release_step=MEMORY_RELEASE_STEP if registry is not None else None,
        prompt_cache=registry is not None,
        spill_queue=parts.cold is not None,
        reply_timeout_s=parts.config.ask_timeout_s,
    )


def _memory_gauges(parts: Parts) -> GuardGauges:
    return GuardGauges(parts.memory_guard, parts.memory_reading, parts.heap_trim)


def _memory(parts: Parts) -> Factory | None:
    guard, registry = parts.memory_guard, parts.registry
    if guard is None and registry is None:
        return None
    config = _memory_config(parts)
    if guard is not None and guard.settle is not None:
        parts.steps.add(MEMORY_SETTLE_STEP, guard.settle, standing=True)
    if registry is not None:
        drain = registry.drain
        parts.steps.add(
            MEMORY_RELEASE_STEP, lambda: release_freed_memory(drain), standing=True
        )
    gauges = _memory_gauges(parts)
    targets = MemoryTargets(gateway=GATEWAY, prompt_cache=PROMPT_CACHE, spill_queue=SPILL_QUEUE)
    # NOTE: "resume" keeps this one instance (its core state, the job in
    # flight and its alarm) when a handler raises.
    actor = MemoryActor(state=MemoryState(config=config), gauges=gauges, targets=targets)
    return lambda: actor


def _memory_fields(body: Body) -> dict[str, Any]:
    assert isinstance(body, MemoryStats)
    if body.budget_bytes is None:
        return {}  # NOTE: no guard (demotion only): no memory section.
    return body.model_dump(mode="json", exclude={"kind", "reply_to"}, exclude_none=True)


# --- the request path ----------------------------------------------------------------


def _gateway(parts: Parts) -> Factory:
    cfg = parts.config
    gateway = Gateway(
        runner=RUNNER,
        max_queue=cfg.max_queue,
        max_burst=cfg.max_burst,
        prompt_cache=PROMPT_CACHE if parts.registry is not None else None,
        batch=BATCH_ADDRESS if batch_refusal(parts) is None else None,
        # NOTE: background steps (write-behind clones, SSD tensor reads) get a
        # bounded share of engine time under load, so durability keeps up.
        background_share=DEFAULT_BACKGROUND_SHARE,
        # NOTE: such a step may run inside the batch's step chain, between
        # two steps, instead of ending it (docs/batching.md, "Background
        # steps inside a chain"); off by default until measured on a GPU.
        chain_background=cfg.background_in_chain,
        # NOTE: serial-lane checkpoints are loaded at admission, beside the Take.
        checkpoints=_checkpoints(parts),
    )
    # NOTE: "resume" keeps this one instance (its core state) when a handler raises.
    return lambda: gateway


def _batch(parts: Parts) -> Factory | None:
    prompt_cache = PROMPT_CACHE if parts.registry is not None else None
    return batch_factory(parts, gateway=GATEWAY, prompt_cache=prompt_cache,
                         checkpoints=_checkpoints(parts))


CHECKPOINT_SHARE = 0.25
"""Share of the spill queue's byte cap that generation checkpoints may pin."""


def _checkpoints(parts: Parts) -> CheckpointPort | None:
    """The generation checkpoints' port (``None``: off, or no SSD tier or no registry)."""
    cold, registry = parts.cold, parts.registry
    every = parts.config.generation_checkpoint
    if cold is None or registry is None or every <= 0:
        return None
    return CheckpointPort(
        every=every,
        directory=checkpoint_dir(cold.config.root, cold.config.identity.fingerprint),
        fingerprint=cold.config.identity.fingerprint,
        port=cold.port,
        spill_queue=SPILL_QUEUE,
        dispose=registry.dispose,
        counters=cold.checkpoints,
        verify=cold.config.verify,
        handed=parts.checkpoint_handoff,
    )


def _runner(parts: Parts) -> Factory:
    cfg = parts.config
    runner = TurnRunner(
        gateway=GATEWAY,
        executor=parts.executor,
        backend=parts.backend,
        steps=parts.steps,
        prompt_cache=PROMPT_CACHE if parts.registry is not None else None,
        snapshot_min_new_tokens=cfg.snapshot_min_new_tokens,
        observe_prefill=SSD_WRITER if parts.cold is not None else None,
        memory_guard=parts.memory_guard,
        stream_write_timeout_s=cfg.stream_write_timeout_s,
        checkpoints=_checkpoints(parts),
    )
    return lambda: runner


_TURN_ACTORS = Supervision("resume", max_restarts=100, within=1.0)
_COLD_ACTORS = Supervision("restart", max_restarts=10, within=60.0)

# NOTE: the cold tier's mailboxes, written once: the ACTORS table and
# spawn_ssd_writer (tests and tools) spawn the tier with the same sizes.
_SSD_INDEX_MAILBOX = 256
_SSD_STORE_MAILBOX = 64
_SSD_READ_MAILBOX = 64
_SSD_SCRUB_MAILBOX = 4

ACTORS: tuple[ActorSpec, ...] = (
    # NOTE: the KV-event publisher before the tiers that report to it (the
    # SSD index reports its startup scan), so it also stops after them.
    ActorSpec(
        KV_EVENTS,
        _kv_events,
        capacity=lambda cfg: 256,
        supervision=Supervision("resume", max_restarts=100, within=1.0),
        stats=StatsAsk(KvEventsStatsRequest, KvEventsStats, "kv_events"),
    ),
    # NOTE: the cold tier first: the prompt cache sends to it, and stop
    # order (reverse) stops the reader and the store worker before the index,
    # so a write in progress can still report.
    ActorSpec(
        SSD_WRITER,
        _ssd_writer,
        capacity=lambda cfg: _SSD_INDEX_MAILBOX,
        supervision=_COLD_ACTORS,
        stats=StatsAsk(SsdStatsRequest, SsdStats, "ssd_cache"),
    ),
    ActorSpec(
        SSD_STORE, _ssd_store, capacity=lambda cfg: _SSD_STORE_MAILBOX, supervision=_COLD_ACTORS
    ),
    ActorSpec(
        SSD_READ, _ssd_read, capacity=lambda cfg: _SSD_READ_MAILBOX, supervision=_COLD_ACTORS
    ),
    ActorSpec(
        SSD_SCRUB, _ssd_scrub, capacity=lambda cfg: _SSD_SCRUB_MAILBOX, supervision=_COLD_ACTORS
    ),
    ActorSpec(
        SPILL_QUEUE,
        _spill_queue,
        capacity=lambda cfg: 256,
        supervision=_COLD_ACTORS,
        stats=StatsAsk(
            SpillQueueStatsRequest, SpillQueueStats, "ssd_cache", render=_spill_queue_fields
        ),
    ),
    ActorSpec(
        PROMPT_CACHE,
        _prompt_cache,
        capacity=lambda cfg: 256,
        supervision=Supervision("restart", max_restarts=10, within=60.0),
        stats=StatsAsk(PromptCacheStatsRequest, PromptCacheStats, "prompt_cache"),
    ),
    ActorSpec(
        GATEWAY,
        _gateway,
        # NOTE: room for every queued request's messages plus the runner's
        # reports, so admission answers never wait on a full mailbox.
        capacity=lambda cfg: max(64, 2 * cfg.max_queue + 16),
        supervision=_TURN_ACTORS,
        stats=StatsAsk(GatewayStatsRequest, GatewayStats, "gateway"),
    ),
    ActorSpec(
        RUNNER,
        _runner,
        capacity=lambda cfg: cfg.max_queue + 16,
        supervision=_TURN_ACTORS,
        stats=StatsAsk(RunnerStatsRequest, RunnerStats, "gateway"),
    ),
    # NOTE: the batch lane (docs/batching.md), only with max_batch > 1 and a
    # model that passes the batching gates; room for every row's messages.
    ActorSpec(
        BATCH_ADDRESS,
        _batch,
        capacity=lambda cfg: max(64, 2 * (cfg.max_queue + cfg.max_batch) + 16),
        supervision=_TURN_ACTORS,
        stats=StatsAsk(BatchStatsRequest, BatchStats, "batch"),
    ),
    # NOTE: after the gateway, the prompt cache and the spill queue, which it
    # asks (it stops first). With the RAM tier or the memory guard.
    ActorSpec(
        MEMORY,
        _memory,
        capacity=lambda cfg: max(64, cfg.max_queue + 16),
        supervision=Supervision("resume", max_restarts=100, within=1.0),
        stats=StatsAsk(MemoryStatsRequest, MemoryStats, "memory", render=_memory_fields),
    ),
    # NOTE: after the gateway, the spill queue and the SSD index, which it
    # sends to (it stops first). The prompt cache tells it of every put;
    # at shutdown those tells find it stopped, after the final flush.
    ActorSpec(
        DURABILITY,
        _durability,
        capacity=lambda cfg: 256,
        supervision=Supervision("resume", max_restarts=100, within=1.0),
        stats=StatsAsk(
            DurabilityStatsRequest, DurabilityStats, "ssd_cache", render=_durability_fields
        ),
    ),
)
"""Every actor, in spawn order (stopped in reverse)."""


def _spec(name: str) -> ActorSpec:
    return next(s for s in ACTORS if s.name == name)


def _spawn(system: ActorSystem, spec: ActorSpec, factory: Factory, config: EngineConfig) -> ActorRef:
    return system.spawn(
        spec.name, factory, capacity=spec.capacity(config), supervision=spec.supervision
    )


@dataclass(frozen=True, slots=True)
class Wired:
    """The running actors: their refs by address, and the statistics asks."""

    system: ActorSystem
    refs: dict[str, ActorRef]
    specs: tuple[ActorSpec, ...]
    config: EngineConfig
    checkpoints: CheckpointCounters | None = None
    admission: AdmissionCheck | None = None
    """The memory actor's "fits at once" rule for the asker's fast path (``None``: no guard)."""
    tensor_source: TensorSource | None = None
    """The cold tier's tensor source (``None``: no SSD tier): its checkpoint read-ahead counts."""

    def ref(self, name: str) -> ActorRef:
        """The ref of the actor at ``name`` (``KeyError`` if it is not wired)."""
        return self.refs[name]

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """Every wired actor's statistics, asked at once with one deadline.

        Sections are merged by ``StatsAsk.section``; an actor that did not
        answer in time (busy, stopped, failed) appears under ``unavailable``
        with the reason.
        """
        deadline = self.config.stats_timeout_s if timeout is None else timeout
        answers: dict[str, Body] = {}
        missing: dict[str, str] = {}

        async def ask(spec: ActorSpec, stats: StatsAsk) -> None:
            try:
                answers[spec.name] = await self.refs[spec.name].ask(
                    stats.request(), timeout=deadline, expect=stats.reply
                )
            except RuntimeFailure as exc:
                missing[spec.name] = f"{type(exc).__name__}: {exc}"

        async with anyio.create_task_group() as tg:
            for spec in self.specs:
                if spec.stats is not None and spec.name in self.refs:
                    tg.start_soon(ask, spec, spec.stats)
        out: dict[str, Any] = {}
        for spec in self.specs:
            body = answers.get(spec.name)
            if body is None or spec.stats is None:
                continue
            fields = spec.stats.fields(body)
            if fields:
                out.setdefault(spec.stats.section, {}).update(fields)
        _cold_tier_view(out)
        if self.checkpoints is not None and self.config.generation_checkpoint > 0:
            section = self.checkpoints.snapshot()
            section["interval_tokens"] = self.config.generation_checkpoint
            section["pending"] = out.get("ssd_cache", {}).get("pending_checkpoints", 0)
            # NOTE: views turns that took a batch step's read-ahead, and those that had one
            # that did not fit (another base); engine-thread ints, read whole.
            source = self.tensor_source
            section["read_ahead_used"] = getattr(source, "read_ahead_used", 0)
            section["read_ahead_missed"] = getattr(source, "read_ahead_missed", 0)
            out["generation_checkpoints"] = section
        if missing:
            out["unavailable"] = missing
        return out


def _cold_tier_view(out: dict[str, Any]) -> None:
    """Copy the RAM tier's cold-tier figures into the ``ssd_cache`` section."""
    ssd, ram = out.get("ssd_cache"), out.get("prompt_cache")
    if ssd is not None and ssd.get("longest_entry_tokens") is not None:
        # NOTE: the index holds only committed files (fsync, rename, directory
        # fsync), so its longest entry is the longest durable prefix now; the
        # last flush's figure may be older.
        ssd["longest_durable_prefix_tokens"] = ssd["longest_entry_tokens"]
    if ssd is None or ram is None:
        return
    for key in (
        "demotions",
        "ssd_hits",
        "ssd_cached_tokens_served",
        "ssd_lookups",
        "ssd_lookups_skipped",
        "ssd_recompute",
        "ssd_failures",
        "ssd_timeouts",
    ):
        if key in ram:
            ssd[key.removeprefix("ssd_")] = ram[key]


def start(system: ActorSystem, parts: Parts) -> Wired:
    """Spawn every actor of :data:`ACTORS` that ``parts`` include, in table order."""
    refs: dict[str, ActorRef] = {}
    for spec in ACTORS:
        factory = spec.build(parts)
        if factory is not None:
            refs[spec.name] = _spawn(system, spec, factory, parts.config)
    admission = None
    if parts.memory_guard is not None and MEMORY in refs:
        admission = AdmissionCheck(_memory_config(parts), _memory_gauges(parts))
    return Wired(system=system, refs=refs, specs=ACTORS, config=parts.config,
                 checkpoints=parts.cold.checkpoints if parts.cold is not None else None,
                 admission=admission, tensor_source=parts.tensor_source)


def spawn_prompt_cache(
    system: ActorSystem,
    *,
    cap_bytes: int,
    registry: HandleDisposer,
    spill_to: str | None = None,
    turns: str | None = None,
    config: EngineConfig | None = None,
) -> ActorRef:
    """Spawn the RAM tier alone, as :func:`start` does (same mailbox, same supervision).

    For tests and tools that drive the prompt cache without a model;
    ``spill_to``/``turns`` name the actors standing in for the cold tier's
    queue and the gateway (``None``: none).
    """
    spec = _spec(PROMPT_CACHE)
    cfg = config or EngineConfig()
    factory = _prompt_cache_factory(
        cap_bytes, registry, spill_to=spill_to, turns=turns, config=cfg
    )
    return _spawn(system, spec, factory, cfg)


def spawn_durability(
    system: ActorSystem,
    *,
    cloner: Cloner,
    steps: StepRegistry,
    config: DurabilityConfig | None = None,
    alarm: Alarm | None = None,
    targets: DurabilityTargets | None = None,
    name: str = DURABILITY,
    capacity: int = 256,
    state: DurabilityState | None = None,
) -> ActorRef:
    """Spawn the durability coordinator alone (same supervision as :func:`start`).

    ``steps``: the background-step registry (``GatewaySteps`` over the
    runner's in production). Pass ``state`` to read it directly (tests,
    statistics); it then supplies the configuration and ``config`` is ignored.
    """
    spec = _spec(DURABILITY)
    shared = state if state is not None else DurabilityState(config=config or DurabilityConfig())
    return system.spawn(
        name,
        _durability_factory(shared, cloner, steps, alarm=alarm, targets=targets),
        capacity=capacity,
        supervision=spec.supervision,
    )


def spawn_spill_queue(
    system: ActorSystem,
    *,
    releaser: HandleReleaser,
    cap_bytes: int = spill_queue_core.DEFAULT_CAP_BYTES,
    writer: str = SSD_WRITER,
    name: str = SPILL_QUEUE,
    capacity: int = 256,
    state: spill_queue_core.QueueState | None = None,
) -> ActorRef:
    """Spawn the spill queue alone, with one state that survives restarts.

    Pass ``state`` to read statistics directly (``core.stats(state)``)
    without asking; it then supplies the cap and ``cap_bytes`` is ignored.
    """
    spec = _spec(SPILL_QUEUE)
    shared = state if state is not None else spill_queue_core.QueueState(cap_bytes=cap_bytes)
    return system.spawn(
        name,
        _spill_queue_factory(shared, releaser, writer),
        capacity=capacity,
        supervision=spec.supervision,
    )


def spawn_ssd_writer(
    system: ActorSystem,
    *,
    config: SsdWriterConfig,
    source: TensorSource,
    port: FilePort | None = None,
    name: str = SSD_WRITER,
    capacity: int = _SSD_INDEX_MAILBOX,
    staging: HostStaging | None = None,
    gateway: str | None = None,
    io_runner: IoRunner | None = None,
) -> ColdTier:
    """Spawn the cold tier's index, store worker and reader (and scrubber) over one ColdTier.

    For tests and tools. The index scans the directory before it handles
    its first message (a ``Find`` sent meanwhile waits in its mailbox). The
    scrubber runs only with ``config.scrub_interval_s > 0``; ``gateway``
    names the actor that grants its idle turns (``None``: no idleness check).
    ``io_runner``: where file work runs (``None``: the tier's worker threads).
    """
    tier = build_cold_tier(config=config, port=port, name=name, staging=staging,
                           io_runner=io_runner)
    supervision = _spec(SSD_WRITER).supervision
    keep = IndexKeep.fresh(config)
    system.spawn(name, lambda: SsdWriter(tier, keep=keep), capacity=capacity,
                 supervision=supervision)
    system.spawn(
        tier.store_address,
        lambda: StoreWorker(tier, source),
        capacity=_SSD_STORE_MAILBOX,
        supervision=supervision,
    )
    system.spawn(
        tier.read_address,
        lambda: Reader(tier),
        capacity=_SSD_READ_MAILBOX,
        supervision=supervision,
    )
    if config.scrub_interval_s > 0:
        system.spawn(
            tier.scrub_address,
            lambda: Scrubber(tier, gateway=gateway, gate_step=SCRUB_GATE_STEP),
            capacity=_SSD_SCRUB_MAILBOX,
            supervision=supervision,
        )
    return tier
