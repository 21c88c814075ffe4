"""Two per-request costs of a long prompt on the event loop: kvtier's code beside the plain Python it replaced.

An agent's turn carries its whole conversation (thousands of tokens) and
every request crosses the event loop, where each microsecond delays every
other client's tokens. This times, side by side in one run, for a prompt of
``--tokens`` ids:

- the batch scheduler's deferral compare (a new row's prompt against each
  joined row's, sharing ``--shared`` tokens: an agent trace's system
  prompt): ``common_prefix_len`` (galloping slices) against a Python loop;
- the checkpoint request key (``request_key``, whole: head, parameters,
  token ids packed in C) against the token packing it replaced alone (a
  Python pass and ``struct.pack``), so the ratio is at most the old key's;
- the SSD tier's entry file name (``entry_name``, per store) against the
  same digest over ids packed one ``int.to_bytes`` at a time.

::

    .venv/bin/python tools/bench/request_costs.py --tokens 5000 --shared 4400
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.checkpoints import request_key
from actors.prompt_cache.core import common_prefix_len
from actors.ssd_writer.core import entry_name
from messages.gateway import GenerationParams


def loop_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The replaced compare: one Python step a token."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def packed_in_python(tokens: tuple[int, ...]) -> bytes:
    """The replaced packing: a Python pass for the range check, then ``struct.pack``."""
    ids = [int(t) for t in tokens]
    if any(not 0 <= t < 1 << 32 for t in ids):
        raise ValueError("token ids must lie in [0, 2**32)")
    return struct.pack(f"<{len(ids)}I", *ids)


def name_in_python(tokens: tuple[int, ...]) -> str:
    """The replaced entry name: each id's 8 bytes joined in a Python pass."""
    raw = b"".join(t.to_bytes(8, "little") for t in tokens)
    return hashlib.blake2b(raw, digest_size=16).hexdigest() + ".kvt"


def median_us(fn: Callable[[], object], repeats: int) -> float:
    """Median microseconds of one call."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=5000, help="prompt length (default 5000)")
    p.add_argument("--shared", type=int, default=4400, help="tokens two rows' prompts share (default 4400)")
    p.add_argument("--repeats", type=int, default=300, help="timed calls of each (default 300)")
    args = p.parse_args(argv)
    if not 0 <= args.shared <= args.tokens:
        p.error("--shared must lie in [0, --tokens]")
    rng = random.Random(0)
    a = tuple(rng.randrange(1, 49_000) for _ in range(args.tokens))
    b = a[: args.shared] + tuple(rng.randrange(49_000, 50_000) for _ in range(args.tokens - args.shared))
    assert loop_prefix(a, b) == common_prefix_len(a, b) == args.shared
    assert name_in_python(a) == entry_name(a)
    params = GenerationParams()
    rows = [
        ("deferral compare, a row", median_us(lambda: common_prefix_len(a, b), args.repeats),
         median_us(lambda: loop_prefix(a, b), args.repeats)),
        ("request key (old: packing alone)",
         median_us(lambda: request_key(a, params, namespace="n", fingerprint="f"), args.repeats),
         median_us(lambda: packed_in_python(a), args.repeats)),
        ("SSD entry name", median_us(lambda: entry_name(a), args.repeats),
         median_us(lambda: name_in_python(a), args.repeats)),
    ]
    print(f"{args.tokens}-token prompt, {args.shared} shared; median of {args.repeats} calls")
    print(f"{'cost':34s} {'kvtier':>10s} {'plain Python':>13s} {'ratio':>6s}")
    for name, ours, plain in rows:
        print(f"{name:34s} {ours:8.1f} us {plain:10.1f} us {ours / plain:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
