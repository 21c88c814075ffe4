"""Generation checkpoints: time to finish after a restart at 75 % of an answer, and decode throughput on vs off.

In-process ``Engine`` runs of the default model (unless ``--model``) on this
machine, serial lane (``max_batch`` 1), SSD tier on in every run, one
greedy raw completion of ``--tokens`` tokens:

- ``fresh``: the whole answer from a cold start, checkpoints off (median
  of ``--repeats`` runs, each on a new Engine and an empty SSD directory);
- ``restart``: an Engine checkpointing every ``--restart-every`` tokens
  (0: one checkpoint exactly at 75 % of the answer) streams the request, is
  cancelled one token past 75 % (a cancel keeps the checkpoint), waits until
  its newest checkpoint is durable and closes; a NEW Engine on the same
  directory answers the identical request: the time to its last token is
  the figure (median of ``--repeats``), and its text must equal ``fresh``'s.
  With an interval, the restart resumes the last multiple of it before
  75 %, as a crash under that setting would;
- decode throughput (emitted tokens / decode seconds from the answer's own
  timings) with checkpoints at ``--every`` vs off, median of ``--repeats``.

With ``--batch-streams N`` it measures the batch lane instead (``max_batch``
N): N greedy answers of ``--batch-tokens`` tokens each (distinct prompts,
EOS ignored, so every row decodes to the end) run at once, with checkpoints
off and at each interval of ``--batch-every``, the settings interleaved
within every repeat (each repeat starting with the next one) so that load
drifts on a shared machine hit them alike.
The figure is the aggregate decode rate (the sum over streams of emitted
tokens / decode seconds), median of ``--repeats``, and each interval's ratio
to off, side by side. Every setting's answers must equal off's.

Prints one JSON object.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint.py --repeats 3
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint.py --batch-streams 8 --batch-every 256,512
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


def _engine(root: Path, every: int, model: str | None, max_batch: int = 1) -> Engine:
    opts: dict[str, Any] = {"ssd_cache": root, "generation_checkpoint": every,
                            "max_batch": max_batch, "ssd_writebehind": False}
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


async def _written(engine: Engine) -> None:
    """Until a checkpoint is written and none is queued (the newest is then on disk)."""
    with anyio.fail_after(120):
        while True:
            section = (await engine.stats(timeout=5))["generation_checkpoints"]
            if section["written"] >= 1 and section["pending"] == 0:
                return
            await anyio.sleep(0.05)


async def bench(tokens: int, every: int, repeats: int, model: str | None,
                restart_every: int = 0) -> dict[str, Any]:
    """The figures (module docstring)."""
    params = GenerationParams(max_tokens=tokens, temperature=0.0)
    at = (tokens * 3) // 4
    interval = restart_every if restart_every > 0 else at
    if interval > at:
        raise ValueError("--restart-every must leave a checkpoint before 75 % of the answer")
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
            async with _engine(root, interval, model) as first:
                await _cut_at(first, params, at + 1)
                await _written(first)
            async with _engine(root, interval, model) as second:
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
        "restart_every": interval,
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


async def _streams(engine: Engine, streams: int, tokens: int) -> tuple[list[str], float, int]:
    """``streams`` answers at once: (texts, aggregate decode tokens/s, tokens emitted)."""
    params = GenerationParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    texts = [""] * streams
    rates = [0.0] * streams
    emitted = [0] * streams

    async def one(i: int) -> None:
        done = await engine.complete_prompt(f"{PROMPT} (Variant {i}.)", params)
        decode_s = done.timings.decode_s if done.timings is not None else 0.0
        texts[i] = done.text
        emitted[i] = len(done.token_ids)
        rates[i] = len(done.token_ids) / decode_s if decode_s > 0 else 0.0

    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    return texts, sum(rates), sum(emitted)


async def bench_batch(streams: int, tokens: int, intervals: list[int], repeats: int,
                      model: str | None) -> dict[str, Any]:
    """Aggregate batch-lane decode rate, checkpoints off vs each interval (module docstring)."""
    settings = [0, *intervals]
    rates: dict[int, list[float]] = {e: [] for e in settings}
    taken: dict[int, int] = dict.fromkeys(settings, 0)
    reference: list[str] | None = None
    equal = True
    for r in range(repeats):
        # NOTE: each repeat starts with another setting, so a load that drifts
        # one way over the run does not always favour the same one.
        for every in settings[r % len(settings):] + settings[:r % len(settings)]:
            with tempfile.TemporaryDirectory(prefix="kvtier-bench-ckpt-") as tmp:
                async with _engine(Path(tmp), every, model, max_batch=streams) as engine:
                    texts, rate, emitted = await _streams(engine, streams, tokens)
                    stats = await engine.stats(timeout=5)
            rates[every].append(rate)
            print(json.dumps({"every": every, "decode_tps": round(rate, 2)}), file=sys.stderr,
                  flush=True)
            equal &= emitted == streams * tokens
            reference = reference or texts
            equal &= texts == reference
            section = stats.get("generation_checkpoints")
            if section is not None:
                taken[every] = int(section["taken"])
    off = statistics.median(rates[0])
    return {
        "machine": f"{platform.machine()} {platform.system()}",
        "lane": "batch",
        "streams": streams,
        "tokens_per_stream": tokens,
        "repeats": repeats,
        "decode_tps_off_median": round(off, 2),
        "intervals": {
            str(e): {
                "decode_tps_median": round(statistics.median(rates[e]), 2),
                "on_over_off": round(statistics.median(rates[e]) / off, 3) if off else None,
                "checkpoints_taken_last_run": taken[e],
                "decode_tps": [round(x, 2) for x in rates[e]],
            }
            for e in intervals
        },
        "decode_tps_off": [round(x, 2) for x in rates[0]],
        "answers_equal": equal,
    }


def main() -> int:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--every", type=int, default=256, help="checkpoint interval for 'on'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--restart-every", type=int, default=0,
                        help="checkpoint interval of the restart run in tokens; 0 = one "
                             "checkpoint exactly at 75 %% of the answer")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-streams", type=int, default=0,
                        help="measure the batch lane with this many answers at once instead "
                             "(0 = the serial-lane figures)")
    parser.add_argument("--batch-tokens", type=int, default=600,
                        help="tokens each batch-lane answer decodes")
    parser.add_argument("--batch-every", default="256,512",
                        help="comma-separated checkpoint intervals in tokens, each compared "
                             "with checkpoints off")
    ns = parser.parse_args()
    if ns.batch_streams > 0:
        intervals = [int(x) for x in ns.batch_every.split(",") if x.strip()]
        out = anyio.run(bench_batch, ns.batch_streams, ns.batch_tokens, intervals, ns.repeats,
                        ns.model)
    else:
        out = anyio.run(bench, ns.tokens, ns.every, ns.repeats, ns.model, ns.restart_every)
    print(json.dumps(out, indent=2))
    return 0 if out["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
