"""The collector and the start-up heap: ``kvtier serve`` freezes what start-up left alive while it serves.

NOTE: CPython's full (generation 2) collection walks every tracked
container, and a server's start-up leaves ~117k of them (transformers,
mlx-lm, the tokenizer, the actors): one full collection took ~65 ms on the
2-core box, and it runs on whichever thread allocates when the thresholds
say so, holding the GIL: the event loop's clients all wait for it (a
``durability.schedule`` handler took 79.6 ms once in a CPU agent trace,
against 0.1-0.3 ms for every other one). ``gc.freeze()`` after start-up
moves those objects to a generation no collection walks (the same full
collection then took ~0 ms); objects made while serving are collected as
before, and reference counting still frees frozen objects. Only a cycle
among start-up objects that becomes garbage while serving waits, so the
heap is thawed before the engine closes: its last collections (the engine
thread's, before MLX settles) reach everything again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["startup_heap_frozen"]


@contextmanager
def startup_heap_frozen() -> Iterator[int]:
    """Collect, then freeze every object alive now until the block ends; yields how many were frozen."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
