"""Time per decode step through HTTP vs in process, under a closed-loop load, on a model with short steps.

On the H200 a batch step of an 8B-shaped model is ~20 ms, so a fixed cost of
a few ms per step or per step chain on the served path (the gateway round
trip when a chain ends, the loop's wake, per-step hooks) is a large share;
on the CPU with the default model (steps of 100+ ms) it hides. This tool
makes steps short on the CPU: a seeded random-weight mlx-lm ``llama`` of
``gpu_engine.SHAPES[--shape]`` (``--dtype``, float32) with the default model's
tokenizer, written to a temporary directory, and drives, rounds
interleaved in one run:

1. ``kvtier serve`` (subprocess, ``--ssd-cache off`` unless ``--ssd``, ``--max-batch B``):
   ``B`` concurrent streaming clients (httpx, real HTTP), each sending
   ``--requests`` requests one after the other (guidellm's concurrency
   profile: a row leaves and another joins all the time), distinct prompts
   of ``--prompt-tokens`` tokens, ``--max-tokens`` new tokens, greedy,
   ``ignore_eos``;
2. ``Engine`` in process on the same directory, ``max_batch=B``, the same
   load through ``Engine.generate``; every ``BatchGeneration.step`` is
   timed (the kernel's own step time, the floor of an inter-token gap).

Per contender: aggregate tok/s, ITL p50 (client side, between content
chunks), and from ``/stats`` (``Engine.stats()``) the batch steps run, the
batch turns (each turn is one gateway grant; a turn runs a chain of steps:
steps per turn says how often chains end) and the engine thread's busy
time; with ``--ssd`` (each server with its own SSD tier, so write-behind's
background steps run under the load) also the background steps granted,
how many ran inside a chain (lent to it) and how many chains were cut.
Prints the served/in-process ratios. ``--json`` writes everything;
``--plot OUT LABEL=JSON ...`` draws runs' rounds side by side.

``--in-turn`` keeps one contender alive at a time (each round starts each
server and opens the in-process Engine in turn, each with its warm-up round):
a card that holds one of them but not two, as an H100 at 32 rows of the 8B
shape, where the Engine's first step failed out of memory beside the
warmed server.

``--baseline-tree DIR`` adds ``served-base``: the same ``kvtier serve`` from
another checkout (a git worktree of the commit before a change), so a
change's before and after run side by side in one run.

On the 2-core box the real kernel's step is CPU-bound and shares the cores
with the HTTP loop and the clients, which blurs throughput. ``--stand-in
BUILD_MS,COMPUTE_MS`` swaps the kernel (here and in the servers) for
``batch_step_cost.py``'s stand-in: BUILD_MS holding the GIL, then COMPUTE_MS
asleep without it, as a GPU host runs a step. The servers log each stand-in
step, so every contender also shows its *kernel busy* share: the steps' time
over the span from the first step's start to the last one's end (what the
path between steps leaves of the engine).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/served_steps.py --tok-dir .gpu/tok --rows 32 --rounds 3 \\
        --stand-in 3,17 --baseline-tree /tmp/wt-base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Server, StepTimer, start_kvtier
from gpu_engine import DEFAULT_TOK_DIR, filler_ids, load_tokenizer
from serving import write_random_model


class StepClock(StepTimer):
    """Start and end of every kernel step in this process (the in-process contender):
    ``BatchGeneration.step``, or the stand-in's step."""

    def take(self) -> dict[str, float]:
        """Median step and the engine thread's idle share between steps since the last call."""
        return span_figures(self.take_spans())


