"""What one prompt lookup's scan costs: ``common_prefix_len`` over every entry of a namespace.

The RAM tier's ``Take`` and the SSD index's ``Find`` each compare the prompt
with every entry of its namespace. After a load generator's run both hold
hundreds of entries (the H200 runs: ~100 in RAM, ~160 files), and the
prompts of a chat template share only its first tokens. This times one
lookup's scan over ``--entries`` entries of ``--entry-tokens`` tokens for a
prompt that shares ``--shared`` tokens with each of them, and for a prompt
that one entry holds whole (a hit), with kvtier's ``common_prefix_len``
(galloping slices) and, side by side in the same run, the whole-prompt-first
binary search it replaced::

    .venv/bin/python tools/bench/lookup_scan.py --entries 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.prompt_cache.core import common_prefix_len

Prefix = Callable[[tuple[int, ...], tuple[int, ...]], int]


def whole_first(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The replaced algorithm: compare the whole overlap, then binary-search the mismatch."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def scan_ms(fn: Prefix, entries: Sequence[tuple[int, ...]], prompt: tuple[int, ...],
            repeats: int) -> float:
    """Median milliseconds of one scan of every entry."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for entry in entries:
            fn(entry, prompt)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    """Print both algorithms' scan times and their ratio, per kind of prompt."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=300)
    p.add_argument("--entry-tokens", type=int, default=620)
    p.add_argument("--shared", type=int, default=20, help="tokens every prompt shares (a template's)")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args(argv)
    rng = random.Random(0)
    shared = tuple(rng.randrange(1000) for _ in range(args.shared))
    tail = args.entry_tokens - args.shared
    entries = [shared + tuple(rng.randrange(50_000) for _ in range(tail)) for _ in range(args.entries)]
    prompts = {
        f"new prompt (shares {args.shared})": shared + tuple(rng.randrange(50_000) for _ in range(tail)),
        "one entry's whole prompt": entries[len(entries) // 2],
    }
    for fn in (common_prefix_len, whole_first):
        for prompt in prompts.values():
            assert [fn(e, prompt) for e in entries] == [whole_first(e, prompt) for e in entries]
    print(f"one lookup's scan of {args.entries} entries of {args.entry_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"{'prompt':<28}{'galloping ms':>14}{'whole-first ms':>16}{'ratio':>8}")
    for name, prompt in prompts.items():
        new = scan_ms(common_prefix_len, entries, prompt, args.repeats)
        old = scan_ms(whole_first, entries, prompt, args.repeats)
        print(f"{name:<28}{new:>14.3f}{old:>16.3f}{new / old:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
