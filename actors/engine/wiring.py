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

Tests spawn single actors through the same specs (:func:`spawn_prompt_cache`),
so they run with production's mailbox size and supervision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from actors.gateway import Backend, BackgroundSteps, Executor, Gateway, TurnRunner
from actors.prompt_cache import DRAIN_STEP, PROMPT_CACHE_ADDRESS, HandleDisposer, PromptCache
from actors.prompt_cache import core as prompt_cache_core
from actors.runtime import Actor, ActorRef, ActorSystem, RuntimeFailure, Supervision
from messages import Body, PromptCacheStats, PromptCacheStatsRequest, Request
from messages.gateway import GatewayStats, GatewayStatsRequest, RunnerStats, RunnerStatsRequest

from .config import EngineConfig

__all__ = [
    "ACTORS",
    "GATEWAY",
    "PROMPT_CACHE",
    "RUNNER",
    "ActorSpec",
    "Parts",
    "StatsAsk",
    "Wired",
    "spawn_prompt_cache",
    "start",
]

GATEWAY = "gateway"
RUNNER = "gateway.runner"
PROMPT_CACHE = PROMPT_CACHE_ADDRESS


@dataclass(frozen=True, slots=True)
class Parts:
    """What the actors are built from; ``Engine.start`` makes them.

    ``registry`` ``None`` means the prompt cache is off (``prompt_cache_bytes``
    is then ignored). ``steps`` is the turn runner's background-step registry
    (the ``Engine`` registers ``run_when_idle`` callables there and keeps the
    typed handles; docs/engine-turn.md).
    """

    config: EngineConfig
    executor: Executor
    backend: Backend
    registry: HandleDisposer | None
    prompt_cache_bytes: int
    steps: BackgroundSteps = field(default_factory=BackgroundSteps)


Factory = Callable[[], Actor]


@dataclass(frozen=True, slots=True)
class StatsAsk:
    """How ``/stats`` asks an actor: the request, the expected reply, and the section it fills."""

    request: Callable[[], Request]
    reply: type[Body]
    section: str


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
) -> Factory:
    # NOTE: one state shared by every instance the factory makes, so a
    # restart after a failing message does not orphan the handles the cache
    # owns (they would never be disposed otherwise).
    state = prompt_cache_core.CoreState(
        cap_bytes=cap_bytes,
        spill_enabled=spill_to is not None,
        drain_step=DRAIN_STEP if turns is not None else None,
    )
    return lambda: PromptCache(
        cap_bytes=cap_bytes, registry=registry, spill_to=spill_to, turns=turns, state=state
    )


def _prompt_cache(parts: Parts) -> Factory | None:
    registry = parts.registry
    if registry is None:
        return None
    # NOTE: after disposing entries the cache asks the gateway for this
    # standing background step (a RunWhenIdle message; the callable stays
    # with the runner's step registry), so their arrays go on an idle server
    # too. No cold tier yet: spill_to None makes the cache dispose what it evicts.
    parts.steps.add(DRAIN_STEP, registry.drain, standing=True)
    return _prompt_cache_factory(
        parts.prompt_cache_bytes, registry, spill_to=None, turns=GATEWAY
    )


def _gateway(parts: Parts) -> Factory:
    cfg = parts.config
    gateway = Gateway(
        runner=RUNNER,
        max_queue=cfg.max_queue,
        max_burst=cfg.max_burst,
        prompt_cache=PROMPT_CACHE if parts.registry is not None else None,
    )
    # NOTE: "resume" keeps this one instance (its core state) when a handler raises.
    return lambda: gateway


def _runner(parts: Parts) -> Factory:
    cfg = parts.config
    runner = TurnRunner(
        gateway=GATEWAY,
        executor=parts.executor,
        backend=parts.backend,
        steps=parts.steps,
        prompt_cache=PROMPT_CACHE if parts.registry is not None else None,
        snapshot_min_new_tokens=cfg.snapshot_min_new_tokens,
    )
    return lambda: runner


_TURN_ACTORS = Supervision("resume", max_restarts=100, within=1.0)

ACTORS: tuple[ActorSpec, ...] = (
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
            section = out.setdefault(spec.stats.section, {})
            section.update(body.model_dump(mode="json", exclude={"kind", "reply_to"}))
        if missing:
            out["unavailable"] = missing
        return out


def start(system: ActorSystem, parts: Parts) -> Wired:
    """Spawn every actor of :data:`ACTORS` that ``parts`` include, in table order."""
    refs: dict[str, ActorRef] = {}
    for spec in ACTORS:
        factory = spec.build(parts)
        if factory is not None:
            refs[spec.name] = _spawn(system, spec, factory, parts.config)
    return Wired(system=system, refs=refs, specs=ACTORS, config=parts.config)


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
    factory = _prompt_cache_factory(cap_bytes, registry, spill_to=spill_to, turns=turns)
    return _spawn(system, spec, factory, config or EngineConfig())