SITECUSTOMIZE = """
# Written by tools/bench/served_steps.py --stand-in: the batch lane's kernel is a timed stand-in.
import os, sys, time
# NOTE: --switch-interval-ms, for the `served` server only.
if os.environ.get("SERVED_STEPS_SWITCH_S"):
    sys.setswitchinterval(float(os.environ["SERVED_STEPS_SWITCH_S"]))
# NOTE: the packages first, from this interpreter's own path (a baseline tree's
# PYTHONPATH): batch_step_cost puts the tools' checkout first on sys.path.
import actors, kernels, messages
import actors.batch_scheduler.wiring as batch_wiring
sys.path.insert(0, {bench!r})
import batch_step_cost
batch_step_cost.StandIn.build_s = {build_s!r}
# NOTE: the sleep moves into _hold, which times the two parts apart.
batch_step_cost.StandIn.compute_s = 0.0
batch_wiring.BatchEngine = batch_step_cost.StandIn
# NOTE: per step (CLOCK_MONOTONIC, as the tool's perf_counter), a line each: its start, the end
# of its GIL-held part, the end of its sleep (the GIL taken back), its end.
_spans = open(os.path.join({site!r}, "spans-%d.txt" % os.getpid()), "a", buffering=1)
_marks = []
_hold_gil = batch_step_cost._hold_gil
def _hold(seconds):
    _hold_gil(seconds)
    _marks.append(time.perf_counter())
    time.sleep({compute_s!r})
    _marks.append(time.perf_counter())
batch_step_cost._hold_gil = _hold
_inner = batch_step_cost.StandIn.step
def _step(self, *a, **k):
    _marks.clear()
    t = time.perf_counter()
    try:
        return _inner(self, *a, **k)
    finally:
        held, slept = _marks if len(_marks) == 2 else (t, t)
        _spans.write("%.6f %.6f %.6f %.6f\\n" % (t, held, slept, time.perf_counter()))
batch_step_cost.StandIn.step = _step
"""


def stand_in(args: argparse.Namespace, work: Path) -> tuple[Any, dict[str, str], Path]:
    """Swap the batch lane's kernel for ``batch_step_cost.StandIn`` here and in the servers.

    Returns the stand-in class (for :class:`StepClock`), the servers' extra
    environment (a ``sitecustomize`` first on ``PYTHONPATH`` does the swap there,
    and logs each step's start and end) and the directory of those logs.
    """
    import batch_step_cost

    import actors.batch_scheduler.wiring as batch_wiring

    build_ms, compute_ms = (float(x) for x in args.stand_in.split(","))
    batch_step_cost.StandIn.build_s = build_ms / 1000
    batch_step_cost.StandIn.compute_s = compute_ms / 1000
    setattr(batch_wiring, "BatchEngine", batch_step_cost.StandIn)  # noqa: B010 - a swap for the run
    site = work / "stand-in"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(
            bench=str(Path(__file__).resolve().parent),
            site=str(site),
            build_s=build_ms / 1000,
            compute_s=compute_ms / 1000,
        )
    )
    return batch_step_cost.StandIn, {"PYTHONPATH": str(site)}, site

def _prompts(tok: Any, args: argparse.Namespace, tag: str) -> list[list[list[int]]]:
    """Per client, its ``--requests`` distinct prompts."""
    return [
        [filler_ids(tok, args.prompt_tokens, f"{tag}-{c}-{r}") for r in range(args.requests)]
        for c in range(args.rows)
    ]


def span_figures(spans: list[tuple[float, float]]) -> dict[str, float]:
    """Median and mean step and the kernel's share of the time from the first step's start to the last's end."""
    spans = sorted(spans)
    if len(spans) < 2:
        return {}
    busy = sum(b - a for a, b in spans)
    return {
        "step_median_ms": statistics.median(b - a for a, b in spans) * 1e3,
        "step_mean_ms": busy / len(spans) * 1e3,
        "kernel_busy_share": busy / (spans[-1][1] - spans[0][0]),
    }


def part_figures(marks: list[tuple[float, ...]]) -> dict[str, float]:
    """Mean ms of a served stand-in step's parts: GIL held (build), asleep + the GIL taken back, the rest."""
    if not marks:
        return {}
    n = len(marks)
    return {
        "hold_mean_ms": sum(h - a for a, h, _, _ in marks) / n * 1e3,
        "sleep_mean_ms": sum(s - h for _, h, s, _ in marks) / n * 1e3,
        "rest_mean_ms": sum(b - s for _, _, s, b in marks) / n * 1e3,
    }


def server_spans(site: Path, pid: int, t0: float, t1: float) -> list[tuple[float, ...]]:
    """The stand-in steps a server ran between ``t0`` and ``t1`` (its spans file): start, end of
    the GIL-held part, end of the sleep, end."""
    path = site / f"spans-{pid}.txt"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        marks = tuple(float(x) for x in line.split())
        if marks[0] >= t0 and marks[-1] <= t1:
            out.append(marks)
    return out


