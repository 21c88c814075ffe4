"""The PromptCache actor shell on the real runtime with a real CacheRegistry."""

from __future__ import annotations

from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from actors.engine.wiring import spawn_prompt_cache
from actors.prompt_cache import DRAIN_STEP
from actors.runtime import Actor, ActorSystem, Context, ManualClock
from kernels import CacheRegistry, RegisteredCache, UnknownCacheHandle, cache_arrays
from messages import (
    Envelope,
    PromptCacheStats,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Take,
    TakeResult,
)
from messages.gateway import RunWhenIdle, TurnDone
from messages.spill_queue import Enqueue
from tests.tiny_models import kv_llama

pytestmark = pytest.mark.anyio
ASK = 5.0


@pytest.fixture(scope="module")
def model() -> Any:
    """A tiny fp32 Llama."""
    return kv_llama()


def _register(registry: CacheRegistry, model: Any, tokens: tuple[int, ...]) -> RegisteredCache:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens)]), cache=cache), *cache_arrays(cache))
    return registry.register(cache, offset=len(tokens))


def _put(reg: RegisteredCache, tokens: tuple[int, ...], reply_to: str = "") -> Put:
    return Put(tokens=tokens, handle=reg.handle, meta=reg.meta, reply_to=reply_to)


async def _stats(ref: Any) -> PromptCacheStats:
    stats: PromptCacheStats = await ref.ask(
        PromptCacheStatsRequest(), timeout=ASK, expect=PromptCacheStats
    )
    return stats


class RecordingQueue(Actor):
    """A scripted cold-tier queue: records every message it receives (and so owns its handle)."""

    def __init__(self) -> None:
        self.received: list[Enqueue] = []

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Keep the message."""
        assert isinstance(envelope.body, Enqueue)
        self.received.append(envelope.body)


class DrainingGateway(Actor):
    """A scripted gateway: runs the registry's drain for ``RunWhenIdle`` once ``go`` is set."""

    def __init__(self, registry: CacheRegistry) -> None:
        self.registry = registry
        self.go = anyio.Event()
        self.asked: list[RunWhenIdle] = []
        self.drained = anyio.Event()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Wait for the test's go, drain (the engine thread's job in serving), answer TurnDone."""
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        self.asked.append(body)
        await self.go.wait()
        self.registry.drain()
        await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=True))
        self.drained.set()


async def test_take_put_release_and_stats_through_the_actor(model: Any) -> None:
    """Asked Put stores, Take leases the longest prefix, stats count it, stop disposes."""
    registry = CacheRegistry()
    a = _register(registry, model, (1, 2, 3, 4))
    async with ActorSystem() as system:
        ref = spawn_prompt_cache(system, cap_bytes=10**8, registry=registry)
        stored = await ref.ask(_put(a, (1, 2, 3, 4)), timeout=ASK, expect=PutResult)
        assert stored.stored
        hit = await ref.ask(Take(tokens=(1, 2, 3, 9, 9)), timeout=ASK, expect=TakeResult)
        assert (hit.handle, hit.cached_tokens) == (a.handle, 3)
        views = registry.materialize(a.handle, hit.cached_tokens)
        assert views[0].offset == 3
        await ref.tell(Release(lease_id=hit.lease_id or ""))
        stats = await _stats(ref)
        assert (stats.entries, stats.hits, stats.active_leases) == (1, 1, 0)
        assert stats.bytes == a.meta.nbytes
    # stopping the system disposed the remaining entry through the registry
    assert a.handle not in registry
    assert registry.drain() == 1


async def test_eviction_sends_the_entry_to_the_cold_tier_queue(model: Any) -> None:
    """Over the cap, the LRU entry goes to the queue as an Enqueue that carries its handle
    (the registry still holds it: the queue owns its disposal now)."""
    registry = CacheRegistry()
    first = _register(registry, model, (1, 2))
    second = _register(registry, model, (3, 4))
    queue = RecordingQueue()
    async with ActorSystem() as system:
        system.spawn("spill_queue", lambda: queue)
        ref = spawn_prompt_cache(
            system, cap_bytes=first.meta.nbytes, registry=registry, spill_to="spill_queue"
        )
        await ref.tell(_put(first, (1, 2)))  # a tell: no reply, still stored
        res = await ref.ask(_put(second, (3, 4)), timeout=ASK, expect=PutResult)
        assert res.evicted == 1
        stats = await _stats(ref)
        assert (stats.spilled, stats.spills_undelivered) == (1, 0)
    assert queue.received == [
        Enqueue(handle=first.handle, tokens=(1, 2), meta=first.meta, source="evict")
    ]
    assert first.handle in registry
    registry.dispose(first.handle)  # the queue's duty once it has settled the item


async def test_a_spill_nobody_receives_is_disposed(model: Any) -> None:
    """When the cold tier's queue is not there, the evicted entry is disposed and counted."""
    registry = CacheRegistry()
    first = _register(registry, model, (1, 2))
    second = _register(registry, model, (3, 4))
    async with ActorSystem() as system:
        ref = spawn_prompt_cache(
            system, cap_bytes=first.meta.nbytes, registry=registry, spill_to="spill_queue"
        )
        await ref.tell(_put(first, (1, 2)))
        await ref.tell(_put(second, (3, 4)))
        stats = await _stats(ref)
        assert (stats.spilled, stats.spills_undelivered, stats.disposed) == (0, 1, 1)
    assert first.handle not in registry


