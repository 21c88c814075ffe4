"""The memory actor's shell on the real runtime: a relief's asks reach scripted peers and come back."""

from __future__ import annotations

import anyio
import pytest

from actors.engine_thread.memory_guard import Footprint
from actors.memory import Gauges, MemoryActor, MemoryConfig, MemoryState
from actors.runtime import Actor, ActorSystem, Context
from messages import Body, Envelope
from messages.gateway import RunWhenIdle, TurnDone
from messages.memory import AdmitMemory, MemoryAdmitted, MemoryStats, MemoryStatsRequest, Refuse
from messages.prompt_cache import Demote, DemoteResult, PromptCacheStats, PromptCacheStatsRequest

pytestmark = pytest.mark.anyio

BUDGET = 1_000_000


class Reading:
    """A gauge port whose reading the scripted release turn lowers (as freeing arrays would)."""

    def __init__(self, active: int) -> None:
        self.active = active

    def read(self) -> Gauges:
        return Gauges(active=self.active, samples=1)


class ScriptedGateway(Actor):
    """Grants every idle turn; each release turn frees the next of ``frees`` bytes (then 0)."""

    def __init__(self, reading: Reading, frees: list[int], log: list[str]) -> None:
        self._reading, self._frees, self._log = reading, frees, log

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        self._log.append(body.step_id)
        if body.step_id == "memory.release":
            self._reading.active -= self._frees.pop(0) if self._frees else 0
        await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=True))


class ScriptedCache(Actor):
    """Indexes ``held`` bytes; a Demote hands back what it asks for, up to what is held."""

    def __init__(self, held: int, log: list[str]) -> None:
        self._held, self._log = held, log

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        answer: Body
        if isinstance(body, PromptCacheStatsRequest):
            self._log.append("stats")
            zeros = {n: 0 for n, f in PromptCacheStats.model_fields.items() if f.is_required()}
            answer = PromptCacheStats.model_validate({**zeros, "bytes": self._held})
        else:
            assert isinstance(body, Demote)
            self._log.append(f"demote {body.max_bytes}")
            handed = min(body.max_bytes or self._held, self._held)
            self._held -= handed
            answer = DemoteResult(disposed=1 if handed else 0, disposed_bytes=handed)
        await ctx.reply(envelope, answer)


async def test_a_relief_runs_through_the_gateway_and_the_ram_tier_and_admits_the_request() -> None:
    """An over-budget admission: settle turn, stats, Demote(need), release turn, stats again,
    admitted; a second one whose relief frees nothing is refused, as one that may fit later (it
    fits beside the least reading seen); stats count both."""
    log: list[str] = []
    demand = 512_000  # NOTE: 256 tokens' KV twice, 1,000 bytes per token.
    reading = Reading(BUDGET - demand + 100_000)
    config = MemoryConfig(
        budget=BUDGET, footprint=Footprint(kv_bytes_at=lambda n: 1000 * n, chunk=512),
        settle_step="memory.settle", release_step="memory.release", prompt_cache=True,
        spill_queue=False, reply_timeout_s=5.0,
    )
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: ScriptedGateway(reading, [100_000], log))
        system.spawn("prompt_cache", lambda: ScriptedCache(150_000, log))
        memory = system.spawn(
            "memory", lambda: MemoryActor(state=MemoryState(config=config), gauges=reading)
        )
        ask = AdmitMemory(request_id="r1", prompt_tokens=100, max_tokens=28)
        with anyio.fail_after(10):
            admitted = await memory.ask(ask, timeout=5.0)
        assert admitted == MemoryAdmitted(request_id="r1", relieved_bytes=100_000)
        assert log == ["memory.settle", "stats", "demote 100000", "memory.release", "stats"]
        reading.active = BUDGET
        log.clear()
        with anyio.fail_after(10):
            refused = await memory.ask(ask.model_copy(update={"request_id": "r2"}), timeout=5.0)
        assert isinstance(refused, Refuse)
        assert (refused.request_id, refused.may_fit_later) == ("r2", True)
        stats = await memory.ask(MemoryStatsRequest(), timeout=5.0, expect=MemoryStats)
    assert (stats.refused_at_admission, stats.busy_at_admission, stats.relieved_bytes,
            stats.active_bytes) == (0, 1, 150_000, BUDGET)