def _batch_counts(stats: dict[str, Any]) -> tuple[int, int]:
    """(batch steps run, batch turns granted) from a ``/stats`` body."""
    steps = int(stats["batch"]["batch"]["steps"]["run"])
    turns = int(stats["gateway"]["token"]["batch_chains"]["granted"])
    return steps, turns


async def _settled(read: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Engine stats once the engine thread's job in flight has ended: two readings agree.

    NOTE: a client sees its last token before the step chain that made it
    ends, and the chain's busy time and steps are counted at its end, so a
    reading taken at once can miss the round's last chain (all of a short one).
    """
    prev = await read()
    for _ in range(100):
        await asyncio.sleep(0.02)
        now = await read()
        if (_batch_counts(now) == _batch_counts(prev)
                and now["engine_thread"]["busy_s"] == prev["engine_thread"]["busy_s"]):
            return now
        prev = now
    return prev


def _summary(
    wall: float, tokens: int, gaps: list[float], before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    s0, t0 = _batch_counts(before)
    s1, t1 = _batch_counts(after)
    steps, turns = s1 - s0, t1 - t0
    busy = after["engine_thread"]["busy_s"] - before["engine_thread"]["busy_s"]

    def token(stats: dict[str, Any], *keys: str) -> float:
        node: Any = stats["gateway"]["token"]
        for key in keys:
            node = node.get(key, 0) if isinstance(node, dict) else 0
        return float(node or 0)

    def delta(*keys: str) -> int:
        return int(token(after, *keys) - token(before, *keys))

    return {
        "background_grants": delta("grants", "background"),
        "background_under_load": delta("background_under_load", "turns"),
        "background_in_chain": delta("background_under_load", "in_chain"),
        "chains_cut": delta("batch_chains", "preempted"),
        "background_under_load_s": token(after, "background_under_load", "held_s")
        - token(before, "background_under_load", "held_s"),
        "engine_busy_share": busy / wall,
        "tps": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "steps": steps,
        "turns": turns,
        "steps_per_turn": steps / turns if turns else 0.0,
        "wall_per_step_ms": wall / steps * 1e3 if steps else 0.0,
    }


async def served_round(url: str, model: str, prompts: list[list[list[int]]], max_tokens: int,
                       chat_tok: Any = None) -> dict[str, Any]:
    """Closed loop through HTTP: each client sends its prompts one after the other (streamed completions).

    ``chat_tok``: send each prompt's text (decoded with this tokenizer) as
    one user message to ``/v1/chat/completions`` instead, as guidellm's
    load does (the chat path: template, the prompt cache's conversation
    snapshot); tokens are then counted from the stream's usage.
    """
    gaps: list[float] = []
    tokens = 0

    async def client(http: httpx.AsyncClient, mine: list[list[int]]) -> None:
        nonlocal tokens
        for prompt in mine:
            body: dict[str, Any] = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
            }
            if chat_tok is None:
                body["prompt"] = prompt
                path = "/v1/completions"
            else:
                body["messages"] = [{"role": "user", "content": chat_tok.decode(prompt)}]
                body["stream_options"] = {"include_usage": True}
                path = "/v1/chat/completions"
            last: float | None = None
            async with http.stream("POST", f"{url}{path}", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    obj = json.loads(line[5:])
                    usage = obj.get("usage")
                    if chat_tok is not None and usage:
                        tokens += int(usage["completion_tokens"])
                    for choice in obj.get("choices") or []:
                        piece = (choice.get("text") if chat_tok is None
                                 else (choice.get("delta") or {}).get("content"))
                        if not piece and chat_tok is not None:
                            continue
                        if piece is None:
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        if chat_tok is None:
                            tokens += 1

    async with httpx.AsyncClient(timeout=600) as http:
        before = (await http.get(f"{url}/stats")).json()["engine"]
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, mine) for mine in prompts))
        wall = time.perf_counter() - t0

        async def read() -> dict[str, Any]:
            return dict((await http.get(f"{url}/stats")).json()["engine"])

        after = await _settled(read)
    return {**_summary(wall, tokens, gaps, before, after), "t0": t0, "t1": t0 + wall}


async def engine_round(engine: Any, prompts: list[list[list[int]]], max_tokens: int, clock: StepClock) -> dict[str, Any]:
    """The same closed loop through ``Engine.generate`` in this process."""
    from actors.engine import GenerationParams, TokenEvent

    gaps: list[float] = []
    tokens = 0
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)

    async def client(mine: list[list[int]]) -> None:
        nonlocal tokens
        for prompt in mine:
            last: float | None = None
            async with engine.generate(prompt, params) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        tokens += 1

    before = await engine.stats()
    clock.take()
    t0 = time.perf_counter()
    await asyncio.gather(*(client(mine) for mine in prompts))
    wall = time.perf_counter() - t0
    after = await _settled(engine.stats)
    steps = clock.take()
    return {**_summary(wall, tokens, gaps, before, after), **steps}


def _line(who: str, r: dict[str, Any]) -> str:
    extra = f"  engine thread busy {r['engine_busy_share']:.0%}"
    if "step_median_ms" in r:
        extra += (f"  kernel step p50 {r['step_median_ms']:.2f} mean {r['step_mean_ms']:.2f} ms"
                  f"  kernel busy {r['kernel_busy_share']:.0%}")
    if "hold_mean_ms" in r:
        extra += (f"  (held {r['hold_mean_ms']:.1f} + asleep {r['sleep_mean_ms']:.1f}"
                  f" + rest {r['rest_mean_ms']:.1f} ms)")
    if r.get("background_grants"):
        extra += (f"  background {r['background_grants']} (under load {r['background_under_load']}"
                  f" for {r['background_under_load_s'] * 1e3:.0f} ms, in a chain"
                  f" {r['background_in_chain']}), chains cut {r['chains_cut']}")
    return (
        f"  {who:<10} {r['tps']:8.1f} tok/s  ITL p50 {r['itl_p50_ms']:6.2f} ms  "
        f"wall/step {r['wall_per_step_ms']:6.2f} ms  steps {r['steps']:5d}  turns {r['turns']:4d}  "
        f"steps/turn {r['steps_per_turn']:5.1f}{extra}"
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of every contender; returns the records."""
    from actors.engine import Engine

    tok = load_tokenizer(args.tok_dir)
    work = Path(tempfile.mkdtemp(prefix="kvtier-served-steps-"))
    model_dir = (
        args.model
        if args.model is not None
        else write_random_model(work / "model", args.shape, args.tok_dir, args.seed, args.dtype)
    )
    batch = args.max_batch or args.rows
    # NOTE: unless --in-turn, every contender lives at once (the servers and
    # the in-process Engine); --prompt-cache caps each one's prompt cache.
    cache = () if args.prompt_cache is None else ("--prompt-cache", str(args.prompt_cache))
    serve_args = ("--ssd-cache", "off", "--max-batch", str(batch), "--max-queue",
                  str(max(batch, args.rows)), *cache, *args.kvtier_arg)
    kernel, env, site = stand_in(args, work) if args.stand_in else (None, {}, None)
    mine = dict(env)
    if args.switch_interval_ms > 0:
        if site is None:
            raise SystemExit("--switch-interval-ms needs --stand-in")
        mine["SERVED_STEPS_SWITCH_S"] = str(args.switch_interval_ms / 1000)
    # NOTE: --ssd: each server its own SSD tier (a directory is locked by one server).
    ssd = ("--ssd-cache", str(work / "ssd-served")) if args.ssd else ()

    def start_served() -> Server:
        return start_kvtier(model_dir, work, *serve_args, *ssd, env=mine)

    starters: dict[str, Callable[[], Server]] = {"served": start_served}
    if args.baseline_tree is not None:
        # NOTE: the same command from another checkout: ``-P`` keeps the working
        # directory (this checkout) off sys.path, so PYTHONPATH decides.
        path = [*env.values(), str(args.baseline_tree.resolve())]
        base_env = {"PYTHONPATH": ":".join(path)}
        cmd = [sys.executable, "-P", "-m", "actors.cli", "serve", "--model", str(model_dir),
               "--port", "0", *serve_args,
               *(("--ssd-cache", str(work / "ssd-base")) if args.ssd else ())]

        def start_base() -> Server:
            base = Server(cmd, work, "base", base_env)
            base.wait_ready(None, 180.0)
            return base

        starters["served-base"] = start_base
    if args.in_turn and args.chat:
        raise SystemExit("--chat needs the server alive beside the in-process Engine: not with --in-turn")
    clock = StepClock(kernel)
    cache_bytes = None if args.prompt_cache is None else int(args.prompt_cache * 2**30)

    def open_engine() -> Any:
        return Engine(model_dir, max_batch=args.max_batch or args.rows,
                      max_queue=max(args.max_batch or 0, args.rows), prompt_cache_bytes=cache_bytes)

    async def measure(who: str, rnd: int, target: Any, model: str) -> dict[str, Any]:
        """``who``'s measured round ``rnd`` on ``target`` (the Engine, or ``who``'s server)."""
        prompts = _prompts(tok, args, f"{who}-{rnd}")
        if who == "engine":
            return await engine_round(target, prompts, args.max_tokens, clock)
        if who == "served-chat":
            return await served_round(target.url, model, prompts, args.max_tokens, chat_tok=tok)
        rec = await served_round(target.url, model, prompts, args.max_tokens)
        if site is not None:
            spans = server_spans(site, target.proc.pid, rec["t0"], rec["t1"])
            rec.update(span_figures([(m[0], m[-1]) for m in spans]))
            rec.update(part_figures(spans))
        return rec

    async def in_turn(who: str, rnd: int) -> dict[str, Any]:
        """``who`` alone: started (or opened), warmed at this row count, measured, stopped."""
        if who == "engine":
            async with open_engine() as engine:
                await engine_round(engine, _prompts(tok, _one_req(args), f"w-e-{rnd}"), 8, clock)
                return await measure(who, rnd, engine, "")
        server = starters[who]()
        try:
            model = await _model_id(server.url)
            await served_round(server.url, model, _prompts(tok, _one_req(args), f"w-{who}-{rnd}"), 8)
            return await measure(who, rnd, server, model)
        finally:
            server.stop()

    contenders = [*starters, *(["served-chat"] if args.chat else [])]
    records: list[dict[str, Any]] = []
    servers: dict[str, Server] = {}
    targets: dict[str, Any] = {}
    model = ""
    async with contextlib.AsyncExitStack() as stack:
        try:
            if not args.in_turn:
                servers = {name: start() for name, start in starters.items()}
                live = await stack.enter_async_context(open_engine())
                model = await _model_id(servers["served"].url)
                # NOTE: warm-up of each at this row count (first steps build and compile).
                for name, server in servers.items():
                    await served_round(server.url, model, _prompts(tok, _one_req(args), f"w-{name}"), 8)
                await engine_round(live, _prompts(tok, _one_req(args), "w-e"), 8, clock)
                if args.chat:
                    await served_round(servers["served"].url, model,
                                       _prompts(tok, _one_req(args), "w-chat"), 8, chat_tok=tok)
                targets = {**servers, "served-chat": servers["served"], "engine": live}
            for rnd in range(args.rounds):
                order = [*contenders, "engine"]
                if rnd % 2:
                    order.reverse()
                # NOTE: --in-turn: one contender alive at a time, each warmed at this row count.
                rec = {who: await (in_turn(who, rnd) if args.in_turn
                                   else measure(who, rnd, targets[who], model))
                       for who in order}
                _print_round(rec, contenders, rnd, args.rows)
                records.append(rec)
        finally:
            for server in servers.values():
                server.stop()
    keys = [k for k in records[0] if k.startswith("ratio_")]
    med = {k: statistics.median(r[k] for r in records) for k in keys}
    print(f"medians over {len(records)} rounds:", flush=True)
    for k in keys:
        print(f"  {k}: {med[k]:.2f}", flush=True)
    return {"args": {k: str(v) for k, v in vars(args).items() if k != "json"},
            "records": records, "median": med}


def _print_round(rec: dict[str, Any], contenders: list[str], rnd: int, rows: int) -> None:
    """Add the round's served/in-process ratios to ``rec`` and print its lines."""
    print(f"round {rnd} ({rows} clients):", flush=True)
    for who in contenders:
        rec[f"ratio_tps.{who}"] = rec[who]["tps"] / rec["engine"]["tps"]
        rec[f"ratio_itl.{who}"] = rec[who]["itl_p50_ms"] / rec["engine"]["step_median_ms"]
        print(_line(who, rec[who]), flush=True)
    print(_line("in-process", rec["engine"]), flush=True)
    for who in contenders:
        print(
            f"  {who}: served/in-process tok/s {rec[f'ratio_tps.{who}']:.2f}; "
            f"served ITL p50 / kernel step p50 {rec[f'ratio_itl.{who}']:.2f}",
            flush=True,
        )


async def _model_id(url: str) -> str:
    """The id the server at ``url`` serves its model under."""
    async with httpx.AsyncClient() as http:
        return str((await http.get(f"{url}/v1/models")).json()["data"][0]["id"])


def _one_req(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "requests": 1})


