"""Where a checkpoint's read-back time goes on MLX's CUDA backend, piece by piece.

The batch lane's checkpoint views turn costs ~9.4 ms on the H200 (8B
shape, a 100-token delta: ~13 MB), whatever the bytes read and whether a
forward is in flight (``checkpoint_cost.py --batch-rows 8``). This tool
times the pieces of ``kernels.cache._kv_writer._flat_host_views`` on
device arrays of the 8B shape's KV layout (bf16, 8 KV heads x 128), for a
few sizes, idle and with a decode-sized matmul chain in flight on the
default stream:

- ``gather_ms``: the one-buffer copy on the thread's copy stream, evaluated,
  tensor by tensor (each strided slice flattened into its own buffer, then
  concatenated: the path for tensors of mixed dtypes or shapes);
- ``axis0_gather_ms``: the same bytes by one concatenation on the first
  axis (tensors of one dtype and trailing shape, as a checkpoint's K and V
  are: what ``_flat_host_views`` does for them);
- ``view_ms``: the first ``memoryview`` of that buffer (MLX moves it where
  the host can read it);
- ``read_ms``: reading every byte of the view on the host (what the SSD
  writer's hash and write do);
- ``second_view_ms``: a second ``memoryview`` of the same buffer.

Each call reads ``rows`` checkpoints at once (1, and all 8 rows of the
batch buffer): whether the turn's cost is per call (one buffer, one host
move: reading a step's checkpoints in one turn would divide it) or per
tensor (it would not).

    python3 tools/bench/cuda_readback.py --json OUT.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _one(arrays: list[Any], stream: Any, busy: Any | None) -> dict[str, float]:
    mx: Any = importlib.import_module("mlx.core")

    mx.synchronize()
    if busy is not None:
        mx.async_eval(busy())
    t0 = time.perf_counter()
    whole = mx.concatenate(arrays, axis=0, stream=stream)
    axis0 = mx.flatten(mx.view(whole, mx.uint8, stream=stream), stream=stream)
    mx.eval(axis0)
    axis0_gather = _ms(t0)
    del whole, axis0
    mx.synchronize()
    if busy is not None:
        mx.async_eval(busy())
    t0 = time.perf_counter()
    parts = [mx.flatten(mx.view(a, mx.uint8, stream=stream), stream=stream) for a in arrays]
    flat = mx.concatenate(parts, stream=stream)
    mx.eval(flat)
    gather = _ms(t0)
    t0 = time.perf_counter()
    view = memoryview(flat).cast("B")
    first = _ms(t0)
    t0 = time.perf_counter()
    zlib.crc32(view)
    read = _ms(t0)
    t0 = time.perf_counter()
    again = memoryview(flat).cast("B")
    second = _ms(t0)
    del view, again, flat, parts
    mx.synchronize()
    return {"gather_ms": gather, "axis0_gather_ms": axis0_gather, "view_ms": first, "read_ms": read, "second_view_ms": second}


def main() -> None:
    """Time the pieces per size, idle and busy; print and write JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="100,600,2000", help="delta token counts to read back")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    mx: Any = importlib.import_module("mlx.core")

    stream = mx.new_stream(mx.default_device())
    w = mx.random.normal((4096, 14336)).astype(mx.bfloat16)
    x = mx.random.normal((8, 4096)).astype(mx.bfloat16)
    mx.eval(w, x)

    def busy() -> Any:
        # NOTE: ~a decode step's worth of weight reads on the default stream.
        y = x
        for _ in range(24):
            y = (y @ w)[:, :4096]
        return y

    results: dict[str, Any] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        # NOTE: K and V per layer, one row's slice of a wider batch buffer (8 rows),
        # as a checkpoint's delta reads them.
        buffers = [mx.random.normal((8, 8, tokens + 64, 128)).astype(mx.bfloat16)
                   for _ in range(2 * args.layers)]
        mx.eval(buffers)
        for rows in (1, 8):
            arrays = [b[r:r + 1, :, 64:, :] for r in range(rows) for b in buffers]
            nbytes = sum(a.nbytes for a in arrays)
            # NOTE: the matmul chain stands for a decode step on a GPU; on the CPU it
            # would take seconds on the same stream, so it runs where CUDA does.
            cuda = getattr(mx, "cuda", None)
            loads = ("idle", "busy") if cuda is not None and cuda.is_available() else ("idle",)
            for load in loads:
                runs = [_one(arrays, stream, busy if load == "busy" else None)
                        for _ in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                results[f"{tokens}-r{rows}-{load}"] = {"bytes": nbytes, "tensors": len(arrays),
                                                       "median": med, "runs": runs}
                print(f"{tokens:5d} tokens x {rows} rows ({len(arrays)} tensors, "
                      f"{nbytes / 1e6:6.1f} MB) {load:4s}: "
                      + "  ".join(f"{k} {v:7.2f}" for k, v in med.items()), flush=True)
            del arrays
        del buffers
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()),
                                         "mlx": mx.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