async def test_put_as_tell_disposes_refused_entries(model: Any) -> None:
    """A too-large put sent as a tell is disposed without any reply being attempted."""
    registry = CacheRegistry()
    big = _register(registry, model, (1, 2, 3))
    async with ActorSystem() as system:
        ref = spawn_prompt_cache(system, cap_bytes=big.meta.nbytes - 1, registry=registry)
        await ref.tell(_put(big, (1, 2, 3)))
        stats = await _stats(ref)
        assert (stats.rejected_too_large, stats.entries) == (1, 0)
    assert big.handle not in registry
    assert not system.dead_letters()


async def test_a_take_whose_reply_reaches_nobody_releases_its_lease(model: Any) -> None:
    """A Take answered after its asker gave up (the reply is a dead letter), or sent as a
    tell, leaves no lease behind: the entry can still be evicted and the cap stays usable."""
    registry = CacheRegistry()
    a = _register(registry, model, (1, 2, 3))
    b = _register(registry, model, (4, 5, 6))
    async with ActorSystem() as system:
        ref = spawn_prompt_cache(system, cap_bytes=a.meta.nbytes, registry=registry)
        await ref.tell(_put(a, (1, 2, 3)))
        gone = system.open_inbox(1)
        gone.close()  # NOTE: what an ask's reply slot becomes once its deadline passed
        await ref.tell(Take(tokens=(1, 2, 3, 4), reply_to=gone.address))
        await ref.tell(Take(tokens=(1, 2, 3, 5)))  # a tell cannot receive its lease either
        stats = await _stats(ref)
        assert (stats.hits, stats.active_leases, stats.leases_undelivered) == (2, 0, 2)
        res = await ref.ask(_put(b, (4, 5, 6)), timeout=ASK, expect=PutResult)
        assert (res.stored, res.evicted) == (True, 1)
    assert [d.envelope.body.kind for d in system.dead_letters()] == ["prompt_cache.take_result"]


async def test_a_lease_whose_holder_never_releases_expires(model: Any) -> None:
    """A lease held past its deadline (injected clock) ends by itself, so the entry it pinned
    can be evicted; the late Release is harmless and the late holder's materialize misses."""
    registry = CacheRegistry()
    a = _register(registry, model, (1, 2, 3))
    b = _register(registry, model, (4, 5, 6))
    clock = ManualClock()
    async with ActorSystem(clock=clock) as system:
        ref = spawn_prompt_cache(system, cap_bytes=a.meta.nbytes, registry=registry)
        await ref.tell(_put(a, (1, 2, 3)))
        hit = await ref.ask(Take(tokens=(1, 2, 3, 4)), timeout=ASK, expect=TakeResult)
        assert hit.lease_id is not None
        clock.advance(299.0)
        assert (await _stats(ref)).active_leases == 1
        refused = await ref.ask(_put(b, (4, 5, 6)), timeout=ASK, expect=PutResult)
        assert refused.reason == "no_room"  # b was disposed; make another for the retry
        b = _register(registry, model, (4, 5, 6))
        clock.advance(1.0)  # the default lease lasts 300 s
        res = await ref.ask(_put(b, (4, 5, 6)), timeout=ASK, expect=PutResult)
        assert (res.stored, res.evicted) == (True, 1)
        with pytest.raises(UnknownCacheHandle):
            registry.materialize(a.handle, hit.cached_tokens)
        await ref.tell(Release(lease_id=hit.lease_id))
        stats = await _stats(ref)
        assert (stats.active_leases, stats.leases_expired, stats.entries) == (0, 1, 1)


async def test_disposed_entries_are_drained_by_a_background_turn(model: Any) -> None:
    """A replaced entry's arrays go in a background turn asked for at once (no request needs
    to come), and stats show them as pending disposals until that turn has run."""
    registry = CacheRegistry()
    old = _register(registry, model, (1, 2, 3))
    new = _register(registry, model, (1, 2, 3))
    gateway = DrainingGateway(registry)
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway)
        ref = spawn_prompt_cache(system, cap_bytes=10**8, registry=registry, turns="gateway")
        await ref.tell(_put(old, (1, 2, 3)))
        res = await ref.ask(_put(new, (1, 2, 3)), timeout=ASK, expect=PutResult)
        assert res.replaced == 1
        stats = await _stats(ref)
        assert (stats.pending_disposals, stats.pending_disposal_bytes) == (1, old.meta.nbytes)
        assert registry.statistics().pending_dispose == 1
        gateway.go.set()
        with anyio.fail_after(ASK):
            await gateway.drained.wait()
        assert registry.statistics().pending_dispose == 0
        stats = await _stats(ref)
        assert (stats.pending_disposals, stats.pending_disposal_bytes) == (0, 0)
        assert stats.drains_requested == 1
    assert [a.step_id for a in gateway.asked] == [DRAIN_STEP]
    # NOTE: idle only: under load every turn's end drains the registry anyway.
    assert all(a.idle_only for a in gateway.asked)
