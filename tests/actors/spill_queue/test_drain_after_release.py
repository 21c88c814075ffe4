"""Released handles are followed by a drain turn, so their arrays leave memory without waiting
for a request (the spill queue's ``drain_step`` rule, and in a running Engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams
from actors.spill_queue import core
from messages import Failure, StoreResult
from messages.gateway import TurnDone
from tests.actors.spill_queue.test_core import enqueue, env, released
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

STEP = "prompt_cache.drain"


def drains(effects: list[core.Effect]) -> list[str]:
    """Drain steps the effects ask for."""
    return [e.step_id for e in effects if isinstance(e, core.RequestDrain)]


def test_a_stored_items_release_asks_for_a_drain_after_it() -> None:
    """The writer's answer releases the handle, then one drain turn is asked for (in that order)."""
    state = core.QueueState(cap_bytes=100, drain_step=STEP)
    state, effects = core.handle(state, env(enqueue("h1", 10)))
    assert drains(effects) == []
    state, effects = core.handle(state, env(StoreResult(handle="h1", stored=True)))
    assert released(effects) == ["h1"]
    assert isinstance(effects[-1], core.RequestDrain)
    assert (drains(effects), state.drains_requested) == ([STEP], 1)


def test_one_drain_in_flight_and_releases_meanwhile_ask_again_when_it_is_done() -> None:
    """A second release while a drain is asked for waits; the TurnDone then asks for one more."""
    state = core.QueueState(cap_bytes=100, drain_step=STEP)
    for h in ("h1", "h2"):
        state, _ = core.handle(state, env(enqueue(h, 10)))
    state, first = core.handle(state, env(StoreResult(handle="h1", stored=True)))
    state, second = core.handle(state, env(StoreResult(handle="h2", stored=True)))
    assert (drains(first), drains(second)) == ([STEP], [])
    state, done = core.handle(state, env(TurnDone(step_id=STEP, ok=True)))
    assert drains(done) == [STEP]
    state, idle = core.handle(state, env(TurnDone(step_id=STEP, ok=True)))
    assert drains(idle) == []
    assert state.drain_in_flight is False


def test_an_unsent_drain_request_is_asked_again_by_the_next_release() -> None:
    """When the gateway could not be told, the next release asks again (no drain is lost)."""
    state = core.QueueState(cap_bytes=100, drain_step=STEP)
    state, _ = core.handle(state, env(enqueue("h1", 10)))
    state, _ = core.handle(state, env(enqueue("h2", 10)))
    state, effects = core.handle(state, env(StoreResult(handle="h1", stored=True)))
    assert drains(effects) == [STEP]
    state, _ = core.handle(state, core.DrainUndelivered())
    state, effects = core.handle(state, env(StoreResult(handle="h2", stored=True)))
    assert drains(effects) == [STEP]


@pytest.mark.parametrize("failure", ["writer_failure", "store_unavailable"])
def test_a_failed_stores_release_is_counted_once(failure: str) -> None:
    """A writer failure releases its handle once: one drain asked, and its TurnDone ends the drains."""
    state = core.QueueState(cap_bytes=100, drain_step=STEP)
    state, _ = core.handle(state, env(enqueue("h1", 10)))
    event: core.Event = (
        env(Failure(error="RuntimeError", actor="ssd_writer"))
        if failure == "writer_failure"
        else core.StoreUnavailable(handle="h1", reason="gone")
    )
    state, effects = core.handle(state, event)
    assert (released(effects), drains(effects)) == (["h1"], [STEP])
    assert state.undrained == 0
    state, done = core.handle(state, env(TurnDone(step_id=STEP, ok=True)))
    assert drains(done) == []


def test_without_a_drain_step_nothing_is_asked() -> None:
    """A queue wired without the gateway (tests, tools) only releases."""
    state = core.QueueState(cap_bytes=100)
    state, _ = core.handle(state, env(enqueue("h1", 10)))
    state, effects = core.handle(state, env(StoreResult(handle="h1", stored=True)))
    assert (released(effects), drains(effects)) == (["h1"], [])


async def _stats(engine: Engine) -> dict[str, Any]:
    stats: dict[str, Any] = await engine.stats(timeout=5.0)
    return stats


@pytest.mark.anyio
async def test_entries_spilled_to_disk_leave_memory_while_the_engine_is_idle(tmp_path: Path) -> None:
    """After the spill queue stored the evicted entries, no disposed arrays wait in the
    registry, with no request after them (before: they waited for the next request's turn)."""
    tok = tiny_tokenizer()
    engine = Engine.from_loaded(tiny_llama(vocab_size=len(tok)), tok, model_id="tiny",
                                identity=IDENTITY, prompt_cache_bytes=50_000,
                                ssd_cache=tmp_path / "tier", ssd_writebehind=False)
    params = GenerationParams(max_tokens=2)
    async with engine:
        for i in range(8):
            prompt = [int(t) for t in tok.encode(f"prompt {i} about something else entirely. ")]
            await engine.complete_prompt(prompt, params)
        with anyio.fail_after(30):
            while True:
                stats = await _stats(engine)
                if stats["ssd_cache"]["pending_spills"] == 0 and stats["ssd_cache"]["spills"] >= 3:
                    break
                await anyio.sleep(0.05)
        with anyio.fail_after(10):
            while True:
                stats = await _stats(engine)
                if stats["cache_registry"]["pending_dispose"] == 0:
                    break
                await anyio.sleep(0.05)
    assert stats["prompt_cache"]["spilled"] >= 3
    assert stats["cache_registry"]["pending_dispose"] == 0
