"""Which answers differ, and where: two fresh engines, a resumed answer, checkpoints on.

``checkpoint.py`` reports one ``answers_equal`` flag over every comparison it
makes. When it is false this tool says which pair differs and at which token
(token ids, not text), on the same prompt and greedy request, each contender
a fresh :class:`~actors.engine.Engine` on its own SSD-tier directory:

1. ``off1``, ``off2``: checkpoints off, two engines (is a fresh answer
   reproducible on this device at all?);
2. ``resumed``: an engine checkpointing at 75 % of ``--tokens`` is cut right
   after it, a new engine on the same directory answers the identical
   request from the checkpoint;
3. ``on``: checkpoints every ``--every`` tokens, uninterrupted.

Prints each comparison's first differing token index (``None``: equal) and
exits 1 when any pair differs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint_parity.py --tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import checkpoint as ck

if TYPE_CHECKING:
    from actors.engine import Engine
    from messages.gateway import GenerationParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def _ids(engine: Engine, params: GenerationParams) -> list[int]:
    done = await engine.complete_prompt(ck.PROMPT, params)
    return list(done.token_ids)


async def run(tokens: int, every: int, model: str | None) -> dict[str, Any]:
    """Every contender's answer and each comparison's first difference."""
    from messages.gateway import GenerationParams

    params = GenerationParams(max_tokens=tokens, temperature=0.0)
    at = tokens * 3 // 4
    with tempfile.TemporaryDirectory(prefix="kvtier-ckpt-parity-") as tmp:
        async with ck._engine(Path(tmp) / "off1", 0, model) as engine:
            off1 = await _ids(engine, params)
        async with ck._engine(Path(tmp) / "off2", 0, model) as engine:
            off2 = await _ids(engine, params)
        root = Path(tmp) / "restart"
        async with ck._engine(root, at, model) as first:
            await ck._cut_at(first, params, at + 1)
            await ck._written(first)
        async with ck._engine(root, at, model) as second:
            resumed = await _ids(second, params)
            section = (await second.stats(timeout=5))["generation_checkpoints"]
        async with ck._engine(Path(tmp) / "on", every, model) as engine:
            on = await _ids(engine, params)
    pairs = {
        "off2 vs off1": first_difference(off1, off2),
        "resumed vs off1": first_difference(off1, resumed),
        "resumed vs off2": first_difference(off2, resumed),
        "on vs off1": first_difference(off1, on),
    }
    return {"tokens": tokens, "cut_at": at + 1, "every": every,
            "resumed": int(section["resumed"]), "tokens_saved": int(section["tokens_saved"]),
            "first_difference": pairs, "equal": all(v is None for v in pairs.values())}


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print; 1 when any pair differs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=400, help="greedy answer length")
    p.add_argument("--every", type=int, default=256, help="the 'on' contender's checkpoint interval")
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    args = p.parse_args(argv)
    out = asyncio.run(run(args.tokens, args.every, args.model))
    print(json.dumps(out, indent=2))
    return 0 if out["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
