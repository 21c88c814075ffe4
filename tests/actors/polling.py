"""Polling for a condition that has no event to wait on, shared by actor tests."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def until(check: Callable[[], bool], *, seconds: float = 10.0, every: float = 0.005) -> None:
    """Return once ``check()`` holds; fail the test if it does not within ``seconds``."""
    for _ in range(max(1, int(seconds / every))):
        if check():
            return
        await anyio.sleep(every)
    raise AssertionError(f"not reached within {seconds:g} s")
