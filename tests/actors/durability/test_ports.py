"""The coordinator's ports: the registry cloner, the clone slot, the loop alarm."""

from __future__ import annotations

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from actors.durability import CloneSlot, GatewaySteps, LoopAlarm, RegistryCloner
from actors.durability.core import Cloned, CloneFailed, Vanished
from actors.engine_thread import BackgroundSteps
from actors.runtime import SystemClock
from kernels import CacheRegistry
from messages import EntryMeta


def _kv(tokens: int) -> KVCache:
    cache = KVCache()  # type: ignore[no-untyped-call]
    keys = mx.arange(tokens * 8, dtype=mx.float32).reshape(1, 2, tokens, 4)
    cache.update_and_fetch(keys, keys + 1)  # type: ignore[no-untyped-call]
    return cache


def test_a_registry_clone_outlives_the_original_entry() -> None:
    """A clone has the entry's offset and values, and stays readable after the original is disposed."""
    registry = CacheRegistry()
    kept = registry.register([_kv(5)], offset=5)
    cloner = RegistryCloner(registry)
    made = cloner.clone(kept.handle)
    assert made is not None
    handle, meta = made
    assert handle != kept.handle
    assert (meta.offset, meta.trimmable) == (5, kept.meta.trimmable)
    expected = mx.array(registry.get(kept.handle)[0].keys[..., :5, :])
    registry.dispose(kept.handle)
    registry.drain()
    (view,) = registry.materialize(handle, 5)
    assert mx.array_equal(view.keys[..., :5, :], expected).item()
    cloner.dispose(handle)
    assert len(registry) == 0


def test_cloning_a_disposed_handle_says_it_vanished() -> None:
    """A handle the RAM tier already gave back clones to None (no error, nothing registered)."""
    registry = CacheRegistry()
    kept = registry.register([_kv(3)], offset=3)
    registry.dispose(kept.handle)
    assert RegistryCloner(registry).clone(kept.handle) is None
    assert len(registry) == 0


class _Cloner:
    """A scripted Cloner: clones to c1, c2, ... (or raises); records disposals."""

    def __init__(self, *, gone: bool = False, fail: bool = False) -> None:
        self.gone, self.fail = gone, fail
        self.made: list[str] = []
        self.disposed: list[str] = []

    def clone(self, handle: str) -> tuple[str, EntryMeta] | None:
        if self.fail:
            raise RuntimeError("boom")
        if self.gone:
            return None
        self.made.append(f"c{len(self.made) + 1}")
        return self.made[-1], EntryMeta(offset=1, nbytes=1, trimmable=True, min_reusable_offset=0)

    def dispose(self, handle: str) -> None:
        self.disposed.append(handle)


def test_a_clone_slot_hands_the_clone_over_once() -> None:
    """run() then take(): the taker owns the clone; nothing is disposed."""
    cloner = _Cloner()
    slot = CloneSlot(cloner, "h")
    slot.run()
    outcome = slot.take()
    assert isinstance(outcome, Cloned)
    assert outcome.handle == "c1"
    assert slot.take() is None
    assert cloner.disposed == []


def test_an_abandoned_slot_disposes_the_clone_whenever_it_is_made() -> None:
    """abandon() after run() disposes at once; abandon() before run() makes run() dispose it."""
    cloner = _Cloner()
    after = CloneSlot(cloner, "h")
    after.run()
    after.abandon()
    before = CloneSlot(cloner, "h")
    before.abandon()
    before.run()
    assert cloner.disposed == ["c1", "c2"]


@pytest.mark.parametrize(
    ("cloner", "kind"), [(_Cloner(gone=True), Vanished), (_Cloner(fail=True), CloneFailed)]
)
def test_a_slot_reports_a_vanished_handle_and_a_failed_clone(cloner: _Cloner, kind: type) -> None:
    """A gone handle is Vanished; an exception in the clone is CloneFailed (never raised)."""
    slot = CloneSlot(cloner, "h")
    slot.run()
    assert isinstance(slot.take(), kind)


@pytest.mark.anyio
async def test_the_loop_alarm_fires_once_and_can_be_moved_or_cancelled() -> None:
    """set() fires once at its time; a later set() replaces it; set(None) cancels."""
    clock = SystemClock()
    alarm = LoopAlarm(clock)
    fired: list[str] = []
    alarm.set(clock.now() + 0.02, lambda: fired.append("a"))
    alarm.set(clock.now() + 0.04, lambda: fired.append("b"))
    await anyio.sleep(0.15)
    assert fired == ["b"]
    alarm.set(clock.now() + 0.02, lambda: fired.append("c"))
    alarm.set(None, lambda: fired.append("d"))
    await anyio.sleep(0.1)
    assert fired == ["b"]


def test_gateway_steps_register_with_the_runner_and_withdraw_on_discard() -> None:
    """add() makes the step takeable by the runner; discard() before it runs means it never runs."""
    steps = BackgroundSteps()
    port = GatewaySteps(steps)
    port.add("s1", lambda: 1)
    port.add("s2", lambda: 2)
    taken = steps.take("s1")
    assert taken is not None
    assert taken() == 1
    port.discard("s1")
    port.discard("s2")
    assert steps.take("s2") is None
    assert len(steps) == 1  # NOTE: s1 is still the runner's until it settles it.
