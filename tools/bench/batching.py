"""Continuous-batching throughput: kvtier vs mlx_lm.server, side by side in one run.

Loads (every client sends one greedy chat request at the same moment,
``--max-tokens`` new tokens each):

- ``1``, ``4``, ``8``: that many clients, each with its own distinct prompt;
- ``8-shared``: 8 clients whose prompts share a long system prompt
  (``--system-tokens``) and differ in the user question.

Every round uses fresh prompts (a per-round nonce) so no prompt cache carries
work from one round to the next; within a round, the shared load's clients
share their system prompt. Aggregate tok/s = completion tokens of all
clients / seconds from the moment they all send to the last answer.

Contenders, interleaved (each runs every load once per round, same requests):

- ``mlx_lm.server``: a subprocess on the same model (its ``BatchGenerator``,
  decode concurrency 32, prompt concurrency 8, its own prompt cache),
  non-streaming OpenAI chat requests from one thread per client;
- ``kvtier batch``: kvtier's batch kernel (``kernels.engine.BatchGeneration``)
  driven in-process, with the BLAS thread tuning ``kvtier serve`` uses
  (kept across rounds; ``KVTIER_BATCH_BLAS_TUNE=0`` turns it off for both). NOTE (issue 10, phase 1): the BatchScheduler actor is
  not integrated yet, so this measures the kernel with a small in-process
  driver that plays the scheduler's part: it admits every request at once,
  looks each one up in a longest-prefix store standing in for the prompt
  cache (``Take``), stores every prompt-boundary snapshot and finished row
  (``Put``), and lets a request whose prompt shares a longer prefix with a
  row still prefilling wait for that row's snapshot instead of prefilling
  the same tokens again. No HTTP, no actors;
- ``kvtier serial``: kvtier's serial kernel (``kernels.Generation``), one
  request after another (today's serving lane), on the ``1`` load only
  (``--serial-all`` for every load).

Prints every round, then median and min–max per load and contender, the
kvtier/mlx_lm ratios, and writes a PNG (``--plot``, default
``docs/benchmarks/batching.png``). Run from the repository root:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/batching.py [--rounds 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))

from _common import QUESTIONS, extract_commit, in_threads  # noqa: E402
from prompt_cache import start_kvtier, start_mlx_lm, system_prompt  # noqa: E402

from kernels import (  # noqa: E402
    Generation,
    SamplingParams,
    clone_caches,
    ensure_default_model,
    load_model,
    render_chat,
    run_generation,
)
from kernels.engine import (  # noqa: E402
    BatchGeneration,
    BlasTuning,
    make_blas_tuning,
)

TUNING: BlasTuning | None = None
"""The in-process batch kernel's BLAS thread tuning, kept across rounds like ``kvtier serve``'s."""


def tuning() -> BlasTuning | None:
    """The process's one tuning (made on first use; ``None`` without OpenBLAS of 2+ threads or with --no-blas-tune)."""
    global TUNING
    if TUNING is None and os.environ.get("KVTIER_BATCH_BLAS_TUNE", "1") != "0":
        TUNING = make_blas_tuning()
    return TUNING


TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "the history of the bicycle in three short paragraphs",
    "why bread rises, explained for a ten-year-old",
    "a recipe for a simple tomato soup with one secret ingredient",
    "the rules of chess for someone who has never played",
    "a day in the life of a honeybee in early spring",
    "how a rainbow forms after a summer storm",
    "three tips for learning a new language as an adult",
    "the journey of a letter through the postal system",
    "what makes a good friend, with two short examples",
]
LOADS = ("1", "4", "8", "8-shared")
SHARE_MIN = 64
"""Wait for a prefilling row when it shares this many more tokens (the scheduler's ``share_min``)."""


@dataclass
class Result:
    """One contender on one load in one round."""

    tokens: int
    seconds: float
    prefill_tokens: int = 0
    cpu_s: float = 0.0
    """CPU seconds the serving process used (all its threads) while the load ran."""

    @property
    def tps(self) -> float:
        """Aggregate completion tokens per second."""
        return self.tokens / self.seconds

    @property
    def tpc(self) -> float:
        """Completion tokens per CPU second of the serving process (robust on a shared CPU)."""
        return self.tokens / self.cpu_s if self.cpu_s > 0 else 0.0


