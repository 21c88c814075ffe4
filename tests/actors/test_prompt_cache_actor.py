"""The PromptCache actor shell on the real runtime with a real CacheRegistry."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from actors import prompt_cache
from actors.runtime import ActorSystem
from kernels import CacheRegistry, RegisteredCache, cache_arrays
from messages import (
    PromptCacheStats,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Take,
    TakeResult,
)
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.anyio
ASK = 5.0


@pytest.fixture(scope="module")
def model() -> Any:
    """A tiny fp32 Llama."""
    return tiny_llama()


def _register(registry: CacheRegistry, model: Any, tokens: tuple[int, ...]) -> RegisteredCache:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens)]), cache=cache), *cache_arrays(cache))
    return registry.register(cache, offset=len(tokens))


class RecordingSink:
    """A scripted cold-tier intake: accepts (and records) or refuses every entry."""

    def __init__(self, *, accept: bool) -> None:
        self.accept = accept
        self.entries: list[prompt_cache.SpilledEntry] = []

    def spill(self, entry: prompt_cache.SpilledEntry) -> bool:
        """Record the entry; report whether ownership was taken."""
        self.entries.append(entry)
        return self.accept


def _put(reg: RegisteredCache, tokens: tuple[int, ...], reply_to: str = "") -> Put:
    return Put(tokens=tokens, handle=reg.handle, meta=reg.meta, reply_to=reply_to)


async def test_take_put_release_and_stats_through_the_actor(model: Any) -> None:
    """Asked Put stores, Take leases the longest prefix, stats count it, stop disposes."""
    registry = CacheRegistry()
    a = _register(registry, model, (1, 2, 3, 4))
    async with ActorSystem() as system:
        ref = prompt_cache.spawn_prompt_cache(system, cap_bytes=10**8, registry=registry)
        stored = await ref.ask(_put(a, (1, 2, 3, 4)), timeout=ASK, expect=PutResult)
        assert stored.stored
        hit = await ref.ask(Take(tokens=(1, 2, 3, 9, 9)), timeout=ASK, expect=TakeResult)
        assert (hit.handle, hit.cached_tokens) == (a.handle, 3)
        views = registry.materialize(a.handle, hit.cached_tokens)
        assert views[0].offset == 3
        await ref.tell(Release(lease_id=hit.lease_id or ""))
        stats = await ref.ask(PromptCacheStatsRequest(), timeout=ASK, expect=PromptCacheStats)
        assert (stats.entries, stats.hits, stats.active_leases) == (1, 1, 0)
        assert stats.bytes == a.meta.nbytes
    # stopping the system disposed the remaining entry through the registry
    assert a.handle not in registry
    assert registry.drain() == 1


async def test_eviction_spills_to_the_sink_or_disposes(model: Any) -> None:
    """Over the cap, the LRU entry goes to an accepting sink; a refusing sink means disposal."""
    for accept in (True, False):
        registry = CacheRegistry()
        first = _register(registry, model, (1, 2))
        second = _register(registry, model, (3, 4))
        sink = RecordingSink(accept=accept)
        async with ActorSystem() as system:
            ref = prompt_cache.spawn_prompt_cache(
                system, cap_bytes=first.meta.nbytes, registry=registry, spill=sink
            )
            await ref.tell(_put(first, (1, 2)))  # a tell: no reply, still stored
            res = await ref.ask(_put(second, (3, 4)), timeout=ASK, expect=PutResult)
            assert res.evicted == 1
            assert [e.handle for e in sink.entries] == [first.handle]
            assert sink.entries[0].tokens == (1, 2)
            # the spilled handle stays alive for the cold tier only if it was accepted
            assert (first.handle in registry) is accept
            miss = await ref.ask(Take(tokens=(1, 2, 5)), timeout=ASK, expect=TakeResult)
            assert miss.handle is None
        if accept:
            registry.dispose(first.handle)  # the sink's duty once it has written the entry


async def test_put_as_tell_disposes_refused_entries(model: Any) -> None:
    """A too-large put sent as a tell is disposed without any reply being attempted."""
    registry = CacheRegistry()
    big = _register(registry, model, (1, 2, 3))
    async with ActorSystem() as system:
        ref = prompt_cache.spawn_prompt_cache(system, cap_bytes=big.meta.nbytes - 1, registry=registry)
        await ref.tell(_put(big, (1, 2, 3)))
        stats = await ref.ask(PromptCacheStatsRequest(), timeout=ASK, expect=PromptCacheStats)
        assert (stats.rejected_too_large, stats.entries) == (1, 0)
    assert big.handle not in registry
    assert not system.dead_letters()
