"""What a shape MLX has not run before costs, op by op: a matmul, a model forward, its attention.

Served joins rarely repeat a shape; on MLX's CUDA backend a lone row's
24-token join over a cached 5,100 took ~110 ms with every shape new against
~20 ms with shapes repeated (``join_cost.py --new-shapes``). This tool
times, synchronized, each of these with a query length never used before
(``new``) and with one used just before (``warm``):

- ``matmul``: ``(L, hidden) @ (hidden, intermediate)`` in the model's dtype;
- ``forward``: the model over ``L`` tokens with a fresh cache (no prefix);
- ``forward+cache``: the model over ``L`` tokens after a cached prefix of
  ``--prefix`` tokens (the served join).

    python3 tools/bench/shape_costs.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))


def _timed(fn: Any) -> float:
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    """Print milliseconds per call, new shape against warm, per contender."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--length", type=int, default=24, help="the first new query length")
    p.add_argument("--prefix", type=int, default=5100, help="forward+cache: the cached prefix")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kernels.model import load_model

    loaded = load_model(args.model)
    model = loaded.model
    args_m = model.args
    hidden, inter = args_m.hidden_size, args_m.intermediate_size
    dtype = model.layers[0].mlp.down_proj.weight.dtype
    w = mx.random.normal((hidden, inter)).astype(dtype)
    mx.eval(w)
    prefix = mx.array([[i % 1000 + 10 for i in range(args.prefix)]])
    base = make_prompt_cache(model)
    for at in range(0, args.prefix, 2048):
        model(prefix[:, at : at + 2048], cache=base)
    mx.eval([c.state for c in base])

    def cached(length: int) -> Any:
        # NOTE: a copy of the prefix's cache each call (the served lease copies too).
        cache = make_prompt_cache(model)
        for c, b in zip(cache, base, strict=True):
            c.state = [mx.array(x) for x in b.state]
            c.offset = b.offset
        return model(mx.array([[7] * length]), cache=cache)

    contenders = {
        "matmul": lambda n: (lambda: mx.ones((n, hidden), dtype=dtype) @ w),
        "forward": lambda n: (lambda: model(mx.array([[5] * n]))),
        "forward+cache": lambda n: (lambda: cached(n)),
    }
    length = args.length
    for fn in contenders.values():  # NOTE: one untimed call of each (first kernels)
        _timed(fn(length))
    doc: dict[str, Any] = {"model": str(args.model), "prefix": args.prefix, "results": {}}
    for name, fn in contenders.items():
        new, warm = [], []
        for _ in range(args.repeats):
            length += 1
            new.append(_timed(fn(length)))
            warm.append(_timed(fn(length)))
        doc["results"][name] = {"new_ms": new, "warm_ms": warm}
        print(f"{name:>14}: new shape {statistics.median(new):8.2f} ms  warm {statistics.median(warm):8.2f} ms"
              f"  (new {', '.join(f'{x:.1f}' for x in new)})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