@dataclass
class Table:
    """Every round's result per (load, contender)."""

    results: dict[tuple[str, str], list[Result]] = field(default_factory=dict)

    def add(self, load: str, who: str, r: Result) -> None:
        self.results.setdefault((load, who), []).append(r)

    def tps(self, load: str, who: str) -> list[float]:
        return [r.tps for r in self.results.get((load, who), [])]

    def tpc(self, load: str, who: str) -> list[float]:
        return [r.tpc for r in self.results.get((load, who), [])]


def conversations(load: str, nonce: str, system_tokens: int) -> list[list[dict[str, str]]]:
    """The chat messages of each client of ``load`` for one round."""
    if load == "8-shared":
        system = system_prompt(system_tokens, nonce)
        return [
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in QUESTIONS
        ]
    n = int(load)
    return [
        [{"role": "user", "content": f"[{nonce}-{i}] Write about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


# --- mlx_lm.server ------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_http(
    url: str, model: str, convs: Sequence[list[dict[str, str]]], max_tokens: int, pid: int
) -> Result:
    """All clients send at once (one thread each); time to the last answer."""
    tokens = [0] * len(convs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(convs) + 1)

    def client(i: int) -> None:
        try:
            with httpx.Client(timeout=900) as http:
                barrier.wait()
                body = {
                    "model": model,
                    "messages": convs[i],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                resp = http.post(f"{url}/v1/chat/completions", json=body)
                resp.raise_for_status()
                tokens[i] = int(resp.json()["usage"]["completion_tokens"])
        except BaseException as exc:  # noqa: BLE001 - NOTE: re-raised on the main thread below.
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    cpu0 = _proc_cpu_s(pid)
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    cpu = _proc_cpu_s(pid) - cpu0
    if errors:
        raise errors[0]
    return Result(sum(tokens), seconds, cpu_s=cpu)


# --- kvtier, in process ---------------------------------------------------------


class PrefixStore:
    """Stands in for the prompt cache: longest usable common prefix, zero-copy clones, LRU by count."""

    def __init__(self, capacity: int = 32) -> None:
        self._entries: list[tuple[tuple[int, ...], list[Any]]] = []
        self._capacity = capacity

    def take(self, prompt: Sequence[int]) -> tuple[list[Any] | None, int]:
        best, best_n = None, 0
        for tokens, caches in self._entries:
            n = _common(tokens, prompt, len(prompt) - 1)
            if n > best_n:
                best, best_n = caches, n
        if best is None or best_n == 0:
            return None, 0
        return clone_caches(best, best_n), best_n

    def put(self, tokens: Sequence[int], caches: list[Any]) -> None:
        key = tuple(tokens)
        self._entries = [e for e in self._entries if e[0] != key]
        self._entries.append((key, caches))
        del self._entries[: -self._capacity]


def _common(a: Sequence[int], b: Sequence[int], cap: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y or n >= cap:
            break
        n += 1
    return n


def run_batch_kernel(
    lm: Any,
    prompts: Sequence[list[int]],
    max_tokens: int,
    *,
    step_size: int,
    max_rows: int,
    store: PrefixStore,
) -> Result:
    """Admit every prompt at once into a BatchGeneration and step until all rows have left."""
    params = SamplingParams(max_tokens=max_tokens)
    batch = BatchGeneration(
        lm.model, lm.tokenizer, max_rows=max_rows, prefill_step_size=step_size, tuning=tuning()
    )
    tokens = 0
    prefilled = 0
    cpu0 = time.process_time()
    start = time.perf_counter()
    waiting = list(enumerate(prompts))
    # row -> the prompt tokens it is prefilling (until its snapshot is stored)
    prefilling: dict[str, list[int]] = {}

    def admit() -> None:
        still: list[tuple[int, list[int]]] = []
        for i, prompt in waiting:
            cache, cached = store.take(prompt)
            # NOTE: scheduler policy emulated here: if a row still prefilling
            # covers a longer prefix of this prompt, wait for its snapshot.
            shared = max(
                (_common(p, prompt, len(prompt) - 1) for p in prefilling.values()), default=0
            )
            if shared >= cached + SHARE_MIN or len(batch) >= batch.max_rows:
                still.append((i, prompt))
                continue
            batch.join(
                str(i),
                prompt,
                params,
                cache=cache,
                cached_tokens=cached,
                snapshot_at=len(prompt) - 1,
            )
            prefilling[str(i)] = prompt
        waiting[:] = still

    admit()
    while not batch.idle or waiting:
        step = batch.step()
        tokens += len(step.tokens)
        prefilled += step.prefill_tokens
        for snap in step.snapshots:
            store.put(snap.cache_tokens, snap.cache)
        for row_id in step.joined:
            prefilling.pop(row_id, None)
        for e in step.exits:
            store.put(e.cache_tokens, e.cache)
        if waiting:
            admit()
    seconds = time.perf_counter() - start
    batch.close()
    return Result(tokens, seconds, prefilled, time.process_time() - cpu0)


def run_serial(lm: Any, prompts: Sequence[list[int]], max_tokens: int, *, step_size: int) -> Result:
    """One request after another through the serial kernel (no prompt cache)."""
    params = SamplingParams(max_tokens=max_tokens)
    cpu0 = time.process_time()
    start = time.perf_counter()
    tokens = 0
    for prompt in prompts:
        tokens += len(
            run_generation(
                Generation(lm.model, lm.tokenizer, prompt, params, prefill_step_size=step_size)
            )
        )
    seconds = time.perf_counter() - start
    return Result(tokens, seconds, sum(len(p) for p in prompts), time.process_time() - cpu0)


# --- report -----------------------------------------------------------------------


def _metric(table: Table, metric: str) -> Callable[[str, str], list[float]]:
    return table.tps if metric == "tps" else table.tpc


def summarize(table: Table, contenders: Sequence[str]) -> list[str]:
    """Median and min–max per load and contender, for tok/s and tok per CPU second, and the ratios."""
    lines: list[str] = []
    for metric, label in (("tps", "tok/s (wall)"), ("tpc", "tok per CPU s")):
        get = _metric(table, metric)
        lines.append(f"{label}:")
        lines.append(
            f"{'load':<10}{'contender':<16}{'median':>10}{'min':>9}{'max':>9}{'rounds':>8}"
        )
        for load in LOADS:
            for who in contenders:
                xs = get(load, who)
                if xs:
                    med = statistics.median(xs)
                    lines.append(
                        f"{load:<10}{who:<16}{med:>10.1f}{min(xs):>9.1f}{max(xs):>9.1f}{len(xs):>8}"
                    )
        pairs = (
            ("kvtier serve", "mlx_lm.server"),
            ("kvtier base", "mlx_lm.server"),
            ("kvtier serve", "kvtier base"),
            ("kvtier batch", "mlx_lm.server"),
            ("kvtier batch", "kvtier serial"),
            ("kvtier serve", "kvtier serial"),
        )
        for load in LOADS:
            for ours, theirs in pairs:
                k, m = get(load, ours), get(load, theirs)
                if k and m:
                    per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(k, m, strict=False))
                    ratio = statistics.median(k) / statistics.median(m)
                    lines.append(
                        f"  {ours} / {theirs}, load {load:<8}: {ratio:.3f} (per round {per_round})"
                    )
        lines.append("")
    return lines


def plot(table: Table, contenders: Sequence[str], path: Path, title: str) -> None:
    """Two panels (wall tok/s, tok per CPU s): median bars with min–max whiskers per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    width = 0.8 / len(contenders)
    panels = (
        ("tps", "aggregate completion tok/s (wall)"),
        ("tpc", "completion tokens per CPU second"),
    )
    for ax, (metric, ylabel) in zip(axes, panels, strict=True):
        get = _metric(table, metric)
        for j, who in enumerate(contenders):
            xs, meds, lo, hi = [], [], [], []
            for i, load in enumerate(LOADS):
                vals = get(load, who)
                if not vals:
                    continue
                med = statistics.median(vals)
                xs.append(i + (j - (len(contenders) - 1) / 2) * width)
                meds.append(med)
                lo.append(med - min(vals))
                hi.append(max(vals) - med)
            bars = ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=who)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
        ax.set_xticks(
            range(len(LOADS)), [f"{load} client{'s' if load != '1' else ''}" for load in LOADS]
        )
        ax.set_ylabel(f"{ylabel}\n(median, min–max)", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def blas_line() -> str:
    """What the in-process batch kernel's BLAS thread tuning did."""
    t = TUNING
    if t is None:
        return "BLAS thread tuning: off (no OpenBLAS of 2+ threads, or KVTIER_BATCH_BLAS_TUNE=0)"
    c = t.chooser
    return (
        f"BLAS thread tuning: now {c.current} threads, {c.trials} trials, "
        f"{c.skipped} skipped (threads had their cores), {c.switches} switches"
    )


def first_difference(want: Sequence[Any], got: Sequence[Any]) -> int:
    """The first index where ``want`` and ``got`` differ (the shorter's length when one is a prefix)."""
    return next(
        (j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
        min(len(want), len(got)),
    )


def parity(
    lm: Any, n: int, max_tokens: int, max_rows: int, step_size: int, served_url: str = ""
) -> list[str]:
    """Greedy tokens of ``n`` distinct chat prompts: batch rows (joining as room frees) vs the serial kernel.

    For a row that differs, the serial logits of the two tokens at the first
    difference (a one-shot forward of the prompt and the serial tokens before it).
    With ``served_url`` (a ``kvtier serve`` of the same model), the same
    prompts also go through HTTP, see :func:`served_parity`.
    """
    import mlx.core as mx

    # NOTE: distinct prompts (each carries its own index).
    convs = conversations(str(n), "parity", 0)
    prompts = [render_chat(lm.tokenizer, c) for c in convs]
    params = SamplingParams(max_tokens=max_tokens)
    serial = [
        [
            o.token_id
            for o in run_generation(
                Generation(lm.model, lm.tokenizer, p, params, prefill_step_size=step_size)
            )
        ]
        for p in prompts
    ]
    batch = BatchGeneration(
        lm.model, lm.tokenizer, max_rows=max_rows, prefill_step_size=step_size, tuning=tuning()
    )
    out: dict[str, list[int]] = {str(i): [] for i in range(n)}
    waiting = list(range(n))
    while waiting or not batch.idle:
        while waiting and len(batch) < batch.max_rows:
            i = waiting.pop(0)
            batch.join(str(i), prompts[i], params)
        for t in batch.step().tokens:
            out[t.row_id].append(t.output.token_id)
    lines = []
    equal = 0
    for i, want in enumerate(serial):
        got = out[str(i)]
        if got == want:
            equal += 1
            continue
        k = first_difference(want, got)
        logits = lm.model(mx.array([*prompts[i], *want[:k]])[None])[0, -1]
        gap = (
            float((logits[want[k]] - logits[got[k]]).item())
            if k < min(len(want), len(got))
            else float("nan")
        )
        lines.append(f"row {i}: first difference at token {k}, serial logit gap {gap:.3g}")
    lines.insert(
        0,
        f"parity: {equal}/{n} rows token-for-token equal ({max_tokens} greedy tokens, {max_rows} rows at a time)",
    )
    lines.append(blas_line())
    if served_url:
        lines += served_parity(lm, served_url, convs, serial, max_tokens)
    return lines


PARITY_STAGGER_S = 0.5
"""Served parity: request ``i`` is sent ``i`` x this after the first."""


def served_parity(
    lm: Any,
    url: str,
    convs: Sequence[list[dict[str, str]]],
    serial: Sequence[Sequence[int]],
    max_tokens: int,
) -> list[str]:
    """The same chats through ``kvtier serve``: each answer's text vs the serial kernel's tokens, decoded.

    NOTE: arrivals are staggered (``PARITY_STAGGER_S``) and outnumber the
    server's rows, so rows join a step chain that is already running (at
    arrival, and as finished rows free room): the served path's offers,
    not only rows that start together. The server sends text, so the check
    is the text of the serial tokens (EOS left out) against the answer's.
    """
    texts: list[str] = [""] * len(convs)
    with httpx.Client(timeout=30) as http:
        before = http.get(f"{url}/stats").json()
        served_model = http.get(f"{url}/v1/models").json()["data"][0]["id"]
    t0 = time.perf_counter()

    def client(i: int) -> None:
        time.sleep(max(0.0, t0 + i * PARITY_STAGGER_S - time.perf_counter()))
        body = {
            "model": served_model,
            "messages": convs[i],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        with httpx.Client(timeout=900) as http:
            resp = http.post(f"{url}/v1/chat/completions", json=body)
            resp.raise_for_status()
            texts[i] = str(resp.json()["choices"][0]["message"]["content"] or "")

    in_threads(client, len(convs))
    with httpx.Client(timeout=30) as http:
        after = http.get(f"{url}/stats").json()
    eos = set(lm.tokenizer.eos_token_ids)
    lines = []
    equal = 0
    for i, (want_ids, got) in enumerate(zip(serial, texts, strict=True)):
        want = lm.tokenizer.decode([t for t in want_ids if t not in eos])
        if got == want:
            equal += 1
            continue
        k = first_difference(want, got)
        lines.append(f"served row {i}: text differs at character {k}: {want[k:k + 30]!r} vs {got[k:k + 30]!r}")
    steps = _counter(after, ("batch", "batch", "steps", "run")) - _counter(
        before, ("batch", "batch", "steps", "run")
    )
    turns = _counter(after, ("gateway", "token", "batch_chains", "granted")) - _counter(
        before, ("gateway", "token", "batch_chains", "granted")
    )
    lines.insert(
        0,
        f"served parity: {equal}/{len(convs)} answers equal to the serial kernel's text "
        f"(kvtier serve, requests {PARITY_STAGGER_S:g} s apart; {steps} batch steps in {turns} turns)",
    )
    return lines


def _counter(stats: dict[str, Any], path: Sequence[str]) -> int:
    """A counter of the engine's ``/stats`` body (``stats["engine"]`` then ``path``); 0 when absent."""
    node: Any = stats.get("engine", {})
    for key in path:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    return int(node) if isinstance(node, int) else 0


def start_serve(model_dir: Path, workdir: Path, args: argparse.Namespace, base: Path | None = None) -> Any:
    """``kvtier serve --max-batch <max-rows> --prefill-step-size <prefill-step-size>`` (a ``_common.Server``).

    ``base``: another tree's ``kvtier serve`` (``--serve-base``), run from it with its ``PYTHONPATH``.
    """
    extra = {} if base is None else {"name": "kvtier-base", "env": {"PYTHONPATH": str(base)}, "cwd": base}
    return start_kvtier(
        model_dir,
        workdir,
        "--max-batch",
        str(args.max_rows),
        "--prefill-step-size",
        str(args.prefill_step_size),
        **extra,
    )


def main() -> int:
    """Run every contender on every load for ``--rounds`` rounds and report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model dir (default model if unset)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--prefill-step-size", type=int, default=256,
                        help="kvtier's prefill chunk, both kvtier contenders (default: kvtier serve's CPU default)")
    parser.add_argument("--max-rows", type=int, default=8)
    parser.add_argument(
        "--loads", default=",".join(LOADS), help="comma-separated subset of " + ",".join(LOADS)
    )
    parser.add_argument(
        "--serial-all", action="store_true", help="run the serial lane on every load"
    )
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument(
        "--parity",
        type=int,
        default=0,
        help="only compare greedy tokens of this many prompts (batch vs serial kernel; with --serve "
        "also kvtier serve's answers, arrivals staggered) and exit",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="also run `kvtier serve --max-batch <max-rows>` over HTTP (the batch lane's actors)",
    )
    parser.add_argument(
        "--serve-base",
        default=None,
        metavar="COMMIT",
        help="with --serve: also serve this commit's tree (git archive) as `kvtier base`, "
        "interleaved with this tree's `kvtier serve` (a change's served A/B)",
    )
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "benchmarks" / "batching.png")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every round's figures here"
    )
    args = parser.parse_args()
    model_dir = args.model or ensure_default_model()
    lm = load_model(model_dir)
    if args.parity:
        with tempfile.TemporaryDirectory() as tmp:
            served = start_serve(model_dir, Path(tmp), args) if args.serve else None
            try:
                lines = parity(
                    lm,
                    args.parity,
                    args.max_tokens,
                    args.max_rows,
                    args.prefill_step_size,
                    served.url if served is not None else "",
                )
            finally:
                if served is not None:
                    served.stop()
        for line in lines:
            print(line)
        return 0
    if args.serve_base and not args.serve:
        parser.error("--serve-base needs --serve")
    contenders = ["mlx_lm.server", "kvtier serve", "kvtier base", "kvtier batch", "kvtier serial"]
    table = Table()
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.skip_mlx_lm else start_mlx_lm(model_dir, Path(tmp))
        serve = None
        base = None
        serve_model = ""
        serve_blas = ""
        if args.serve:
            serve = start_serve(model_dir, Path(tmp), args)
            serve_model = httpx.get(f"{serve.url}/v1/models", timeout=10).json()["data"][0]["id"]
        if args.serve_base:
            base = start_serve(model_dir, Path(tmp), args, extract_commit(args.serve_base, Path(tmp))[1])
        try:
            for warm in (serve, base):
                if warm is not None:
                    run_http(
                        warm.url, serve_model, conversations("1", "warmup", 50), 8, warm.proc.pid
                    )
            if server is not None:
                run_http(
                    server.url, str(model_dir), conversations("1", "warmup", 50), 8, server.proc.pid
                )
            run_batch_kernel(
                lm,
                [render_chat(lm.tokenizer, conversations("1", "warmup", 50)[0])],
                8,
                step_size=args.prefill_step_size,
                max_rows=args.max_rows,
                store=PrefixStore(),
            )
            for r in range(args.rounds):
                for load in args.loads.split(","):
                    nonce = f"r{r}-{load}-{time.time_ns()}"
                    convs = conversations(load, nonce, args.system_tokens)
                    prompts = [render_chat(lm.tokenizer, c) for c in convs]
                    runs: list[tuple[str, Callable[[], Result]]] = []
                    if server is not None:
                        runs.append(
                            (
                                "mlx_lm.server",
                                partial(
                                    run_http,
                                    server.url,
                                    str(model_dir),
                                    convs,
                                    args.max_tokens,
                                    server.proc.pid,
                                ),
                            )
                        )
                    if serve is not None:
                        runs.append(
                            (
                                "kvtier serve",
                                partial(
                                    run_http,
                                    serve.url,
                                    serve_model,
                                    convs,
                                    args.max_tokens,
                                    serve.proc.pid,
                                ),
                            )
                        )
                    if base is not None:
                        runs.append(
                            (
                                "kvtier base",
                                partial(
                                    run_http, base.url, serve_model, convs, args.max_tokens,
                                    base.proc.pid,
                                ),
                            )
                        )
                    runs.append(
                        (
                            "kvtier batch",
                            partial(
                                run_batch_kernel,
                                lm,
                                prompts,
                                args.max_tokens,
                                step_size=args.prefill_step_size,
                                max_rows=args.max_rows,
                                store=PrefixStore(),
                            ),
                        )
                    )
                    if load == "1" or args.serial_all:
                        runs.append(
                            (
                                "kvtier serial",
                                partial(
                                    run_serial,
                                    lm,
                                    prompts,
                                    args.max_tokens,
                                    step_size=args.prefill_step_size,
                                ),
                            )
                        )
                    # NOTE: alternate who goes first so load drift on the shared CPU cancels out.
                    if r % 2 == 1:
                        runs.reverse()
                    for who, fn in runs:
                        res = fn()
                        table.add(load, who, res)
                        print(
                            f"round {r} load {load:<9}{who:<16}{res.tokens:>5} tok {res.seconds:>7.2f} s {res.tps:>7.1f} tok/s"
                            f"  prompt {sum(len(p) for p in prompts)} tok"
                            + (
                                f", {res.prefill_tokens} forwarded"
                                if who != "mlx_lm.server"
                                else ""
                            ),
                            flush=True,
                        )
            for label, served in (("kvtier serve", serve), ("kvtier base", base)):
                if served is not None:
                    stats = httpx.get(f"{served.url}/stats", timeout=30).json()
                    engine_stats = stats.get("engine", {})
                    blas = engine_stats.get("batch", {}).get("batch", {}).get("blas")
                    serve_blas += f"{label}: BLAS thread tuning {blas if blas else 'off'}\n"
        finally:
            if server is not None:
                server.stop()
            if serve is not None:
                serve.stop()
            if base is not None:
                base.stop()
    print()
    for line in summarize(table, contenders):
        print(line)
    print(f"kvtier batch (in process): {blas_line()}")
    if serve_blas:
        print(serve_blas, end="")
    title = (
        f"{model_dir.name}: {args.max_tokens} new tokens per client, {args.rounds} rounds; "
        "kvtier batch = kernel driven in-process; kvtier serve = the batch lane over HTTP"
    )
    plot(
        table,
        [c for c in contenders if any(table.tps(load, c) for load in LOADS)],
        args.plot,
        title,
    )
    print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    f"{load}|{who}": [r.__dict__ for r in rs]
                    for (load, who), rs in table.results.items()
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
