"""The store worker's file work on threads that yield the CPU to decode (docs/cold-tier.md).

Background durability work (prompt spills, generation checkpoints, their
removals) reads tensors, hashes them, copies them into the page cache and
waits for fsync: native work that runs without the GIL, so on a machine
whose cores the engine keeps busy it takes CPU time from decode. Measured
on the 2-core CPU box with 8 rows decoding and a checkpoint of every row
every 100 tokens: ~0.65 GB written a run, 0.8 s of CPU on the writing
threads, and the batch's decode rate 0.90x the rate without checkpoints
(docs/cold-tier.md, "Generation checkpoints"). :class:`BackgroundThreads`
runs that work on its own threads at the lowest CPU priority
(:data:`BACKGROUND_NICE`), so the scheduler gives them a core only when
decode leaves one; a request that waits for a file (a restore, a
checkpoint lookup) never runs here.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from actors.runtime import get_logger

__all__ = ["BACKGROUND_NICE", "BackgroundThreads", "lower_thread_priority"]

T = TypeVar("T")

BACKGROUND_NICE = 19
"""The nice value of the background threads (19: the lowest priority, CFS weight 15 against 1024)."""

_log = get_logger("kvtier.ssd_writer")


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Give the calling thread the nice value ``nice``; ``False`` where threads have no nice of their own.

    Linux only: there ``setpriority(PRIO_PROCESS, tid)`` sets one thread's
    nice value (POSIX would set the process's; elsewhere nothing is done).
    Raising a thread's own nice value needs no privilege. A refusal is
    logged and the thread runs at its old priority (slower decode, nothing
    lost).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        _log.warning("ssd_cache.background_priority_refused", nice=nice, error=str(exc))
        return False
    return True


class BackgroundThreads:
    """An ``IoRunner`` over its own ``threads`` worker threads, each at :data:`BACKGROUND_NICE`.

    A loop-only port (asyncio): the cold tier's actors share one instance,
    and every call comes from the event loop's thread. The threads start on first use (named
    ``kvtier-ssd-store_<i>``) and end when the pool is garbage-collected or
    the interpreter exits. NOTE: like ``anyio.to_thread.run_sync`` (which
    the tier's shared pool uses), a call is never abandoned: a cancellation
    waits for the call to return, so no argument (a lent tensor view) is
    left with a running thread; the caller's next await raises it.
    """

    def __init__(self, threads: int = 1, *, nice: int = BACKGROUND_NICE,
                 name: str = "kvtier-ssd-store") -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._threads = threads
        self._nice = nice
        self._name = name
        self._executor: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._threads, thread_name_prefix=self._name,
                initializer=lower_thread_priority, initargs=(self._nice,))
        return self._executor

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a background thread; its result or exception."""
        await anyio.lowlevel.checkpoint()  # NOTE: a cancelled caller starts no call.
        future = self._pool().submit(functools.partial(fn, *args, **kwargs))
        with anyio.CancelScope(shield=True):
            result = await asyncio.wrap_future(future)
        return result
