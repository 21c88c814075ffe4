"""The checker's synchronous restart agrees with the real tier actors starting on the same files.

The exhaustive sweep restarts thousands of crash states through
``checker.restart`` (the start hook's steps, called directly, for speed).
This test runs the real ``ssd_writer`` actors on a sample of those states
and requires the same index, the same files left after the startup's
removals, and restores that return exactly the bytes the checker found
servable.
"""

from __future__ import annotations

import pytest

from tests.crash import checker
from tests.crash.checker import RestartStep, StoreStep
from tests.crash.crash_fs import CrashFS, CrashState

pytestmark = pytest.mark.anyio

SAMPLE = [
    (StoreStep("A"), StoreStep("B"), StoreStep("C")),
    (StoreStep("A"), StoreStep("A+")),
    (StoreStep("B"), RestartStep(), StoreStep("A")),
]


async def _states() -> list[CrashState]:
    seen: set[tuple[object, ...]] = set()
    out: list[CrashState] = []
    for workload in SAMPLE:
        fs = CrashFS(record=True)
        await checker.forward(workload, fs=fs)
        for space in fs.spaces:
            for state in space.states(observe=checker._observed):
                key = checker._state_key(state)
                if key not in seen:
                    seen.add(key)
                    out.append(state)
    return out


async def test_the_real_actors_restart_every_sampled_state_like_the_checker() -> None:
    """Same index, same files after startup, same bytes served, for every sampled crash state."""
    states = await _states()
    assert len(states) >= 20
    for state in states:
        quick, _ = checker.restart(state)
        real = await checker.actor_restart(state)
        assert real.indexed == quick.indexed, state.describe()
        assert real.files == quick.files, state.describe()
        servable = {e.path for e in quick.servable}
        for path, got in real.served.items():
            if path in servable:
                entry = next(e for e in quick.servable if e.path == path)
                assert got == checker.originals()[(entry.namespace, entry.tokens)], path
            else:
                assert got is None, path