def plot(out: Path, runs: list[str]) -> None:
    """Bars of served and in-process tok/s per round for each ``LABEL=JSON`` run, the ratio above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run_arg in zip(axes[0], runs, strict=True):
        label, _, path = run_arg.partition("=")
        doc = json.loads(Path(path).read_text())
        records = doc["records"]
        xs = range(len(records))
        served = [r["served"]["tps"] for r in records]
        engine = [r["engine"]["tps"] for r in records]
        ax.bar([x - 0.2 for x in xs], served, 0.4, label="served (HTTP)")
        ax.bar([x + 0.2 for x in xs], engine, 0.4, label="in process")
        for x, a, b in zip(xs, served, engine, strict=True):
            ax.text(x, max(a, b), f"{a / b:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"round {x}" for x in xs])
        ax.set_ylabel("tok/s")
        ax.set_title(f"{label}: {doc['args']['rows']} client(s), --max-batch "
                     f"{doc['args'].get('max_batch') or doc['args']['rows']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print, write ``--json``; or ``--plot OUT LABEL=JSON ...`` only."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--plot"]:
        plot(Path(argv[1]), argv[2:])
        return 0
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rows", type=int, default=32, help="concurrent clients = --max-batch rows")
    p.add_argument("--in-turn", action="store_true",
                   help="one contender alive at a time: each round starts each server and opens the "
                        "in-process Engine in turn, each with a warm-up round (for a card that cannot "
                        "hold two of them at once: 32 rows of the 8B shape on an H100)")
    p.add_argument("--prompt-cache", type=float, default=None, metavar="GB",
                   help="RAM prompt-cache cap of every contender (none: each one's default, a quarter "
                        "of the device's memory on CUDA: two of them and two models overfill an H100)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="--max-batch of both contenders (0: --rows); e.g. 8 with --rows 1 is "
                        "kvtier serve's default lane under one client")
    p.add_argument("--requests", type=int, default=3, help="requests each client sends in turn")
    p.add_argument("--prompt-tokens", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the contenders' order alternates")
    p.add_argument("--shape", default="tiny", help="gpu_engine.SHAPES entry of the random model")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the weights' type (bfloat16 for an 8B shape on a GPU)",
    )
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR, help="tokenizer directory")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="serve this model directory instead of writing a random one (e.g. the 8B "
        "shape gpu_serving.sh run wrote; --shape, --seed, --dtype are then unused)",
    )
    p.add_argument("--kvtier-arg", action="append", default=[], help="extra `kvtier serve` argument (repeat)")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="another checkout (e.g. a git worktree of the commit before a change): its "
        "`kvtier serve` runs too, as `served-base` (none: only this tree's)",
    )
    p.add_argument(
        "--stand-in",
        default="",
        metavar="BUILD_MS,COMPUTE_MS",
        help="replace the batch kernel, here and in the servers, by tools/bench/"
        "batch_step_cost.py's stand-in: each step holds the GIL BUILD_MS (Python building "
        "the graph), then sleeps COMPUTE_MS without it (the device computing), e.g. 3,17 "
        "for an H200-like step; wall per step minus their sum is the path's own cost "
        "(empty: the real kernel)",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="with --stand-in: the `served` server's interpreter switch interval in ms "
        "(sys.setswitchinterval; 0: Python's 5 ms), e.g. against --baseline-tree . of the same code",
    )
    p.add_argument("--ssd", action="store_true",
                   help="the servers with the SSD tier on (each in its own directory; the in-process "
                        "Engine stays without it): write-behind's background steps under load")
    p.add_argument("--chat", action="store_true",
                   help="also the same prompts as chat requests to the same server (served-chat), "
                        "the request format guidellm's load uses")
    p.add_argument("--json", type=Path, default=None, help="write the records here (none: not written)")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
