"""What one full collection of CPython's collector costs a started engine, with and without the start-up heap frozen.

``kvtier serve`` freezes what start-up left alive (``actors/cli/heap.py``)
because a full (generation 2) collection walks every tracked container and
holds the GIL while it does: the event loop's clients wait for it. This
starts an :class:`~actors.engine.Engine` on the default model in this
process (as ``kvtier serve`` does, the HTTP app aside), runs one short
generation, then times ``gc.collect()`` ``--repeats`` times before and
after ``startup_heap_frozen()``, side by side in one run::

    .venv/bin/python tools/bench/gc_pause.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.cli.heap import startup_heap_frozen
from actors.engine import Engine
from kernels import default_model_dir
from messages.gateway import GenerationParams


def full_collections_ms(repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` full collections."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1e3)
    return out


async def measure(repeats: int) -> tuple[int, int, list[float], list[float]]:
    """Start an engine, generate once, then time full collections thawed and frozen."""
    async with Engine(default_model_dir()) as engine:
        await engine.complete_prompt("The capital of France is", GenerationParams(max_tokens=8))
        tracked = len(gc.get_objects())
        thawed = full_collections_ms(repeats)
        with startup_heap_frozen() as frozen:
            frozen_ms = full_collections_ms(repeats)
    return tracked, frozen, thawed, frozen_ms


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="full collections timed each way (default 5)")
    args = p.parse_args(argv)
    tracked, frozen, thawed, frozen_ms = anyio.run(measure, args.repeats)
    print(f"tracked objects after start-up and one generation: {tracked}; frozen: {frozen}")
    print(f"full collection, start-up heap thawed: median {statistics.median(thawed):.2f} ms "
          f"[{min(thawed):.2f}..{max(thawed):.2f}]")
    print(f"full collection, start-up heap frozen: median {statistics.median(frozen_ms):.2f} ms "
          f"[{min(frozen_ms):.2f}..{max(frozen_ms):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
