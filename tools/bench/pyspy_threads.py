"""Where each thread's time goes in a py-spy profile: samples per thread, its top frames, self and total.

Reads ``py-spy record --threads --format raw`` output (one collapsed stack
per line: ``frame;frame;...;leaf COUNT``, the thread as one of the first
frames) and prints, per thread with at least ``--min-share`` of the
samples: its sample count and share, the ``--top`` leaf frames (self time)
and the ``--top`` frames anywhere on its stacks (total time; frames on
every one of its stacks left out). Used on the
lent GPU's profiles (``tools/bench/gpu_serving.sh profile`` and
``ssdprofile``), where the question is which thread holds the time (with
``--gil`` recorded: the GIL) while the engine thread decodes::

    python3 tools/bench/pyspy_threads.py pyspy-raw.txt --top 12
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path


def parse(lines: Iterable[str]) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks per thread: ``{thread: [(frames root first, count), ...]}``; lines without a count are skipped."""
    out: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "?"
        for i, frame in enumerate(frames[:3]):
            # NOTE: py-spy names the thread "thread (ID): NAME" in one of the first frames.
            if frame.startswith("thread "):
                thread = frame
                frames = frames[i + 1:]
                break
        out[thread].append((frames, int(count)))
    return out


def _short(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (file.py:12)``."""
    m = re.match(r"^(.*) \((.*?)([^/]+)\)$", frame)
    return f"{m.group(1)} ({m.group(3)})" if m else frame


def report(threads: dict[str, list[tuple[list[str], int]]], *, top: int, min_share: float) -> list[str]:
    """The per-thread table, busiest thread first."""
    total = sum(c for stacks in threads.values() for _, c in stacks) or 1
    lines = [f"{total} samples in {len(threads)} threads"]
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        n = sum(c for _, c in stacks)
        if n / total < min_share:
            continue
        leaf: collections.Counter[str] = collections.Counter()
        anywhere: collections.Counter[str] = collections.Counter()
        for frames, c in stacks:
            if frames:
                leaf[_short(frames[-1])] += c
            for frame in set(frames):
                anywhere[_short(frame)] += c
        lines += ["", f"{thread}: {n} samples ({n / total:.1%})"]
        lines.append("  self:")
        lines += [f"    {c / n:6.1%}  {f}" for f, c in leaf.most_common(top)]
        # NOTE: frames on every stack (the thread's entry, its run loop) say nothing.
        lines.append("  total (frames on every stack left out):")
        lines += [f"    {c / n:6.1%}  {f}" for f, c in anywhere.most_common()
                  if c < n][:top]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report of one raw profile."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="py-spy record --format raw output")
    p.add_argument("--top", type=int, default=10, help="frames per list (default: 10)")
    p.add_argument("--min-share", type=float, default=0.01,
                   help="leave out threads with less of the samples (default: 0.01)")
    args = p.parse_args(argv)
    with args.raw.open(encoding="utf-8", errors="replace") as f:
        print("\n".join(report(parse(f), top=args.top, min_share=args.min_share)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
