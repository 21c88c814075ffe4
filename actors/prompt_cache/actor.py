"""The RAM prompt cache actor: a thin shell over ``actors.prompt_cache.core``.

The shell keeps the core's state, runs one message at a time on the event
loop and performs the core's effects: replies, disposals through the
registry's thread-safe ``dispose`` (the arrays are dropped on the engine
thread), spills as ``spill_queue.Enqueue`` messages to the cold tier's queue,
and drain requests (``RunWhenIdle`` for the standing :data:`DRAIN_STEP`,
which the wiring registered) to the gateway. What it could not do (a reply
nobody received, a spill the queue did not take, a drain request the gateway
could not take) goes back into the core as an event. It never touches an MLX
array and calls no hook. See ``docs/prompt-cache.md``.

Addresses come from the wiring at construction (``actors/engine/wiring.py``):
``spill_to`` (the cold tier's queue; ``None`` disposes instead of spilling),
``turns`` (the gateway; ``None`` asks for no drain turns).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, assert_never

from actors.runtime import Actor, Context, MailboxClosed, get_logger
from messages import Envelope, Request
from messages.gateway import RunWhenIdle, TurnDone

from . import core

__all__ = [
    "DRAIN_STEP",
    "PROMPT_CACHE_ADDRESS",
    "HandleDisposer",
    "PromptCache",
]

PROMPT_CACHE_ADDRESS = "prompt_cache"
"""The conventional actor name of the RAM tier."""

DRAIN_STEP = "prompt_cache.drain"
"""The standing background step (registered by the wiring) that drops disposed arrays."""

_log = get_logger("kvtier.prompt_cache")


class HandleDisposer(Protocol):
    """Where disposed handles go: ``kernels.CacheRegistry``.

    The actor calls only the thread-safe ``dispose``; ``drain`` is what the
    wiring registers as the :data:`DRAIN_STEP` background step (engine thread).
    """

    def dispose(self, handle: str) -> None:
        """Forget ``handle``; its arrays are released later on the engine thread."""
        ...

    def drain(self) -> int:
        """Drop the arrays of disposed handles (engine thread); how many."""
        ...


class PromptCache(Actor):
    """Byte-capped LRU of token-prefix entries; answers ``Take``/``Put``/``Release``/stats.

    ``spill_to``: the address of the cold tier's queue, or ``None`` (no cold
    tier: evicted entries are disposed). ``turns``: the gateway's address,
    asked for a :data:`DRAIN_STEP` background turn after disposals, or
    ``None`` (no drain turns). ``state``: a state shared across restarts (the wiring's factory passes
    one, so a restart does not orphan the handles the cache owns).
    """

    def __init__(
        self,
        *,
        cap_bytes: int,
        registry: HandleDisposer,
        spill_to: str | None = None,
        turns: str | None = None,
        lease_ttl_s: float = core.DEFAULT_LEASE_TTL_S,
        state: core.CoreState | None = None,
    ) -> None:
        self._registry = registry
        self._spill_to = spill_to
        self._turns = turns
        self.state = (
            state
            if state is not None
            else core.CoreState(
                cap_bytes=cap_bytes,
                spill_enabled=spill_to is not None,
                drain_step=DRAIN_STEP if turns is not None else None,
                lease_ttl_s=lease_ttl_s,
            )
        )

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order."""
        self.state, effects = core.handle(self.state, envelope.body, ctx.clock.now())
        await self._perform(effects, envelope, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Dispose every unleased entry when the actor stops."""
        await self._perform(core.dispose_all(self.state), None, ctx)

    async def _perform(
        self, effects: Sequence[core.Effect], envelope: Envelope | None, ctx: Context
    ) -> None:
        pending = deque(effects)
        while pending:
            effect = pending.popleft()
            event: core.LeaseUndelivered | core.SpillUndelivered | None = None
            match effect:
                case core.Reply(body=body):
                    lease = getattr(body, "lease_id", None)
                    if not await self._reply(envelope, effect, ctx) and isinstance(lease, str):
                        event = core.LeaseUndelivered(lease)
                case core.Dispose(handle=handle):
                    self._dispose(handle)
                case core.Spill(message=message):
                    if not self._send(self._spill_to, message, ctx):
                        event = core.SpillUndelivered(message)
                case core.RequestDrain(step_id=step):
                    if not self._request_drain(step, ctx):
                        # NOTE: taken as a refusal; the next disposal asks again.
                        refused = TurnDone(step_id=step, ok=False, error_code="undelivered")
                        self.state, more = core.handle(self.state, refused, ctx.clock.now())
                        pending.extend(more)
                case _:
                    assert_never(effect)
            if event is not None:
                self.state, more = core.handle(self.state, event, ctx.clock.now())
                pending.extend(more)

    def _request_drain(self, step_id: str, ctx: Context) -> bool:
        """Ask the gateway for the drain step's turn; ``False`` if the ask was not sent."""
        ask = RunWhenIdle(step_id=step_id, label="prompt_cache.drain", reply_to=ctx.name)
        return self._send(self._turns, ask, ctx)

    async def _reply(self, envelope: Envelope | None, effect: core.Reply, ctx: Context) -> bool:
        """Answer the request; ``False`` when nobody can receive it (a tell, a gone asker)."""
        if envelope is None or not isinstance(envelope.body, Request) or not envelope.body.reply_to:
            return False
        return await ctx.reply(envelope, effect.body)

    def _send(self, to: str | None, body: Request, ctx: Context) -> bool:
        """Tell ``to`` without waiting; ``False`` if it is absent, gone, stopped or full."""
        if to is None:
            return False
        try:
            return ctx.try_tell(to, body)
        except MailboxClosed as exc:  # NOTE: also UnknownAddress and ActorStopped.
            _log.warning("prompt_cache.send_failed", to=to, kind=body.kind, error=repr(exc))
            return False

    def _dispose(self, handle: str) -> None:
        try:
            self._registry.dispose(handle)
        except KeyError:
            _log.warning("prompt_cache.dispose_unknown", handle=handle)

