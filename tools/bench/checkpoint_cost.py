"""What one generation checkpoint costs, against the decode steps between two of them.

On a loaded shared machine an on/off decode-rate comparison cannot separate
a checkpoint's cost from the load's noise; this measures the pieces
directly, in one process on the default model (unless ``--model``), with
the serving path's own calls, after ``--tokens`` greedy tokens:

- ``step_s``: the median decode step (engine thread);
- ``capture_s``: the boundary (``checkpoint_point``) and the registry's
  owned snapshot of the caches, evaluated (engine thread, in the step);
- ``turn_s``: the checkpoint's one idle engine turn as the store worker
  runs it (``EngineTensorSource.checkpoint_views``: the plan and a view of
  every tensor, no copy), timed inside the turn;
- ``host_copy_s``: the plan and a host copy of every tensor, what that turn
  did before it handed out views (for comparison; no longer on the
  engine thread);
- ``write_s``: ``write_checkpoint`` to a real directory from the views
  (the tensors' bytes read, every tensor hashed, temp file, fsync, rename,
  directory fsync; a worker thread).

Each is the median of ``--repeats``. ``overhead_at`` gives, per interval N,
the engine thread's share ``(capture + turn) / (N x step)`` and the share
with the write counted too (a worker thread, but on a 2-core machine it
competes for the same cores). Prints one JSON object.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint_cost.py --tokens 300
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from actors.checkpoints import write_checkpoint  # noqa: E402
from actors.ssd_writer import EngineTensorSource, FileIdentity  # noqa: E402
from kernels import CacheRegistry, Generation, load_model  # noqa: E402
from kernels.cache import GenerationCheckpoint, OsFilePort, plan_entry, tensor_bytes  # noqa: E402
from kernels.engine import encode_prompt  # noqa: E402
from kernels.engine._checkpoint import checkpoint_point  # noqa: E402
from kernels.model import default_model_dir  # noqa: E402
from messages.gateway import GenerationParams  # noqa: E402

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
          "bottle, describing every day of the following month, the weather, the ships, "
          "and the letters the keeper writes back.\n\nChapter 1.")


T = TypeVar("T")


def _reader(data: list[Any]) -> Callable[[int], memoryview]:
    return lambda j: memoryview(data[j])


class _TimedTurns:
    """Engine turns run inline (this thread is the engine thread here); each turn's time."""

    def __init__(self) -> None:
        self.times: list[float] = []

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        began = time.perf_counter()
        try:
            return fn()
        finally:
            self.times.append(time.perf_counter() - began)


def measure(tokens: int, repeats: int, intervals: list[int], model: str | None) -> dict[str, Any]:
    """The figures (module docstring)."""
    import mlx.core as mx

    loaded = load_model(model if model is not None else default_model_dir())
    prompt = encode_prompt(loaded.tokenizer, PROMPT)
    gen = Generation(loaded.model, loaded.tokenizer, prompt,
                     GenerationParams(max_tokens=tokens + 8, temperature=0.0))
    steps: list[float] = []
    while not gen.prefill_done:
        gen.prefill_step(None)
    for _ in range(tokens):
        began = time.perf_counter()
        gen.decode_step()
        steps.append(time.perf_counter() - began)
    registry = CacheRegistry()
    turns = _TimedTurns()
    source = EngineTensorSource(turns, registry, FileIdentity("m", "f", "t"))
    capture, turn, copy, write = [], [], [], []
    file_bytes = 0
    with tempfile.TemporaryDirectory(prefix="kvtier-ckpt-cost-") as tmp:
        port = OsFilePort()
        for _ in range(repeats):
            began = time.perf_counter()
            point = checkpoint_point(gen)
            assert point is not None
            toks = (*gen.prompt_tokens, *point.generated)
            reg = registry.snapshot(gen.cache, offset=len(toks))
            mx.eval([a for c in registry.get(reg.handle) for a in (c.keys, c.values)])
            capture.append(time.perf_counter() - began)
            record = GenerationCheckpoint("ab" * 16, len(prompt), point.pending_token,
                                          len(point.generated), None)
            # the serving path's turn: plan + views; the write reads the views
            plan, views = anyio.run(functools.partial(
                source.checkpoint_views, reg.handle, namespace="", tokens=toks, checkpoint=record))
            turn.append(turns.times[-1])
            began = time.perf_counter()
            write_checkpoint(port, tmp, plan, _reader(views))
            write.append(time.perf_counter() - began)
            file_bytes = plan.file_size
            views.clear()
            anyio.run(source.finish, plan)
            # the turn before views: plan + a host copy of every tensor
            began = time.perf_counter()
            old = plan_entry(registry.get(reg.handle), model_id="m", fingerprint="f",
                             namespace="", tokenizer_hash="t", tokens=toks, checkpoint=record)
            data = [bytes(tensor_bytes(old, j)) for j in range(len(old.tensors))]
            old.release_arrays()
            copy.append(time.perf_counter() - began)
            del data
            registry.dispose(reg.handle)
    step = statistics.median(steps)
    cap, tn, wr = statistics.median(capture), statistics.median(turn), statistics.median(write)
    return {
        "tokens": tokens,
        "file_bytes": file_bytes,
        "step_s_median": round(step, 5),
        "capture_s_median": round(cap, 5),
        "turn_s_median": round(tn, 5),
        "host_copy_s_median": round(statistics.median(copy), 5),
        "write_s_median": round(wr, 5),
        "overhead_at": {
            str(n): {"engine_thread": round((cap + tn) / (n * step), 5),
                     "with_write": round((cap + tn + wr) / (n * step), 5)}
            for n in intervals
        },
        "capture_s": [round(x, 5) for x in capture],
        "turn_s": [round(x, 5) for x in turn],
        "host_copy_s": [round(x, 5) for x in copy],
        "write_s": [round(x, 5) for x in write],
    }


def main() -> int:
    """Measure and print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300,
                        help="greedy tokens decoded before the checkpoints are taken")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--intervals", default="64,100,256",
                        help="checkpoint intervals in tokens to report the overhead for")
    parser.add_argument("--model", default=None)
    ns = parser.parse_args()
    intervals = [int(x) for x in ns.intervals.split(",") if x]
    print(json.dumps(measure(ns.tokens, ns.repeats, intervals, ns.model), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
