"""The RAM prompt cache actor: a thin shell over ``actors._prompt_cache_core``.

The shell keeps the core's state, runs one message at a time on the event
loop and performs the core's effects: replies (only to asks), disposals
through the registry's thread-safe ``dispose`` (the arrays are dropped later
on the engine thread), spills to an optional cold-tier sink. It never touches
an MLX array. See ``docs/prompt-cache.md`` for the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.runtime import Actor, ActorRef, ActorSystem, Context, Supervision, get_logger
from messages import EntryMeta, Envelope, Request

from . import core

__all__ = [
    "PROMPT_CACHE_ADDRESS",
    "HandleDisposer",
    "PromptCache",
    "SpillSink",
    "SpilledEntry",
    "spawn_prompt_cache",
]

PROMPT_CACHE_ADDRESS = "prompt_cache"
"""The conventional actor name of the RAM tier."""

_log = get_logger("kvtier.prompt_cache")


class HandleDisposer(Protocol):
    """Where disposed handles go: ``kernels.CacheRegistry`` (thread-safe ``dispose``)."""

    def dispose(self, handle: str) -> None:
        """Forget ``handle``; its arrays are released later on the engine thread."""
        ...


@dataclass(frozen=True)
class SpilledEntry:
    """An entry evicted from RAM, handed to the cold tier with its handle's ownership."""

    handle: str
    namespace: str
    tokens: tuple[int, ...]
    meta: EntryMeta


class SpillSink(Protocol):
    """The cold tier's intake (a bounded spill queue). Must not block.

    ``spill`` returns ``True`` when it took the entry (it then disposes the
    handle itself, on every path); ``False`` (or raising) means it did not,
    and the prompt cache disposes the handle at once.
    """

    def spill(self, entry: SpilledEntry) -> bool:
        """Accept ``entry`` for persistence, or refuse it."""
        ...


class PromptCache(Actor):
    """Byte-capped LRU of token-prefix entries; answers ``Take``/``Put``/``Release``/stats."""

    def __init__(
        self,
        *,
        cap_bytes: int,
        registry: HandleDisposer,
        spill: SpillSink | None = None,
        state: core.CoreState | None = None,
    ) -> None:
        self._registry = registry
        self._spill = spill
        self.state = state if state is not None else core.CoreState(
            cap_bytes=cap_bytes, spill_enabled=spill is not None
        )

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order."""
        effects = core.handle(self.state, envelope.body)
        await self._perform(effects, envelope, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Dispose every unleased entry when the actor stops."""
        await self._perform(core.dispose_all(self.state), None, ctx)

    async def _perform(
        self, effects: Sequence[core.Effect], envelope: Envelope | None, ctx: Context
    ) -> None:
        for effect in effects:
            if isinstance(effect, core.Reply):
                body = envelope.body if envelope is not None else None
                # NOTE: Put and Release arrive as tells in serving; only asks get answers.
                if envelope is not None and isinstance(body, Request) and body.reply_to:
                    await ctx.reply(envelope, effect.body)
            elif isinstance(effect, core.Dispose):
                self._dispose(effect.handle)
            else:
                self._spill_or_dispose(effect)

    def _dispose(self, handle: str) -> None:
        try:
            self._registry.dispose(handle)
        except KeyError:
            _log.warning("prompt_cache.dispose_unknown", handle=handle)

    def _spill_or_dispose(self, effect: core.Spill) -> None:
        entry = SpilledEntry(effect.handle, effect.namespace, effect.tokens, effect.meta)
        taken = False
        if self._spill is not None:
            try:
                taken = self._spill.spill(entry)
            except Exception:  # noqa: BLE001 - NOTE: a failing sink never takes ownership.
                _log.exception("prompt_cache.spill_failed", handle=effect.handle)
                taken = False
        if not taken:
            self._dispose(effect.handle)


def spawn_prompt_cache(
    system: ActorSystem,
    *,
    cap_bytes: int,
    registry: HandleDisposer,
    spill: SpillSink | None = None,
    name: str = PROMPT_CACHE_ADDRESS,
    capacity: int = 256,
) -> ActorRef:
    """Spawn the RAM tier with one shared state that survives restarts.

    NOTE: the state is built once and handed to every instance the factory
    makes, so a restart after a failing message does not orphan the handles
    the cache owns (they would never be disposed otherwise).
    """
    state = core.CoreState(cap_bytes=cap_bytes, spill_enabled=spill is not None)
    return system.spawn(
        name,
        lambda: PromptCache(cap_bytes=cap_bytes, registry=registry, spill=spill, state=state),
        capacity=capacity,
        supervision=Supervision(on_failure="restart", max_restarts=10, within=60.0),
    )
