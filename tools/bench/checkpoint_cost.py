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

``--batch-rows N`` measures the batch lane instead (``BatchGeneration``, N
rows decoding ``--tokens`` each, checkpoints every ``--every``), the way
``kvtier serve`` runs it: steps back to back without synchronizing, and
after a step that hands out checkpoints, each checkpoint's registration,
its views turn and its finish turn run inline, as the engine thread runs
them between two step chains. Passes with and without checkpoints
alternate (``--repeats`` each). Reported: the pass's decode rate on/off;
the median plain step and the median step that hands out checkpoints
(the in-step capture: extraction, the pending token read, the snapshot's
evaluation); per checkpoint the registration, the first views turn after
the step (it waits for the forward still in flight) and the later ones,
the finish turn and the step right after the turns (no forward in flight
to overlap); the views turn's parts (``views_plan_s``: the file's plan,
``views_read_s``: the read-back, ``views_read_eval_s``: its evaluation);
and the wall time a checkpoint adds, per checkpoint.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint_cost.py --tokens 300
    ... tools/bench/checkpoint_cost.py --batch-rows 8 --tokens 300 --every 100
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
from kernels.cache import (  # noqa: E402
    GenerationCheckpoint,
    OsFilePort,
    delta_enabled,
    plan_entry,
    tensor_bytes,
)
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


class _Parts:
    """Times the parts of each views turn: the plan, the read-back, and its evaluation inside it.

    NOTE: wraps the names ``actors.ssd_writer.ports`` calls (``plan_entry``,
    ``tensors_bytes``) and ``kernels.cache._kv_writer``'s ``mx.eval`` for the
    probe's lifetime; what the read-back spends outside its evaluation is
    building the copy's graph and taking the host view (on CUDA: the managed
    buffer and its copy).
    """

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"plan": [], "read": [], "read_eval": []}
        self._patched: list[tuple[Any, str, Any]] = []

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[key].append(time.perf_counter() - began)
        return call

    def __enter__(self) -> _Parts:
        import types

        import mlx.core as mx

        from actors.ssd_writer import ports
        from kernels.cache import _kv_writer

        proxy = types.SimpleNamespace(**{n: getattr(mx, n) for n in dir(mx) if not n.startswith("__")})
        proxy.eval = self._timed("read_eval", mx.eval)
        for owner, name, new in ((ports, "plan_entry", self._timed("plan", ports.plan_entry)),
                                 (ports, "tensors_bytes", self._timed("read", ports.tensors_bytes)),
                                 (_kv_writer, "mx", proxy)):
            self._patched.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, old in reversed(self._patched):
            setattr(owner, name, old)

    def medians(self) -> dict[str, float | None]:
        """Each part's median over the views turns so far (seconds)."""
        return {f"views_{k}_s": round(statistics.median(v), 6) if v else None
                for k, v in self.times.items()}


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


def _batch_pass(loaded: Any, prompts: list[list[int]], tokens: int, every: int,
                source: EngineTensorSource, turns: _TimedTurns,
                registry: CacheRegistry) -> dict[str, Any]:
    """One batch-lane pass (module docstring): every step timed as served, the checkpoint turns inline."""
    import mlx.core as mx

    from kernels.engine import BatchGeneration, SamplingParams

    gen = BatchGeneration(loaded.model, loaded.tokenizer, max_rows=len(prompts))
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        gen.join(f"r{i}", prompt, params, checkpoint_every=every)
    plain: list[float] = []
    at_checkpoint: list[float] = []
    after_turns: list[float] = []
    register: list[float] = []
    first_turn: list[float] = []
    later_turns: list[float] = []
    finish: list[float] = []
    emitted = 0
    checkpoints = 0
    turned = False
    # NOTE: with deltas on (KVTIER_CHECKPOINT_DELTA; CUDA's default), each row's previous
    # checkpoint plan stands for its file: its views turn reads back only the tokens since.
    bases: dict[str, Any] = {}
    delta = delta_enabled()
    began_pass = time.perf_counter()
    try:
        while not gen.idle:
            began = time.perf_counter()
            step = gen.step()
            took = time.perf_counter() - began
            emitted += len(step.tokens)
            if step.checkpoints:
                at_checkpoint.append(took)
            elif turned:
                after_turns.append(took)
            elif step.decode_rows and not step.prefill_tokens and not step.exits:
                plain.append(took)
            turned = False
            for index, ck in enumerate(step.checkpoints):
                checkpoints += 1
                began = time.perf_counter()
                reg = registry.register(ck.cache, offset=len(ck.cache_tokens))
                register.append(time.perf_counter() - began)
                record = GenerationCheckpoint("ab" * 16, ck.prompt_len, ck.pending_token,
                                              ck.sample_index, ck.rng_key)
                plan, views = anyio.run(functools.partial(
                    source.checkpoint_views, reg.handle, namespace="",
                    tokens=ck.cache_tokens, checkpoint=record,
                    base=bases.get(ck.row_id) if delta else None))
                bases[ck.row_id] = plan.header
                (first_turn if index == 0 else later_turns).append(turns.times[-1])
                views.clear()
                anyio.run(source.finish, plan)
                finish.append(turns.times[-1])
                registry.dispose(reg.handle)
                turned = True
    finally:
        gen.close()
    mx.synchronize()
    wall = time.perf_counter() - began_pass

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 6) if xs else None

    return {"tokens": emitted, "wall_s": round(wall, 4), "tps": round(emitted / wall, 2),
            "checkpoints": checkpoints, "plain_step_s": med(plain),
            "checkpoint_step_s": med(at_checkpoint), "step_after_turns_s": med(after_turns),
            "register_s": med(register), "first_views_turn_s": med(first_turn),
            "later_views_turn_s": med(later_turns), "finish_turn_s": med(finish)}


