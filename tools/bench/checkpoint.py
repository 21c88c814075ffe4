"""Generation checkpoints: time to finish after a restart at 75 % of an answer, and decode throughput on vs off.

In-process ``Engine`` runs of the default model (unless ``--model``) on this
machine, serial lane (``max_batch`` 1), SSD tier on in every run, one
greedy raw completion of ``--tokens`` tokens:

- ``fresh``: the whole answer from a cold start, checkpoints off (median
  of ``--repeats`` runs, each on a new Engine and an empty SSD directory);
- ``restart``: an Engine with a checkpoint at 75 % of the answer streams the
  request, is cancelled one token past it (a cancel keeps the checkpoint),
  waits until the file is durable and closes; a NEW Engine on the same
  directory answers the identical request: the time to its last token is
  the figure (median of ``--repeats``), and its text must equal ``fresh``'s;
- decode throughput (emitted tokens / decode seconds from the answer's own
  timings) with checkpoints at ``--every`` vs off, median of ``--repeats``.

Prints one JSON object.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from actors.engine import Engine  # noqa: E402
from messages.gateway import GenerationParams, TokenEvent  # noqa: E402

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
          "bottle, describing every day of the following month, the weather, the ships, "
          "and the letters the keeper writes back.\n\nChapter 1.")


def _engine(root: Path, every: int, model: str | None) -> Engine:
    opts: dict[str, Any] = {"ssd_cache": root, "generation_checkpoint": every, "max_batch": 1,
                            "ssd_writebehind": False}
    if model is not None:
        opts["model"] = model
    return Engine(**opts)


async def _answer(engine: Engine, params: GenerationParams) -> tuple[str, float, float]:
    """(text, seconds to the last token, decode tokens per second)."""
    began = time.perf_counter()
    done = await engine.complete_prompt(PROMPT, params)
    wall = time.perf_counter() - began
    decode_s = done.timings.decode_s if done.timings is not None else 0.0
    emitted = len(done.token_ids)
    tps = emitted / decode_s if decode_s > 0 else 0.0
    return done.text, wall, tps


async def _cut_at(engine: Engine, params: GenerationParams, tokens: int) -> None:
    seen = 0
    async with engine.generate(PROMPT, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                seen += 1
                if seen >= tokens:
                    break


async def _written(engine: Engine, n: int) -> None:
    with anyio.fail_after(120):
        while True:
            if (await engine.stats(timeout=5))["generation_checkpoints"]["written"] >= n:
                return
            await anyio.sleep(0.05)


async def bench(tokens: int, every: int, repeats: int, model: str | None) -> dict[str, Any]:
    """The figures (module docstring)."""
    params = GenerationParams(max_tokens=tokens, temperature=0.0)
    at = (tokens * 3) // 4
    fresh_s: list[float] = []
    restart_s: list[float] = []
    tps_off: list[float] = []
    tps_on: list[float] = []
    reference: str | None = None
    equal = True
    resumed_tokens = 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-ckpt-") as tmp:
            async with _engine(Path(tmp) / "off", 0, model) as off:
                text, wall, tps = await _answer(off, params)
            fresh_s.append(wall)
            tps_off.append(tps)
            reference = reference or text
            equal &= text == reference
            async with _engine(Path(tmp) / "on", every, model) as on:
                text, _, tps = await _answer(on, params)
            tps_on.append(tps)
            equal &= text == reference
            root = Path(tmp) / "restart"
            async with _engine(root, at, model) as first:
                await _cut_at(first, params, at + 1)
                await _written(first, 1)
            async with _engine(root, at, model) as second:
                text, wall, _ = await _answer(second, params)
                section = (await second.stats(timeout=5))["generation_checkpoints"]
            restart_s.append(wall)
            resumed_tokens = int(section["tokens_saved"])
            equal &= text == reference and section["resumed"] == 1
    fresh, restart = statistics.median(fresh_s), statistics.median(restart_s)
    off_tps, on_tps = statistics.median(tps_off), statistics.median(tps_on)
    return {
        "machine": f"{platform.machine()} {platform.system()}",
        "tokens": tokens,
        "restart_at_tokens": at,
        "resumed_tokens": resumed_tokens,
        "repeats": repeats,
        "fresh_s_median": round(fresh, 3),
        "restart_s_median": round(restart, 3),
        "restart_over_fresh": round(restart / fresh, 3),
        "every": every,
        "decode_tps_off_median": round(off_tps, 2),
        "decode_tps_on_median": round(on_tps, 2),
        "decode_on_over_off": round(on_tps / off_tps, 3) if off_tps else None,
        "answers_equal": equal,
        "fresh_s": [round(x, 3) for x in fresh_s],
        "restart_s": [round(x, 3) for x in restart_s],
        "decode_tps_off": [round(x, 2) for x in tps_off],
        "decode_tps_on": [round(x, 2) for x in tps_on],
    }


def main() -> int:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--every", type=int, default=256, help="checkpoint interval for 'on'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    ns = parser.parse_args()
    out = anyio.run(bench, ns.tokens, ns.every, ns.repeats, ns.model)
    print(json.dumps(out, indent=2))
    return 0 if out["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
