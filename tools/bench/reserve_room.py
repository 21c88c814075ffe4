"""A warm group's join step with the batch cache's room made once vs grown by mlx-lm (``KVTIER_BATCH_RESERVE``).

In process, on the engine's own ``BatchGeneration``: ``--rows`` rows over a
lent ``--prefix``-token prefix (each its own copy, evaluated before the
step, as the prompt cache lends them), suffixes of ``--suffix`` tokens and
up (one more a row), one join step timed, then the next decode step.
Rounds interleave room on and off over fresh suffixes; prints each step,
the medians and their ratio; ``--json`` / ``--plot`` write them.

    python tools/bench/reserve_room.py --rows 7 --prefix 5100 --suffix 23 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import REPO, loadavg, machine

sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: kvtier's default model)")
    p.add_argument("--rows", type=int, default=7)
    p.add_argument("--prefix", type=int, default=5100)
    p.add_argument("--suffix", type=int, default=23)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefill-step-size", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()

    import mlx.core as mx

    from kernels import SamplingParams
    from kernels.cache import clone_caches
    from kernels.engine import BatchGeneration, Generation
    from kernels.model import default_model_dir, load_model

    loaded = load_model(args.model or default_model_dir())
    model, tok = loaded.model, loaded.tokenizer
    rng = random.Random(3)
    prefix = [rng.randrange(10, len(tok) - 10) for _ in range(args.prefix)]
    params = SamplingParams(max_tokens=4)
    gen = Generation(model, tok, [*prefix, 1], params)
    while not gen.prefill_step():
        pass
    steps: dict[str, list[float]] = {"on": [], "off": []}
    after: dict[str, list[float]] = {"on": [], "off": []}
    for rnd in range(args.rounds):
        for variant in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            batch = BatchGeneration(model, tok, prefill_step_size=args.prefill_step_size,
                                    reserve_room=variant == "on")
            for i in range(args.rows):
                lent = clone_caches(gen.cache, args.prefix)
                mx.eval([c.state for c in lent])
                suffix = [rng.randrange(10, len(tok) - 10) for _ in range(args.suffix + i)]
                batch.join(f"r{i}", [*prefix, *suffix], params, cache=lent, cached_tokens=args.prefix)
            began = time.perf_counter()
            batch.step()
            mx.synchronize()
            join_s = time.perf_counter() - began
            began = time.perf_counter()
            batch.step()
            mx.synchronize()
            next_s = time.perf_counter() - began
            steps[variant].append(join_s * 1e3)
            after[variant].append(next_s * 1e3)
            print(f"round {rnd} room {variant:3s}: join step {join_s * 1e3:7.0f} ms, next step "
                  f"{next_s * 1e3:5.0f} ms", flush=True)
            del batch
    med = {v: statistics.median(x) for v, x in steps.items()}
    print(f"{args.rows} rows x {args.suffix}+ tokens over a lent {args.prefix}: join step median "
          f"room on {med['on']:.0f} ms (range {min(steps['on']):.0f}-{max(steps['on']):.0f}), "
          f"off {med['off']:.0f} ms (range {min(steps['off']):.0f}-{max(steps['off']):.0f}); "
          f"on / off {med['on'] / med['off']:.3f}")
    result: dict[str, Any] = {"machine": machine(), "load": loadavg(), "args": vars(args) | {
        "model": str(args.model), "json": str(args.json), "plot": str(args.plot)},
        "join_step_ms": steps, "next_step_ms": after, "median_ms": med,
        "ratio_on_off": med["on"] / med["off"]}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for i, v in enumerate(("off", "on")):
            ax.scatter([i] * len(steps[v]), steps[v], label=f"room {v}")
            ax.hlines(med[v], i - 0.2, i + 0.2, color="k")
        ax.set_xticks([0, 1], ["grown by mlx-lm", "room made once"])
        ax.set_ylabel("join step (ms)")
        ax.set_title(f"{args.rows} rows x {args.suffix}+ tokens over a lent {args.prefix} "
                     f"(on / off {med['on'] / med['off']:.3f})")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
