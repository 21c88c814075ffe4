"""Where a batch step's time goes when rows join and leave: per-phase device time, by kind of step.

On the H200 (8B shape, 32 rows, 512-token prompts, 128 new tokens, each
client sending its requests one after the other) the batch lane's median
step is ~17 ms and its mean ~37 ms: ~80 ms a joining row, of which a
511-token prefill explains ~24 ms (docs/benchmarks/serving.md). This tool
runs that closed loop on :class:`kernels.engine.BatchGeneration` directly
(no actors, no HTTP) and times each phase of every step with the device
synchronized before and after it, so each phase's time is its own device
time:

- ``decode``: the decode batch's ``next`` (the decode forward, the sampled
  tokens read back) less what is timed inside it;
- ``filter`` / ``extend``: the batch caches' whole-batch copies when rows
  leave (``filter``) and join (``extend``); since slot reuse a leaving row
  leaves a hole (no copy) and ``filter`` runs only when a hole is compacted;
- ``fill``: a joining row written into a hole's slot (one slice per layer);
- ``extract``: a leaving row's cache copied out of the batch;
- ``prefill``: joining rows' prompt forwards (``PrefillBatch.prompt``, mlx-lm's)
  less ``roll``: a padded group's right padding rolled to the left, every
  layer's whole cache (``BatchKVCache.finalize``, inside ``prompt``);
- ``first_token``: building the decode batch of prefilled rows
  (``enter_generation``; mlx-lm's ``generate`` forwarded their last prompt
  tokens here, 13.9 ms a join on the H200; kvtier's decode step takes them
  with every other row since);
- ``trim``: dropping the left padding every row of a layer has after rows
  left (``_settle_trim``; mlx-lm's filter read each layer's minimum back
  inside ``filter``);
- ``merge``: caches turned into batch form (kvtier's ``_merge``);
- ``enter``: the rest of a prefilled row's entry into the decode batch;
- ``other``: the rest of the step (kvtier's bookkeeping).

Prints per phase: total seconds, calls, ms per call, and the share of the
synchronized run's time; then the mean step time by kind of step (decode
only, with a join, with a leave, with both). A second pass without any
synchronization gives the real throughput of the same loop beside it
(``--no-plain`` skips it). Synchronizing removes the overlap of the host's
graph building with the device, so the synchronized pass is slower: its
use is the split, not its total.

``--stagger F`` draws each request's ``max_tokens`` within ``± F`` of
``--max-tokens`` (seeded), so rows leave and join at different steps, as
under a served load; ``--slot-reuse on,off --rounds N`` runs the
unsynchronized pass with and without slot reuse, interleaved, on the same
requests, and prints their ratio.

    # on the GPU (the model gpu_serving.sh run wrote):
    python3 tools/bench/join_cost.py --model /tmp/kvtier-gpu/llama3-8b --tok-dir .gpu/tok
    # on the CPU, a small random shape:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/join_cost.py --shape tiny --rows 4 --requests 2 \\
        --prompt-tokens 64 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

DEFAULT_TOK_DIR = Path.home() / ".cache/kvtier/models/SmolLM2-135M-Instruct-fp32"


class PhaseClock:
    """Exclusive device time per phase: nested phases are subtracted from their parent."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as ``name`` (synchronized before and after)."""
        self.sync()
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self.sync()
            self._stack.pop()
            took = time.perf_counter() - frame[0]
            self.totals[name] += took - frame[1]
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][1] += took


def _wrap(cls: Any, attr: str, clock: PhaseClock, name: str) -> Callable[[], None]:
    """Time ``cls.attr`` as phase ``name``; returns the undo."""
    inner = getattr(cls, attr)

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with clock.phase(name):
            return inner(self, *args, **kwargs)

    setattr(cls, attr, timed)
    return lambda: setattr(cls, attr, inner)