def measure_batch(rows: int, tokens: int, every: int, repeats: int,
                  model: str | None) -> dict[str, Any]:
    """The batch-lane figures (module docstring)."""
    loaded = load_model(model if model is not None else default_model_dir())
    base = encode_prompt(loaded.tokenizer, PROMPT)
    # NOTE: distinct prompts of one length: the rows reach their boundaries together.
    prompts = [[*base[:-1], base[-1] + i] for i in range(rows)]
    registry = CacheRegistry()
    turns = _TimedTurns()
    source = EngineTensorSource(turns, registry, FileIdentity("m", "f", "t"))
    # NOTE: a warm-up pass of each kind first (kernel compilation, buffers).
    _batch_pass(loaded, prompts, min(tokens, every + 8), every, source, turns, registry)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with _Parts() as parts:
        for _ in range(repeats):
            for name, interval in (("off", 0), ("on", every)):
                runs[name].append(_batch_pass(loaded, prompts, tokens, interval, source, turns,
                                              registry))
    off = statistics.median(r["tps"] for r in runs["off"])
    on = statistics.median(r["tps"] for r in runs["on"])
    walls_off = statistics.median(r["wall_s"] for r in runs["off"])
    walls_on = statistics.median(r["wall_s"] for r in runs["on"])
    count = statistics.median(r["checkpoints"] for r in runs["on"])

    def med(key: str) -> float | None:
        xs = [r[key] for r in runs["on"] if r[key] is not None]
        return round(statistics.median(xs), 6) if xs else None

    return {
        "lane": "batch", "rows": rows, "tokens": tokens, "every": every, "repeats": repeats,
        "tps_off_median": round(off, 2), "tps_on_median": round(on, 2),
        "on_over_off": round(on / off, 4),
        "checkpoints_per_pass": count,
        "added_s_per_checkpoint": round((walls_on - walls_off) / count, 6) if count else None,
        "plain_step_s": med("plain_step_s"), "checkpoint_step_s": med("checkpoint_step_s"),
        "step_after_turns_s": med("step_after_turns_s"), "register_s": med("register_s"),
        "first_views_turn_s": med("first_views_turn_s"),
        "later_views_turn_s": med("later_views_turn_s"), "finish_turn_s": med("finish_turn_s"),
        **parts.medians(),
        "runs": runs,
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
    parser.add_argument("--batch-rows", type=int, default=0,
                        help="measure the batch lane with this many rows (0: the serial lane)")
    parser.add_argument("--every", type=int, default=100,
                        help="with --batch-rows: the checkpoint interval in tokens")
    ns = parser.parse_args()
    if ns.batch_rows > 0:
        if ns.tokens <= ns.every + 1:
            parser.error("--tokens must pass the first checkpoint (--every)")
        print(json.dumps(measure_batch(ns.batch_rows, ns.tokens, ns.every, ns.repeats, ns.model),
                         indent=2))
        return 0
    intervals = [int(x) for x in ns.intervals.split(",") if x]
    print(json.dumps(measure(ns.tokens, ns.repeats, intervals, ns.model), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
