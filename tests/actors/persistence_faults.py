"""Scripted SSD file ports and helpers for tests that serve requests while persistence is stuck.

``HeldWritesPort`` makes every positional write wait until the test releases
it, so an SSD store stays in flight for as long as the test wants;
``FailingWritesPort`` makes every positional write fail with ``EIO`` until
the test heals it. Both forward everything else to the real file system.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from actors.engine import Engine, GenerationParams
from tests.actors.ssd_writer.support import ForwardingPort, InjectedFault
from tests.actors.test_cold_tier_engine import IDENTITY

__all__ = [
    "DEADLINE",
    "PARAMS",
    "FailingWritesPort",
    "HeldWritesPort",
    "ids",
    "serving",
    "wait_for_stats",
    "wait_set",
]

PARAMS = GenerationParams(max_tokens=6)
DEADLINE = 30.0
"""A generous bound for one request or one wait: only a hang can exceed it."""
HOLD_LIMIT_S = 120.0
"""How long a held write waits for the test's release before it fails (a safety valve only)."""


class HeldWritesPort(ForwardingPort):
    """Every positional write (``pwrite_all``) waits until ``release`` is set.

    ``held`` is set once the first write waits, so the test knows an SSD
    store is in flight and cannot finish. ``writes_started`` counts the
    writes that reached the port.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.release = threading.Event()
        self.writes_started = 0

    def _before(self, method: str, *args: Any) -> None:
        if method != "pwrite_all":
            return
        self.writes_started += 1
        if self.release.is_set():
            return
        self.held.set()
        if not self.release.wait(HOLD_LIMIT_S):
            raise InjectedFault(errno.EIO, "the test never released the held write")


class FailingWritesPort(ForwardingPort):
    """Every positional write fails with ``EIO`` while ``failing`` is set; ``failures`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = threading.Event()
        self.failing.set()
        self.failures = 0

    def _before(self, method: str, *args: Any) -> None:
        if method == "pwrite_all" and self.failing.is_set():
            self.failures += 1
            raise InjectedFault(errno.EIO, "injected EIO at pwrite_all")


def ids(tok: Any, text: str) -> list[int]:
    """``text`` as token ids."""
    return [int(t) for t in tok.encode(text)]


@asynccontextmanager
async def serving(
    model: Any, tok: Any, root: Path, port: Any, *, release: Callable[[], None], **options: Any
) -> AsyncIterator[Engine]:
    """An engine with a 64 MiB RAM tier and the SSD tier at ``root`` through ``port``.

    ``release`` runs before the engine closes, whatever the test did, so the
    close's flush never waits on a write the test held or failed on purpose.
    """
    # NOTE: idle demotion off: it would queue writes on its own schedule, and the tests count
    # every write that reaches the port or the spill queue.
    settings: dict[str, Any] = {"prompt_cache_bytes": 1 << 26, "ssd_cache": root,
                                "ssd_demote_idle": 0.0, **options}
    engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                                file_port=port, **settings)
    async with engine:
        try:
            yield engine
        finally:
            release()


async def wait_set(event: threading.Event) -> None:
    """Wait (on a worker thread, off the event loop) until ``event`` is set; fail after ``DEADLINE``."""
    assert await anyio.to_thread.run_sync(event.wait, DEADLINE), "the event was never set"


async def wait_for_stats(engine: Engine, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll ``engine.stats()`` until ``predicate(stats)`` holds (fails after ``DEADLINE`` seconds)."""
    with anyio.fail_after(DEADLINE):
        while True:
            stats = await engine.stats(timeout=5.0)
            if predicate(stats):
                return stats
            await anyio.sleep(0.02)
