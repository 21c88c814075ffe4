"""A RAM hit never writes and never waits for the SSD tier (rules R1-4 and R4-8).

Real Engine (tiny fp32 Llama, production wiring, SSD tier in a temp
directory) with a scripted file port: the tier's writes are held (a store
stays in flight for the whole test) or fail with ``EIO``. A request that
extends an earlier conversation is still served from RAM, at once, and the
hit itself sends nothing to the spill queue, the durability coordinator or
the store worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from messages import PromptCacheStats, PromptCacheStatsRequest, Release, Take, TakeResult
from tests.actors.persistence_faults import (
    DEADLINE,
    PARAMS,
    FailingWritesPort,
    HeldWritesPort,
    ids,
    serving,
    wait_for_stats,
    wait_set,
)
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PERSISTENCE_ACTORS = ("spill_queue", "durability", "ssd_writer.store", "ssd_writer.read")
"""Every actor that writes, or queues work for a write (``ssd_writer`` itself answers the
index-only ``Find`` a hit may ask, so it is not listed)."""


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return kv_llama(vocab_size=len(tok))


def _conversation(tok: Any, text: str) -> list[int]:
    return ids(tok, text * 3)


async def test_a_ram_hit_sends_nothing_to_the_persistence_actors(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """R1-4: a Take answered from RAM sends no message to the spill queue, the coordinator, the
    store worker or the reader, adds no dirty record and reaches no file write."""
    port = HeldWritesPort()
    async with serving(model, tok, tmp_path, port, release=port.release.set,
                       ssd_writebehind=False) as engine:
        first = _conversation(tok, "A RAM hit writes nothing to the disk tier. ")
        done = await engine.complete_prompt(first, PARAMS)
        second = [*first, *done.token_ids, *ids(tok, " And then?")]
        before_stats = await engine.stats()
        system = engine.system
        assert system is not None
        before = {a: system.ref(a).statistics().sent for a in PERSISTENCE_ACTORS}
        result = await system.ask("prompt_cache", Take(tokens=tuple(second)), timeout=DEADLINE,
                                  expect=TakeResult)
        # NOTE: the cache handles one message at a time, so once it answered the next ask every
        # message its Take handler sent is in its receiver's mailbox (counted as sent).
        await system.ask("prompt_cache", PromptCacheStatsRequest(), timeout=DEADLINE,
                         expect=PromptCacheStats)
        after = {a: system.ref(a).statistics().sent for a in PERSISTENCE_ACTORS}
        assert result.lease_id is not None
        await system.tell("prompt_cache", Release(lease_id=result.lease_id))
        after_stats = await engine.stats()
        writes = port.writes_started
    # NOTE: the serial lane's completion entry holds the prompt and the answer but its last token.
    assert (result.tier, result.cached_tokens) == ("ram", len(first) + len(done.token_ids) - 1)
    assert after == before
    for stats in (before_stats, after_stats):
        assert stats["ssd_cache"]["writebehind_dirty"] == 1
        assert (stats["ssd_cache"]["pending_spills"], stats["prompt_cache"]["spilled"]) == (0, 0)
    assert after_stats["prompt_cache"]["hits"] == before_stats["prompt_cache"]["hits"] + 1
    assert writes == 0


async def test_a_request_served_from_ram_persists_only_its_own_put(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """R1-4 through the whole request path: a request that hits RAM adds exactly one dirty record
    (its own completion, as a miss does) and queues no write; nothing reaches the file port."""
    port = HeldWritesPort()
    async with serving(model, tok, tmp_path, port, release=port.release.set,
                       ssd_writebehind=False) as engine:
        first = _conversation(tok, "Only puts are persisted, never a hit. ")
        done = await engine.complete_prompt(first, PARAMS)
        after_miss = await engine.stats()
        second = [*first, *done.token_ids, *ids(tok, " Go on.")]
        again = await engine.complete_prompt(second, PARAMS)
        after_hit = await engine.stats()
        writes = port.writes_started
    assert again.usage.cached_tokens == len(first) + len(done.token_ids) - 1
    assert (after_miss["prompt_cache"]["hits"], after_hit["prompt_cache"]["hits"]) == (0, 1)
    assert after_miss["ssd_cache"]["writebehind_dirty"] == 1
    assert after_hit["ssd_cache"]["writebehind_dirty"] == 2
    for stats in (after_miss, after_hit):
        assert (stats["ssd_cache"]["pending_spills"], stats["prompt_cache"]["spilled"]) == (0, 0)
    assert writes == 0


async def test_a_ram_hit_is_served_while_the_ssd_write_of_its_prefix_hangs(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """R4-8: while the write-behind store of the first request's entry hangs in a file write, a
    request extending it is a RAM hit and completes; the store is still in flight afterwards."""
    port = HeldWritesPort()
    async with serving(model, tok, tmp_path, port, release=port.release.set) as engine:
        first = _conversation(tok, "A pending write never blocks a hit. ")
        done = await engine.complete_prompt(first, PARAMS)
        await wait_set(port.held)
        stuck = await engine.stats()
        second = [*first, *done.token_ids, *ids(tok, " Next?")]
        with anyio.fail_after(DEADLINE):
            again = await engine.complete_prompt(second, PARAMS)
        after = await engine.stats()
        writes = port.writes_started
    for stats in (stuck, after):
        cold = stats["ssd_cache"]
        assert (cold["pending_spills"], cold["entries"], cold["spills"]) == (1, 0, 0)
        assert cold["pending_snapshots"] >= 1
        assert cold["writebehind_dirty"] >= 1
    assert stuck["ssd_cache"]["pending_snapshots"] == 1
    assert again.finish_reason == "length"
    assert again.usage.cached_tokens == len(first) + len(done.token_ids) - 1
    assert (after["prompt_cache"]["hits"], after["ssd_cache"]["hits"]) == (1, 0)
    assert writes == 1


async def test_a_ram_hit_is_served_after_the_ssd_write_of_its_prefix_failed(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """R4-8: after the write-behind store of the first request's entry failed with EIO (counted,
    the record left dirty), a request extending it is a RAM hit and completes without error."""
    port = FailingWritesPort()
    async with serving(model, tok, tmp_path, port, release=port.failing.clear) as engine:
        first = _conversation(tok, "A failed write never blocks a hit. ")
        done = await engine.complete_prompt(first, PARAMS)
        failed = await wait_for_stats(engine, lambda s: s["ssd_cache"]["failed_spills"] >= 1)
        second = [*first, *done.token_ids, *ids(tok, " Next?")]
        with anyio.fail_after(DEADLINE):
            again = await engine.complete_prompt(second, PARAMS)
        after = await engine.stats()
    cold = failed["ssd_cache"]
    assert port.failures >= 1
    assert cold["store_failures"] >= 1
    assert (cold["entries"], cold["spills"]) == (0, 0)
    assert cold["writebehind_dirty"] == 1
    assert again.finish_reason == "length"
    assert again.usage.cached_tokens == len(first) + len(done.token_ids) - 1
    assert (after["prompt_cache"]["hits"], after["ssd_cache"]["hits"]) == (1, 0)