def _wrap_function(module: Any, attr: str, clock: PhaseClock, name: str) -> Callable[[], None]:
    """Time the module-level function ``module.attr`` as phase ``name``; returns the undo."""
    inner = getattr(module, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with clock.phase(name):
            return inner(*args, **kwargs)

    setattr(module, attr, timed)
    return lambda: setattr(module, attr, inner)


def instrument(clock: PhaseClock) -> list[Callable[[], None]]:
    """Wrap the phases named in the module docstring; the undos."""
    from mlx_lm.models.cache import BatchKVCache

    from kernels.engine import _batch, _greedy, _prefill_batch

    decode = _greedy.GreedyGenerationBatch
    return [
        _wrap(BatchKVCache, "finalize", clock, "roll"),
        _wrap(decode, "next", clock, "decode"),
        _wrap(decode, "filter", clock, "filter"),
        _wrap(decode, "extend", clock, "extend"),
        _wrap(decode, "_fill", clock, "fill"),
        _wrap(decode, "extract_cache", clock, "extract"),
        _wrap(_prefill_batch.PrefillBatch, "prompt", clock, "prefill"),
        _wrap_function(_batch, "enter_generation", clock, "first_token"),
        _wrap(decode, "_settle_trim", clock, "trim"),
        _wrap(_batch.BatchGeneration, "_merge", clock, "merge"),
        _wrap(_batch.BatchGeneration, "_enter_decode", clock, "enter"),
    ]


def _prompts(tok: Any, n: int, length: int, tag: str) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` token ids (seeded by ``tag``)."""
    import random

    rng = random.Random(tag)
    vocab = len(tok)
    return [[rng.randrange(1000, vocab - 1) for _ in range(length)] for _ in range(n)]


def _suffixes(tok: Any, n: int, length: int, spread: float, tag: str) -> list[list[int]]:
    """``n`` distinct suffixes of ``length`` tokens, or lengths drawn within ``± spread`` of it (seeded)."""
    import random

    rng = random.Random(f"suffix-{tag}")
    low = max(1, round(length * (1 - spread)))
    high = max(low, round(length * (1 + spread)))
    vocab = len(tok)
    return [[rng.randrange(1000, vocab - 1) for _ in range(rng.randint(low, high))]
            for _ in range(n)]


def _lengths(n: int, max_tokens: int, stagger: float, tag: str) -> list[int]:
    """Each request's ``max_tokens``: all equal, or drawn within ``± stagger`` of it (seeded by ``tag``)."""
    import random

    rng = random.Random(f"len-{tag}")
    low = max(1, round(max_tokens * (1 - stagger)))
    high = max(low, round(max_tokens * (1 + stagger)))
    return [rng.randint(low, high) for _ in range(n)]


def closed_loop(gen: Any, prompts: list[list[int]], rows: int, max_tokens: list[int],
                clock: PhaseClock | None) -> dict[str, Any]:
    """``rows`` clients, each sending its share of ``prompts`` one after the other; every step timed."""
    from kernels.engine import SamplingParams

    queue = list(enumerate(prompts))

    def params(i: int) -> Any:
        return SamplingParams(max_tokens=max_tokens[i], temperature=0.0)

    for _ in range(min(rows, len(queue))):
        i, p = queue.pop(0)
        gen.join(f"r{i}", p, params(i))
    kinds: dict[str, list[float]] = defaultdict(list)
    tokens = 0
    t0 = time.perf_counter()
    while not gen.idle:
        if clock is not None:
            clock.sync()
        s = time.perf_counter()
        step = gen.step()
        if clock is not None:
            clock.sync()
        took = time.perf_counter() - s
        tokens += len(step.tokens)
        joined = bool(step.joined) or step.prefill_tokens > 0
        left = bool(step.exits)
        kind = {(False, False): "decode only", (True, False): "join", (False, True): "leave",
                (True, True): "join + leave"}[(joined, left)]
        kinds[kind].append(took)
        for _ in step.exits:
            if queue:
                i, p = queue.pop(0)
                gen.join(f"r{i}", p, params(i))
    wall = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tps": tokens / wall,
        "steps": sum(len(v) for v in kinds.values()),
        "by_kind": {k: {"steps": len(v), "mean_ms": 1000 * sum(v) / len(v),
                        "total_s": sum(v)} for k, v in kinds.items()},
    }


def _kernel_dispatch(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                     sinks: Any = None) -> Any:
    """mlx-lm's attention, with one-position masked queries through the candidate kernel (_decode_kernel)."""
    import mlx.core as mx
    from _decode_kernel import decode_attention
    from mlx_lm.models import base

    from kernels.model import takes_masked_path

    if takes_masked_path(queries, cache, mask, sinks) and mask.dtype == mx.bool_:
        return decode_attention(queries, keys, values, scale=scale, mask=mask)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


def kernel_usable() -> str | None:
    """Why the candidate kernel cannot run here (``None``: it compiled and matched MLX on a small case)."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return "no CUDA device"
    from _decode_kernel import decode_attention

    try:
        mx.random.seed(0)
        q = mx.random.normal((2, 8, 1, 128)).astype(mx.bfloat16)
        k = mx.random.normal((2, 2, 300, 128)).astype(mx.bfloat16)
        v = mx.random.normal((2, 2, 300, 128)).astype(mx.bfloat16)
        mask = (mx.arange(300)[None, None, None, :] >= mx.array([0, 120])[:, None, None, None])
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)
        got = decode_attention(q, k, v, scale=0.088, mask=mask)
        diff = float(mx.max(mx.abs(want.astype(mx.float32) - got.astype(mx.float32))).astype(mx.float32).tolist())  # type: ignore[arg-type]
    except (RuntimeError, ValueError) as exc:
        return f"it failed: {exc}"
    return None if diff < 2e-2 else f"its result differs from MLX's by {diff:.3g}"


def set_attention(model: Any, mode: str) -> None:
    """Bind the model module's attention: ``on`` kvtier's dispatch (folded decode), ``fold`` the same with prefill of new shapes folded too, ``buckets`` with prefill at bucketed shapes, ``off`` mlx-lm's own, ``kernel`` the candidate kernel."""
    import mlx.core as mx
    from mlx_lm.models import base

    from kernels.model import _masked_attention, bind_masked_attention

    module = sys.modules[type(model).__module__]
    module.scaled_dot_product_attention = base.scaled_dot_product_attention  # type: ignore[attr-defined]
    if mode == "on" and mx.default_device() == mx.cpu:
        # NOTE: what kvtier binds on the CPU (the native softmax's folded
        # products); bind() alone would fold with MLX's softmax, whose
        # per-element exp made a 3-row join over 2,000 cached tokens 2.5 x
        # slower than the server's.
        _masked_attention.install(model)
    elif mode in ("on", "fold", "buckets"):
        bind_masked_attention(model, fold_prefill=mode == "fold", buckets=mode == "buckets")
    elif mode == "kernel":
        module.scaled_dot_product_attention = _kernel_dispatch  # type: ignore[attr-defined]
    elif mode != "off":
        raise SystemExit(f"--attention takes on, fold, buckets, off, kernel; got {mode!r}")


def prefix_cache(model: Any, prefix: list[int], step: int) -> list[Any]:
    """The KV of ``prefix`` in the serial lane's cache kinds (what the prompt cache lends a row)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for at in range(0, len(prefix), step):
        model(mx.array([prefix[at : at + step]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def burst(gen: Any, cache: list[Any], prefix: list[int], suffixes: list[list[int]],
          background: list[list[int]], max_tokens: int, clock: PhaseClock | None,
          tag: str, snapshot_tokens: int = 0) -> dict[str, Any]:
    """``len(suffixes)`` rows sharing the cached ``prefix`` join at once beside ``background`` decoding rows.

    Each burst row is lent ``cache`` (``prefix``'s KV, copied into the batch,
    never written: the prompt cache's lease) and forwards only its suffix.
    Returns each burst row's time to its first token and every step's time
    until the last of them has it (the agent trace's turns 2+ in process).
    ``snapshot_tokens`` > 0: each row asks for a snapshot that many tokens
    into its suffix (as ``kvtier serve`` does at a chat prompt's stable
    boundary, so the next turn finds it): the prefill then ends a chunk there.
    """
    from kernels.engine import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, p in enumerate(background):
        gen.join(f"{tag}-b{i}", p, SamplingParams(max_tokens=10_000, temperature=0.0))
    while gen.pending:
        gen.step()
    for _ in range(3):  # NOTE: background rows decoding in steady state.
        gen.step()
    if clock is not None:
        clock.sync()
        clock.totals.clear()  # NOTE: from the burst's joins to its last first token only.
        clock.calls.clear()
    t0 = time.perf_counter()
    for j, s in enumerate(suffixes):
        at = len(prefix) + snapshot_tokens if 0 < snapshot_tokens < len(s) else None
        gen.join(f"{tag}-s{j}", [*prefix, *s], greedy, cache=cache, cached_tokens=len(prefix),
                 snapshot_at=at)
    first: dict[str, float] = {}
    steps: list[dict[str, Any]] = []
    while len(first) < len(suffixes):
        s0 = time.perf_counter()
        step = gen.step()
        if clock is not None:
            clock.sync()
        now = time.perf_counter()
        steps.append({"ms": 1000 * (now - s0), "prefill_tokens": step.prefill_tokens,
                      "joined": len(step.joined), "decode_rows": step.decode_rows,
                      "snapshots": len(step.snapshots)})
        for t in step.tokens:
            if t.row_id.startswith(f"{tag}-s") and t.row_id not in first:
                first[t.row_id] = 1000 * (now - t0)
    phases = {k: 1000 * v for k, v in clock.totals.items()} if clock is not None else None
    for row_id in list(gen.row_ids):
        gen.cancel(row_id)
    ttft = sorted(first.values())
    return {"ttft_ms": ttft, "ttft_p50_ms": statistics.median(ttft), "ttft_max_ms": ttft[-1],
            "steps": steps, "phases_ms": phases}


def run_burst(args: argparse.Namespace, loaded: Any, tok: Any, out: dict[str, Any]) -> None:
    """``--burst``: rows sharing one cached prefix joining at once (agent turns 2+), timed."""
    import mlx.core as mx

    from kernels.engine import BatchGeneration

    prefix = _prompts(tok, 1, args.prefix_tokens, "prefix")[0]
    cache = prefix_cache(loaded.model, prefix, args.prefill_step_size)

    def fresh() -> Any:
        return BatchGeneration(loaded.model, loaded.tokenizer, max_rows=args.rows,
                               prefill_step_size=args.prefill_step_size)

    out["burst"] = []
    bursts = 0
    for r in range(args.rounds + 1):  # NOTE: round 0 warms the shapes up, unrecorded.
        for bg, att, sync in [(bg, att, sync) for bg in args.background for att in args.attention
                              for sync in (False, True)]:
            set_attention(loaded.model, att)
            clock = PhaseClock(mx.synchronize) if sync else None
            undo = instrument(clock) if clock is not None else []
            gen = fresh()
            try:
                tag = f"r{r}-bg{bg}-{att}-{'sync' if sync else 'plain'}"
                # NOTE: --new-shapes: every burst one token longer than the one
                # before, so no step repeats a shape (as served joins rarely do).
                bursts += 1
                suffix_tokens = args.suffix_tokens + (bursts if args.new_shapes else 0)
                rec = burst(gen, cache, prefix,
                            _suffixes(tok, args.burst, suffix_tokens, args.suffix_spread, tag),
                            _prompts(tok, bg, args.prompt_tokens, f"bg-{tag}"),
                            args.max_tokens, clock, tag, args.snapshot_tokens)
            finally:
                gen.close()
                for u in undo:
                    u()
            if r == 0:
                continue
            rec.update(round=r, background=bg, synchronized=sync, attention=att)
            out["burst"].append(rec)
            steps = ", ".join(f"{s['ms']:.1f}" for s in rec["steps"])
            print(f"burst {args.burst} x {args.suffix_tokens} tokens over a cached "
                  f"{args.prefix_tokens}, {bg} rows decoding, folded attention {att}, round {r}, "
                  f"{'synchronized' if sync else 'plain'}: TTFT p50 {rec['ttft_p50_ms']:.1f} "
                  f"max {rec['ttft_max_ms']:.1f} ms; steps ms [{steps}]", flush=True)
            if clock is not None:
                print("  phases ms: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(rec["phases_ms"].items(),
                                                       key=lambda kv: -kv[1])), flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both passes; the records."""
    import mlx.core as mx
    from gpu_engine import load_tokenizer

    from kernels.engine import BatchGeneration
    from kernels.model import load_model

    model_dir = args.model
    if model_dir is None:
        from serving import write_random_model

        model_dir = write_random_model(
            Path(tempfile.mkdtemp(prefix="kvtier-join-cost-")) / "model", args.shape,
            args.tok_dir, args.seed, args.dtype,
        )
    loaded = load_model(model_dir)
    tok = load_tokenizer(args.tok_dir)
    n = args.rows * args.requests
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                           "device": str(mx.default_device())}
    if args.burst:
        run_burst(args, loaded, tok, out)
        return out

    contenders = [c.strip() for c in args.slot_reuse.split(",") if c.strip()]
    for c in contenders:
        if c not in ("on", "off"):
            raise SystemExit(f"--slot-reuse takes on / off, got {c!r}")

    def fresh(reuse: str) -> Any:
        return BatchGeneration(loaded.model, loaded.tokenizer, max_rows=args.rows,
                               prefill_step_size=args.prefill_step_size,
                               reuse_slots=reuse == "on")

    # NOTE: a warm-up of the same shapes first (kernel compilation, buffers).
    warm = fresh(contenders[0])
    closed_loop(warm, _prompts(tok, args.rows, args.prompt_tokens, "warm"), args.rows,
                [min(args.max_tokens, 16)] * args.rows, None)
    warm.close()
    plain_lengths = _lengths(n, args.max_tokens, args.stagger, "plain")
    if not args.no_plain:
        # NOTE: contenders interleaved per round, each on the same prompts.
        out["plain_rounds"] = []
        for r in range(args.rounds):
            for c, att in [(c, att) for c in contenders for att in args.attention]:
                set_attention(loaded.model, att)
                gen = fresh(c)
                rec = closed_loop(gen, _prompts(tok, n, args.prompt_tokens, "plain"), args.rows,
                                  plain_lengths, None)
                gen.close()
                rec["slot_reuse"] = c
                rec["attention"] = att
                rec["round"] = r
                out["plain_rounds"].append(rec)
                print(f"plain pass, round {r}, slot reuse {c}, folded attention {att}: "
                      f"{rec['tps']:.1f} tok/s, "
                      f"{rec['steps']} steps, {rec['wall_s']:.2f} s", flush=True)
                _print_kinds(rec)
        out["plain"] = out["plain_rounds"][0]
        medians = {c: statistics.median(x["tps"] for x in out["plain_rounds"]
                                        if x["slot_reuse"] == c) for c in contenders}
        out["plain_tps_median"] = medians
        if set(contenders) == {"on", "off"}:
            pairs = [on["tps"] / off["tps"] for on, off in zip(
                [x for x in out["plain_rounds"] if x["slot_reuse"] == "on"],
                [x for x in out["plain_rounds"] if x["slot_reuse"] == "off"], strict=True)]
            out["on_over_off"] = {"median_of_medians": medians["on"] / medians["off"],
                                  "paired": pairs}
            print(f"slot reuse on / off, plain tok/s: {medians['on']:.1f} / {medians['off']:.1f} "
                  f"= {medians['on'] / medians['off']:.3f} (paired "
                  f"{', '.join(f'{x:.3f}' for x in pairs)})", flush=True)
    if args.no_sync:
        return out
    clock = PhaseClock(mx.synchronize)
    undo = instrument(clock)
    try:
        gen = fresh(contenders[0])
        timed = closed_loop(gen, _prompts(tok, n, args.prompt_tokens, "timed"), args.rows,
                            _lengths(n, args.max_tokens, args.stagger, "timed"), clock)
        gen.close()
    finally:
        for u in undo:
            u()
    phases = dict(clock.totals)
    phases["other"] = timed["wall_s"] - sum(phases.values())
    timed["phases"] = {k: {"total_s": v, "calls": clock.calls.get(k, 0),
                           "ms_per_call": 1000 * v / clock.calls[k] if clock.calls.get(k) else None,
                           "share": v / timed["wall_s"]} for k, v in phases.items()}
    out["synchronized"] = timed
    print(f"synchronized pass: {timed['tps']:.1f} tok/s, {timed['steps']} steps, "
          f"{timed['wall_s']:.2f} s; per phase:", flush=True)
    for name, f in sorted(timed["phases"].items(), key=lambda kv: -kv[1]["total_s"]):
        per = f"{f['ms_per_call']:8.2f} ms/call" if f["ms_per_call"] is not None else " " * 16
        print(f"  {name:<8} {f['total_s']:8.3f} s  {f['calls']:5d} calls {per}  "
              f"{100 * f['share']:5.1f} %", flush=True)
    _print_kinds(timed)
    return out


def _print_kinds(rec: dict[str, Any]) -> None:
    for kind, f in sorted(rec["by_kind"].items()):
        print(f"  {kind:<13} {f['steps']:5d} steps  mean {f['mean_ms']:8.2f} ms  "
              f"total {f['total_s']:7.2f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print, write ``--json``."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="model directory (none: a random --shape)")
    p.add_argument("--shape", default="tiny", help="gpu_engine.SHAPES entry of the random model")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the random model's weights' type")
    p.add_argument("--seed", type=int, default=0, help="the random model's seed")
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR, help="tokenizer directory")
    p.add_argument("--rows", type=int, default=32, help="clients = the batch's rows")
    p.add_argument("--requests", type=int, default=3, help="requests each client sends in turn")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prefill-step-size", type=int, default=512, help="the engine's prefill chunk")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="each request's max_tokens drawn within +- this fraction of --max-tokens "
                        "(seeded), so rows leave and join at different steps")
    p.add_argument("--slot-reuse", default="on",
                   help="contenders of the unsynchronized pass, interleaved per round: on, off or "
                        "on,off (BatchGeneration(reuse_slots=...)); the synchronized pass runs the first")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the unsynchronized pass")
    p.add_argument("--no-plain", action="store_true", help="skip the unsynchronized pass")
    p.add_argument("--no-sync", action="store_true", help="skip the synchronized pass")
    p.add_argument("--burst", type=int, default=0,
                   help="instead of the closed loop: this many rows sharing a cached prefix join "
                        "at once (the agent trace's turns 2+), each --rounds, plain and synchronized")
    p.add_argument("--prefix-tokens", type=int, default=5100, help="--burst: the cached prefix")
    p.add_argument("--suffix-tokens", type=int, default=56, help="--burst: each row's own suffix")
    p.add_argument("--new-shapes", action="store_true",
                   help="--burst: each burst's suffixes one token longer than the last (no shape repeats)")
    p.add_argument("--suffix-spread", type=float, default=0.0,
                   help="--burst: each suffix's length drawn within +- this fraction of "
                        "--suffix-tokens (seeded; 0: all equal, so the group needs no padding)")
    p.add_argument("--snapshot-tokens", type=int, default=0,
                   help="--burst: each row asks for a snapshot this far into its suffix (0: none)")
    p.add_argument("--background", type=lambda v: [int(x) for x in v.split(",")], default=[0, 2],
                   help="--burst: rows already decoding when the burst joins (comma list)")
    p.add_argument("--attention", type=lambda v: [x.strip() for x in v.split(",")], default=["on"],
                   help="contenders: kvtier's attention dispatch on / fold (prefill of new shapes folded too) / "
                        "buckets (prefill attention at bucketed shapes) / off (mlx-lm's own) / "
                        "kernel (the candidate of _decode_kernel.py, CUDA), e.g. on,off,kernel "
                        "(the burst and the unsynchronized pass)")
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    args = p.parse_args(argv)
    if "kernel" in args.attention:
        why = kernel_usable()
        if why is not None:
            # NOTE: the candidate was written without a GPU at hand: say so and
            # measure the other contenders.
            print(f"# the kernel contender is dropped: {why}", flush=True)
            args.attention = [a for a in args.attention if a != "kernel"] or ["on"]
    out = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
