"""The product's restore, as the benchmarks time it: the reader's pass on a worker, the landing behind it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kernels.cache import LandingPool, OpenEntry, land_entry

__all__ = ["land_behind_pass"]


def land_behind_pass(
    entry: OpenEntry, pool: LandingPool | None, streams: Sequence[Any] | None = None
) -> tuple[list[Any], float]:
    """Run ``entry``'s reader pass on a thread and land it at once behind the pass (as a granted turn does).

    ``streams``: the landing's fill streams (default the product's: one
    CPU stream; a what-if passes more). Returns the caches and the
    ``perf_counter`` time the pass ended. The entry is closed on every path;
    a failed pass re-raises here.
    """
    ended: list[float] = []
    failed: list[BaseException] = []

    def reader() -> None:
        try:
            entry.pass_over()
        except BaseException as exc:  # noqa: BLE001 - NOTE: re-raised on the calling thread.
            failed.append(exc)
        ended.append(time.perf_counter())

    thread = threading.Thread(target=reader, name="bench-reader")
    thread.start()
    try:
        caches = land_entry(entry, pool=pool, streams=streams)
    finally:
        thread.join()
        entry.close()
    if failed:
        raise failed[0]
    return caches, ended[0]
