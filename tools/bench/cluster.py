"""Replicas behind routers on a tool-agent trace: round-robin vs cache_aware vs KV events.

    python tools/bench/cluster.py --replicas 2 --concurrency 4 --out /tmp/cluster

The trace: ``--conversations`` agent conversations over one shared system
prompt (tool descriptions, ``--system-tokens``); each turn appends a tool
result (``--turn-tokens``) and the assistant's scripted reply, so every
prompt is the previous one plus new tokens (a growing prefix). The
replies are part of the trace (not the model's output), so the same trace
replays identically under every policy. ``--concurrency`` agents run at
once, each taking the next conversation and running its turns in order
(closed loop). With ``--arrival-rate R`` (open loop) conversation ``c``
starts at its time in a seeded Poisson schedule of ``R`` conversations a
second (:func:`arrival_times`, the same for every policy), whatever the
earlier ones are doing, and runs its turns in order; ``--concurrency`` is
then not used, and the concurrency measured (requests and conversations
in flight, time-weighted mean and max) is in each policy's summary.
``--arrival-rate-fraction F`` sets that rate from the replicas themselves:
first a closed-loop replay behind round-robin with no tool time
(``--capacity-agents`` agents, ``--capacity-conversations`` conversations,
a system prompt of its own) measures round-robin's capacity in
conversations a second (:func:`capacity_rate`), and the open loop then
arrives at ``F`` times it, as a constant-rate load is set from a server's
measured saturation. A fixed rate sits at a different share of
round-robin's capacity on each lent host, and the open loop's ratio
follows that share.

One set of replicas (``tools/cluster/launch.py``'s :class:`Cluster`)
serves every policy in turn, in one run: ``single`` (every request straight
to replica 0: the single-process reference), then each router of
``--policies``; each policy gets its own system-prompt nonce, so no policy
finds another's prefixes cached. Per policy: TTFT p50/p99 (streamed, to the
first content chunk), cached-token share (sum of
``usage.prompt_tokens_details.cached_tokens`` / sum of ``prompt_tokens``),
throughput (requests and prompt tokens per second of wall time), load
spread (requests per replica, from each replica's ``/stats``), and the
router's overhead (:func:`measure_overhead`: the same cheap requests direct
to a replica and through the router, paired, p50/p90 of the difference),
and the host's speed probe before and after each replay (``host_loop_s``:
the policies run one after another on a host whose speed can move).
Writes ``cluster.json`` and ``cluster.png`` under ``--out``.

    python tools/bench/cluster.py --overhead --overhead-n 1000 --out /tmp/cluster

measures only the routers' overhead (no trace) and writes ``overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import re
import signal
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import httpx  # noqa: E402

from tools.cluster.launch import Cluster  # noqa: E402

_TOOLS = ["search_docs", "read_file", "run_tests", "grep_repo", "open_ticket", "list_dir"]
_WORDS = ["policy", "ledger", "archive", "river", "lantern", "copper", "orchard", "signal",
          "harbor", "meadow", "quartz", "timber", "violet", "summit", "canyon", "beacon"]


def _filler(n_words: int, seed: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 5 + i // 13) % len(_WORDS)] for i in range(n_words))


def system_prompt(tokens: int, nonce: str) -> str:
    """The shared system prompt: an agent's tool descriptions, about ``tokens`` tokens."""
    lines = [f"Run {nonce}. You are a coding agent. Call one tool per turn. Tools:"]
    per_tool = max(4, int(tokens / 1.3 / len(_TOOLS)))
    lines += [f"- {t}: {_filler(per_tool, k)}." for k, t in enumerate(_TOOLS)]
    return "\n".join(lines)


def tool_result_tokens(conv: int, turn: int, mean: int) -> int:
    """The size of turn ``turn``'s tool result: seeded, skewed, ``mean`` tokens on average.

    NOTE: agents' tool outputs are mostly short (a status, a grep hit, a test
    summary) with an occasional long one (a file read): a log-normal with
    sigma 0.8, scaled to ``mean``, clipped to 8 .. 6 x ``mean`` tokens.
    Seeded by (conversation, turn), so every policy replays the same sizes.
    """
    import random

    draw = random.Random(conv * 1_000_003 + turn).lognormvariate(0.0, 0.8) / math.exp(0.32)
    return int(min(6 * mean, max(8, round(mean * draw))))


def tool_result(conv: int, turn: int, tokens: int) -> str:
    """The tool result a turn appends (distinct per conversation and turn, ~``tokens`` on average)."""
    size = tool_result_tokens(conv, turn, tokens)
    return f"Result of step {turn} for task {conv}: " + _filler(int(size / 1.3), conv * 31 + turn)


def tool_seconds(conv: int, turn: int, mean: float) -> float:
    """The agent's tool run after turn ``turn``'s answer: seeded exponential, ``mean`` seconds."""
    import random

    if mean <= 0:
        return 0.0
    return random.Random(conv * 7_919 + turn * 104_729 + 1).expovariate(1.0 / mean)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s) of ``n`` conversations arriving at ``rate`` a second: a seeded Poisson schedule.

    The first at 0, then exponential gaps of mean ``1 / rate`` drawn from
    ``random.Random(seed)``, so every policy replays the same schedule.
    """
    import random

    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0, not {rate}")
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times[:n]


def in_flight(intervals: list[tuple[float, float]], span: float) -> tuple[float, int]:
    """How many of ``intervals`` (start, end) are open at once: the mean over ``span`` s, and the max.

    The mean is time-weighted (the summed lengths over ``span``); an interval
    ending when another starts does not overlap it.
    """
    area = sum(end - start for start, end in intervals)
    # NOTE: at equal times the ends (-1) sort before the starts (+1).
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return (area / span if span > 0 else 0.0), peak


def reply(conv: int, turn: int) -> str:
    """The scripted assistant reply of a turn (a tool call)."""
    return f'{{"tool": "{_TOOLS[(conv + turn) % len(_TOOLS)]}", "args": {{"step": {turn + 1}}}}}'


@dataclass
class Sample:
    """One request of the trace."""

    policy: str
    conv: int
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: int | None
    ended: float
    error: str | None = None
    """Why the answer failed (an error event in its stream, or no usage): not counted in the figures."""
    round: int = 0
    """The replay (``--rounds``) it belongs to: ``ended`` counts from that replay's start."""


async def _chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                max_tokens: int) -> tuple[float, float, dict[str, Any], str | None, str | None]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    error: str | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        replica = resp.headers.get("x-kvtier-replica")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("error"):
                # NOTE: a failure after the 200 (an engine error) comes as an error event.
                error = str(obj["error"].get("code") or obj["error"].get("message") or obj["error"])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if first is None and (ch.get("delta") or {}).get("content"):
                    first = time.perf_counter() - start
    total = time.perf_counter() - start
    if error is None and not usage:
        error = "no usage in the stream"
    return (first if first is not None else total), total, usage, replica, error


async def replay_trace(url: str, policy: str, args: argparse.Namespace,
                       rnd: int = 0) -> tuple[list[Sample], float]:
    """Run the trace against ``url``; the samples and the wall time.

    Closed loop (``args.arrival_rate`` 0): ``args.concurrency`` agents, each
    taking the next conversation when its last one ends. Open loop: each
    conversation starts at its :func:`arrival_times` time.
    """
    # NOTE: twelve digits, one token each, for every policy: a nonce holding
    # the policy's name made the prompts of "events" 2 tokens shorter than
    # those of "cache_aware", and the cached shares differ by that.
    nonce = f"{zlib.crc32(policy.encode()) % 10**6:06d}{time.time_ns() % 10**6:06d}"
    system = system_prompt(args.system_tokens, nonce)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(args.conversations):
        queue.put_nowait(c)
    samples: list[Sample] = []
    t0 = time.perf_counter()

    async def conversation(client: httpx.AsyncClient, conv: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            messages.append({"role": "user",
                             "content": tool_result(conv, turn, args.turn_tokens)})
            ttft, total, usage, rep, error = await _chat(client, url, messages, args.max_tokens)
            details = usage.get("prompt_tokens_details") or {}
            samples.append(Sample(policy, conv, turn, ttft, total,
                                  int(usage.get("prompt_tokens", 0)),
                                  int(details.get("cached_tokens") or 0),
                                  int(rep) if rep is not None else None,
                                  time.perf_counter() - t0, error, rnd))
            messages.append({"role": "assistant", "content": reply(conv, turn)})
            if turn + 1 < args.turns:
                await asyncio.sleep(tool_seconds(conv, turn, args.tool_s))

    async def agent(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await conversation(client, queue.get_nowait())

    async def arrival(client: httpx.AsyncClient, conv: int, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        await conversation(client, conv)

    rate = getattr(args, "arrival_rate", 0.0)
    # NOTE: no cap on connections in the open loop: a request waiting for a
    # pooled connection would queue in this client, not at the replicas.
    limits = httpx.Limits(max_connections=None if rate > 0 else 100, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
        if rate > 0:
            starts = arrival_times(args.conversations, rate, args.arrival_seed)
            await asyncio.gather(*(arrival(client, c, at) for c, at in enumerate(starts)))
        else:
            await asyncio.gather(*(agent(client) for _ in range(args.concurrency)))
    return samples, time.perf_counter() - t0


def _replay_once(url: str, policy: str, args: argparse.Namespace,
                 rnd: int) -> tuple[list[Sample], float]:
    """:func:`replay_trace` run to its end (its coroutine made here, after the first probe)."""
    return asyncio.run(replay_trace(url, policy, args, rnd))


def probed_replay(replay: Callable[[], tuple[list[Sample], float]],
                  probe: Callable[[], float] | None = None,
                  ) -> tuple[list[Sample], float, list[float]]:
    """One policy's replay with the host's speed probe (``_common.host_loop``) before and after it.

    NOTE: the replicas' step time on a lent host moves with the host's
    single-thread speed (1.6 x within one call, docs/benchmarks.md 2026-12-07
    08:58), and the policies replay one after another: ``cache_aware``'s p50
    moved 0.625 -> 0.792 s between two calls of the same code. The probe
    beside each replay says which policy ran on a slower host.
    """
    if probe is None:
        from tools.bench._common import host_loop
        probe = host_loop
    before = probe()
    samples, wall = replay()
    return samples, wall, [before, probe()]


def capacity_rate(samples: list[Sample], wall: float, turns: int, fraction: float) -> dict[str, float]:
    """Round-robin's capacity from a closed-loop replay, and the open loop's rate at ``fraction`` of it.

    Capacity is the answered requests a second over the replay's wall time
    (the throughput at the replay's agents: with no tool time every replica
    always has work; more agents may still add some);
    a conversation is ``turns`` requests, so the rate in conversations a
    second is that over ``turns``. A replay with failed answers measures
    no capacity: :class:`ValueError`.
    """
    if not fraction > 0:
        raise ValueError(f"the arrival-rate fraction must be > 0, not {fraction}")
    failed = [s for s in samples if s.error is not None]
    if failed or not samples or wall <= 0:
        raise ValueError(f"the capacity replay answered {len(samples) - len(failed)} of "
                         f"{len(samples)} requests in {wall:.1f} s: no capacity measured")
    requests_per_s = len(samples) / wall
    conversations_per_s = requests_per_s / turns
    return {"requests_per_s": requests_per_s, "conversations_per_s": conversations_per_s,
            "fraction": fraction, "arrival_rate": fraction * conversations_per_s}


def _served(url: str) -> int:
    """Requests a replica admitted so far (serial lane + batch lane), from its /stats."""
    eng = httpx.get(f"{url}/stats", timeout=30).json()["engine"]
    serial = eng["gateway"]["token"]["requests"]["admitted"]
    batch = eng.get("batch", {}).get("batch", {}).get("requests", {}).get("admitted", 0)
    return int(serial) + int(batch)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def summarize(samples: list[Sample], wall: float, spread: list[int]) -> dict[str, Any]:
    """TTFT p50/p99, cached-token share, throughput and load spread of one policy.

    NOTE: failed answers (``errors``) are left out of every figure: a run with
    errors is not a result (``main`` exits 1).
    """
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft_s for s in ok]
    flight = measured_concurrency(samples, wall)
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    mean = statistics.mean(spread) if spread else 0.0
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "ttft_p50_s": _pct(ttft, 0.50),
        "ttft_p90_s": _pct(ttft, 0.90),
        "ttft_p99_s": _pct(ttft, 0.99),
        "ttft_mean_s": statistics.mean(ttft) if ttft else float("nan"),
        "cached_share": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "wall_s": wall,
        "requests_per_s": len(samples) / wall,
        "prompt_tokens_per_s": prompt / wall,
        "per_replica": spread,
        "max_over_mean": (max(spread) / mean) if mean else None,
        **flight,
    }


def measured_concurrency(samples: list[Sample], wall: float) -> dict[str, float]:
    """Requests and conversations in flight: the time-weighted mean over ``wall`` and the max.

    A request is in flight from its send (``ended - total_s``) to its end, a
    conversation from its first request's send to its last request's end
    (tool time included). ``wall`` is the replays' summed wall time; each
    replay (``Sample.round``) counts on its own clock.
    """
    out: dict[str, float] = {"requests_in_flight_mean": 0.0, "requests_in_flight_max": 0,
                             "conversations_in_flight_mean": 0.0, "conversations_in_flight_max": 0}
    for rnd in sorted({s.round for s in samples}):
        mine = [s for s in samples if s.round == rnd]
        reqs = [(s.ended - s.total_s, s.ended) for s in mine]
        convs: dict[int, tuple[float, float]] = {}
        for s, (start, end) in zip(mine, reqs, strict=True):
            first, last = convs.get(s.conv, (start, end))
            convs[s.conv] = (min(first, start), max(last, end))
        for name, intervals in (("requests", reqs), ("conversations", list(convs.values()))):
            mean, peak = in_flight(intervals, wall)
            out[f"{name}_in_flight_mean"] += mean
            out[f"{name}_in_flight_max"] = max(out[f"{name}_in_flight_max"], peak)
    return out


def ideal_share(args: argparse.Namespace) -> dict[str, float]:
    """The trace's prefix share, counted with the model's tokenizer and chat template.

    ``share``: of all prompt tokens (what kvtier prefills), those that
    repeat the longest common token prefix with a prompt sent before
    anywhere in the trace, i.e. what one process with an unbounded prompt
    cache would find cached. A first turn repeats the shared system prompt
    (after the first conversation), a later turn its conversation's
    previous prompt. ``follow_up_share``: the same over turns after the
    first only (a call inside a running agent loop); ``first_share`` over
    first turns only.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kernels import default_model_dir, render_chat, resolve_model_path

    tok = load_tokenizer(default_model_dir() if args.model is None else resolve_model_path(args.model))
    system = system_prompt(args.system_tokens, "ideal")
    rep = {"first": 0, "follow": 0}
    tot = {"first": 0, "follow": 0}
    first: list[int] = []
    for conv in range(args.conversations):
        messages = [{"role": "system", "content": system}]
        prev: list[int] = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": tool_result(conv, turn, args.turn_tokens)})
            ids = render_chat(tok, messages)
            kind = "first" if turn == 0 else "follow"
            if turn == 0:
                if conv == 0:
                    first = ids
                else:
                    rep[kind] += _common(first, ids)
            else:
                rep[kind] += _common(prev, ids)
            tot[kind] += len(ids)
            prev = ids
            messages.append({"role": "assistant", "content": reply(conv, turn)})
    return {"share": (rep["first"] + rep["follow"]) / (tot["first"] + tot["follow"]),
            "first_share": rep["first"] / tot["first"] if tot["first"] else 0.0,
            "follow_up_share": rep["follow"] / tot["follow"] if tot["follow"] else 0.0,
            "prompt_tokens": float(tot["first"] + tot["follow"]),
            "mean_prompt_tokens": (tot["first"] + tot["follow"]) / (args.conversations * args.turns)}


# NOTE: n=2 passes sglang-router's own request checks (it parses the body
# into its typed request and runs the policy on it) and kvtier rejects it
# in its request validation, before any tokenizing or model work: the
# cheapest request that takes a router's whole chat path to a replica.
# NOTE: a logit_bias key that is not a token id: sglang-router forwards it (its
# typed request takes any string key) and kvtier refuses it in validation.
_REJECTED_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 1, "logit_bias": {"x": 1}}
_ONE_TOKEN = {"model": "default", "prompt": "hi", "max_tokens": 1, "temperature": 0}


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def prefill_work(args: argparse.Namespace, turns: int, replicas: int) -> dict[str, float]:
    """Tokens each placement must prefill for the trace with ``turns`` turns (no model run).

    Replays the trace's arrival order (``--concurrency`` conversations at a
    time, their turns interleaved) through a model of the replicas' prompt
    caches (a replica reuses the longest prefix of any prompt it served
    before), with the model's tokenizer and chat template: ``affinity``
    keeps a conversation on one replica and spreads conversations in turn
    (the event router's placement), ``round_robin`` sends request ``k`` to
    replica ``k % replicas`` with the requests of each round of turns in a
    random order (completion order varies; in a fixed order round-robin
    would keep every conversation on one replica by accident), averaged
    over 16 seeds. The ratio of the two is round-robin's extra prefill, the
    most TTFT can gain from placement when queueing does not dominate.
    """
    import random

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kernels import default_model_dir, render_chat, resolve_model_path

    tok = load_tokenizer(default_model_dir() if args.model is None else resolve_model_path(args.model))
    system = system_prompt(args.system_tokens, "sim")
    rounds: list[list[tuple[int, int]]] = []
    for wave in range(0, args.conversations, args.concurrency):
        convs = range(wave, min(wave + args.concurrency, args.conversations))
        rounds += [[(c, t) for c in convs] for t in range(turns)]
    prompts: dict[tuple[int, int], list[int]] = {}
    for conv in range(args.conversations):
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            messages.append({"role": "user", "content": tool_result(conv, turn, args.turn_tokens)})
            prompts[conv, turn] = render_chat(tok, messages)
            messages.append({"role": "assistant", "content": reply(conv, turn)})
    out: dict[str, float] = {"prompt_tokens": float(sum(len(v) for v in prompts.values()))}
    seeds = 16
    for name in ("affinity", "round_robin"):
        total = 0
        each: list[float] = []
        for seed in range(seeds):
            rng = random.Random(seed)
            order = [req for r in rounds for req in rng.sample(r, len(r))]
            seen: list[list[list[int]]] = [[] for _ in range(replicas)]
            for k, (conv, turn) in enumerate(order):
                rep = conv % replicas if name == "affinity" else k % replicas
                ids = prompts[conv, turn]
                work = len(ids) - max((_common(ids, old) for old in seen[rep]), default=0)
                total += work
                each.append(float(work))
                seen[rep].append(ids)
        out[name] = total / seeds
        out[f"{name}_p50"] = _pct(each, 0.5)
    out["ratio"] = out["round_robin"] / out["affinity"]
    out["ratio_p50"] = out["round_robin_p50"] / out["affinity_p50"]
    return out


async def _timed(client: httpx.AsyncClient, kind: str, base: str) -> float:
    """Seconds for one request of ``kind`` to ``base``; checks that a replica answered it."""
    t = time.perf_counter()
    if kind == "chat_rejected":
        resp = await client.post(f"{base}/v1/chat/completions", json=_REJECTED_CHAT)
        took = time.perf_counter() - t
        if resp.status_code != 400 or "logit_bias keys must be token ids" not in resp.text:
            raise RuntimeError(f"not kvtier's rejection: {resp.status_code} {resp.text[:200]}")
    elif kind == "model_info":
        resp = await client.get(f"{base}/get_model_info")
        took = time.perf_counter() - t
        resp.raise_for_status()
    else:
        resp = await client.post(f"{base}/v1/completions", json=_ONE_TOKEN)
        took = time.perf_counter() - t
        resp.raise_for_status()
    return took


async def measure_overhead(direct: list[str], routed: str, n: int) -> dict[str, Any]:
    """The router's added latency: paired requests direct to a replica and through the router.

    Kinds: ``chat_rejected`` (a chat request kvtier rejects in validation:
    the router's whole chat path, policy included, with no model work),
    ``model_info`` (``GET /get_model_info``, forwarded as is) and, every
    tenth pair, ``one_token`` (a one-token completion of a one-token
    prompt). Per kind: p50/p90 of each side and of the per-pair difference
    (router minus direct), in ms.

    NOTE: each pair's two requests run back to back, in alternating order,
    the direct one to the replicas in turn, so load changes on the shared
    machine hit both sides alike and the difference's median cancels them;
    20 warm-up pairs are dropped.
    """
    kinds = ("chat_rejected", "model_info", "one_token")
    lat: dict[str, dict[str, list[float]]] = {
        k: {"direct": [], "router": [], "diff": []} for k in kinds}
    async with httpx.AsyncClient(timeout=60) as client:
        for k in range(-20, n):
            for kind in kinds:
                if kind == "one_token" and k % 10:
                    continue
                base = direct[k % len(direct)]
                if k % 2:
                    d = await _timed(client, kind, base)
                    r = await _timed(client, kind, routed)
                else:
                    r = await _timed(client, kind, routed)
                    d = await _timed(client, kind, base)
                if k >= 0:
                    lat[kind]["direct"].append(d)
                    lat[kind]["router"].append(r)
                    lat[kind]["diff"].append(r - d)
    out: dict[str, Any] = {"pairs": n}
    for kind, sides in lat.items():
        out[kind] = {f"{side}_{q}_ms": _pct(v, float(q[1:]) / 100) * 1000
                     for side, v in sides.items() for q in ("p50", "p90")}
        out[kind]["n"] = len(sides["diff"])
    return out


def loop_mode(trace: dict[str, Any]) -> str:
    """The trace's driving, in words: closed loop (its agents) or open loop (its arrival rate)."""
    rate = float(trace.get("arrival_rate") or 0.0)
    if rate > 0:
        return (f"open loop, {rate:g} conversations/s (seed {trace.get('arrival_seed', 0)}, "
                f"{trace['conversations']} conversations)")
    return f"closed loop, concurrency {trace['concurrency']}"


def _in_flight_text(s: dict[str, Any]) -> str:
    return (f"in flight: requests mean {s['requests_in_flight_mean']:.2f} max "
            f"{s['requests_in_flight_max']}, conversations mean "
            f"{s['conversations_in_flight_mean']:.2f} max {s['conversations_in_flight_max']}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Six panels: TTFT p50/p99, TTFT p50 by turn, cached share, throughput, requests per replica."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(result["policies"])
    rows = [result["policies"][p]["summary"] for p in pols]
    fig, ax = plt.subplots(2, 3, figsize=(15, 7))
    x = range(len(pols))
    ax[0][0].bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in rows], 0.4, label="p50")
    ax[0][0].bar([i + 0.2 for i in x], [r["ttft_p99_s"] for r in rows], 0.4, label="p99")
    ax[0][0].set_title("TTFT (s)")
    ax[0][0].legend()
    for p in pols:
        by_turn: dict[int, list[float]] = {}
        for smp in result["policies"][p]["samples"]:
            by_turn.setdefault(int(smp["turn"]), []).append(float(smp["ttft_s"]))
        turns = sorted(by_turn)
        ax[0][1].plot([t + 1 for t in turns], [_pct(by_turn[t], 0.5) for t in turns],
                      marker="o", label=p)
    ax[0][1].set_title("TTFT p50 (s) by turn of the conversation")
    ax[0][1].set_xlabel("turn")
    ax[0][1].legend()
    ax[0][2].bar(x, [r["cached_share"] for r in rows])
    ax[0][2].axhline(result["trace"]["ideal_share"], color="k", ls="--", label="trace prefix share")
    ax[0][2].set_title("cached-token share")
    ax[0][2].legend()
    ax[1][0].bar(x, [r["prompt_tokens_per_s"] for r in rows])
    ax[1][0].set_title("throughput (prompt tokens / s)")
    width = 0.8 / max(1, result["replicas"])
    for k in range(result["replicas"]):
        ax[1][1].bar([i - 0.4 + width * (k + 0.5) for i in x],
                     [r["per_replica"][k] for r in rows], width, label=f"replica {k}")
    ax[1][1].set_title("requests per replica")
    ax[1][1].legend()
    for a in (ax[0][0], ax[0][2], ax[1][0], ax[1][1]):
        a.set_xticks(list(x), pols)
    ax[1][2].axis("off")
    t = result["trace"]
    ax[1][2].text(0.0, 0.95, "\n".join([
        f"{t['conversations']} conversations x {t['turns']} turns, {loop_mode(t)}",
        (f"system {t['system_tokens']} tok, tool result mean {t['turn_tokens']} tok, "
         f"tool time {t.get('tool_s', 0)} s"),
        f"prefix share {t['ideal_share']:.3f} (follow-up turns {t.get('follow_up_share', 0):.3f})",
        "requests in flight, mean / max: " + ", ".join(
            f"{p} {r.get('requests_in_flight_mean', 0):.1f} / {r.get('requests_in_flight_max', 0)}"
            for p, r in zip(pols, rows, strict=True)),
        f"replicas: {result.get('replica_settings', {})}",
        f"load before {result['load_before']}",
    ]), va="top", fontsize=8, wrap=True)
    fig.suptitle(f"{result['replicas']} CPU replicas, {loop_mode(result['trace'])}"
                 f" ({result['machine'].get('cpus', '?')}-core machine, load {result['load_before']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


_ROUND_LINE = re.compile(
    r"^round \d+ (?P<policy>\S+)\s+ttft p50 (?P<p50>[\d.]+)s p99 (?P<p99>[\d.]+)s "
    r"cached (?P<share>[\d.]+) (?P<tps>\d+) tok/s errors (?P<errors>\d+)")


def plot_printout(printout: Path, out: Path) -> int:
    """A run cut before it wrote ``cluster.json``: each policy's printed round lines as bars (``printout.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m.groupdict() for m in map(_ROUND_LINE.match, printout.read_text().splitlines()) if m]
    if not rows:
        print(f"{printout}: no round lines")
        return 1
    # NOTE: a round line is printed for each policy's replay; the last one of a policy counts.
    by_policy = {r["policy"]: r for r in rows}
    pols = list(by_policy)
    x = range(len(pols))
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    ax[0].bar([i - 0.2 for i in x], [float(by_policy[p]["p50"]) for p in pols], 0.4, label="p50")
    ax[0].bar([i + 0.2 for i in x], [float(by_policy[p]["p99"]) for p in pols], 0.4, label="p99")
    ax[0].set_title("TTFT (s)")
    ax[0].legend()
    ax[1].bar(x, [float(by_policy[p]["share"]) for p in pols])
    ax[1].set_title("cached-token share")
    ax[2].bar(x, [float(by_policy[p]["tps"]) for p in pols])
    ax[2].set_title("throughput (prompt tokens / s)")
    for a in ax:
        a.set_xticks(list(x), pols)
    fig.suptitle(f"{printout.name} (errors {sum(int(by_policy[p]['errors']) for p in pols)})")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "printout.png", dpi=100)
    for p in pols:
        r = by_policy[p]
        print(f"{p:12s} ttft p50 {r['p50']} s p99 {r['p99']} s cached {r['share']} {r['tps']} tok/s")
    print(f"plot: {out / 'printout.png'}")
    return 0


def write_result(result: dict[str, Any], out: Path) -> None:
    """``cluster.json`` and ``cluster.png`` in ``out`` (written again as the run adds figures)."""
    (out / "cluster.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "cluster.png")


def overhead_only(args: argparse.Namespace, serve: list[str],
                  balance: tuple[float, float] | None) -> int:
    """``--overhead``: each router of ``--policies`` in front of the replicas, overhead only."""
    from tools.bench._common import loadavg, machine

    result: dict[str, Any] = {"machine": machine(), "load_before": loadavg(),
                              "replicas": args.replicas, "routers": {}}
    with Cluster(args.replicas, args.out / "work", serve, policy=None, threads=args.threads,
                 pin=args.pin, balance=balance, keep_ssd=args.keep_ssd) as cluster:
        urls = [r.url for r in cluster.replicas]
        for policy in args.policies.split(","):
            if policy == "single":
                continue
            target = cluster.route(policy).url
            entry = asyncio.run(measure_overhead(urls, target, args.overhead_n))
            entry["load_after"] = loadavg()
            if policy.startswith("events"):
                entry["router_stats"] = httpx.get(f"{target}/event_router/stats", timeout=10).json()
            result["routers"][policy] = entry
            print(policy, json.dumps({k: v for k, v in entry.items() if k != "router_stats"}),
                  flush=True)
        result["exit_codes"] = cluster.stop()
    result["load_after"] = loadavg()
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'overhead.json'}")
    return 0


def measure_capacity(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Round-robin's capacity behind ``url`` (:func:`capacity_rate` of a closed-loop replay), printed.

    NOTE: the replay runs as its own policy name ("capacity"), so its system
    prompt is its own and no measured policy finds its prefixes cached; no
    tool time, so the agents keep the replicas busy.
    """
    agents = args.capacity_agents or 2 * args.replicas
    run = argparse.Namespace(**{**vars(args), "arrival_rate": 0.0, "tool_s": 0.0, "concurrency": agents,
                                "conversations": args.capacity_conversations or 2 * agents})
    samples, wall, probes = probed_replay(functools.partial(_replay_once, url, "capacity", run, 0))
    out: dict[str, Any] = {**capacity_rate(samples, wall, args.turns, args.arrival_rate_fraction),
                           "agents": agents, "conversations": run.conversations, "wall_s": wall,
                           "ttft_p50_s": _pct([x.ttft_s for x in samples], 0.5), "host_loop_s": probes}
    print(f"capacity (round-robin, closed loop, {agents} agents, {run.conversations} conversations, "
          f"no tool time): {out['requests_per_s']:.2f} requests/s = {out['conversations_per_s']:.3f} "
          f"conversations/s in {wall:.0f} s (TTFT p50 {out['ttft_p50_s']:.3f}s); open loop at "
          f"{args.arrival_rate_fraction:g} x = {out['arrival_rate']:.3f} conversations/s", flush=True)
    return out


def main() -> int:
    """Start the replicas, replay the trace per policy, write JSON and PNG."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4,
                   help="agents at once, each running conversations back to back (closed loop; "
                        "default 4); not used with --arrival-rate")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=10, help="calls per agent conversation (default 10)")
    p.add_argument("--system-tokens", type=int, default=256,
                   help="the shared system prompt (tool descriptions), tokens (default 256)")
    p.add_argument("--turn-tokens", type=int, default=48,
                   help="mean tool-result tokens a turn appends (skewed; default 48)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tool-s", type=float, default=0.0,
                   help="mean seconds an agent runs its tool between an answer and its next call "
                        "(seeded exponential; default 0: the next call at once)")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="open loop: conversations a second, each starting at its time in a seeded "
                        "Poisson schedule whatever the earlier ones are doing (--concurrency not "
                        "used; the measured concurrency is reported); default 0: closed loop")
    p.add_argument("--arrival-rate-fraction", type=float, default=0.0,
                   help="open loop at this fraction of round-robin's capacity, measured first by "
                        "a closed-loop replay with no tool time (see --capacity-agents); "
                        "instead of --arrival-rate")
    p.add_argument("--capacity-agents", type=int, default=0,
                   help="agents of the capacity replay (default: 2 a replica)")
    p.add_argument("--capacity-conversations", type=int, default=0,
                   help="conversations of the capacity replay (default: 2 an agent)")
    p.add_argument("--arrival-seed", type=int, default=0,
                   help="the seed of --arrival-rate's schedule (the same for every policy; default 0)")
    p.add_argument("--policies", default="round_robin,cache_aware,events",
                   help="comma list of single, round_robin, cache_aware, events, events_prefill "
                        "(the event router's --rule prefill), in the order of "
                        "the first round (default round_robin,cache_aware,events)")
    p.add_argument("--rounds", type=int, default=1,
                   help="replay the trace this many times per policy, the policy order rotated "
                        "each round (interleaved; default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads per replica (default: the library's, one per core)")
    p.add_argument("--pin", action="store_true",
                   help="pin each replica to its share of the cores (tools/cluster/launch.py)")
    p.add_argument("--balance-abs-threshold", type=float, default=None,
                   help="sglang-router's balance rule, given to cache_aware and events alike "
                        "(default: theirs, 64)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument("--overhead-n", type=int, default=200,
                   help="request pairs (direct, routed) per router for its overhead (default 200; "
                        "0: not measured)")
    p.add_argument("--simulate", default="",
                   help="comma-separated turn counts: print the prefill tokens of affinity and "
                        "round-robin placement for each (tokenizer only, no replicas) and exit")
    p.add_argument("--overhead", action="store_true",
                   help="measure only each router's overhead (no trace); writes overhead.json")
    p.add_argument("--from-printout", type=Path, default=None,
                   help="no run: plot the per-policy lines of a cut run's printout into --out")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=Path("/tmp/kvtier-bench-cluster"))
    p.add_argument("--serve-args", default="", help="extra kvtier serve arguments (one string)")
    p.add_argument("--keep-ssd", action="store_true",
                   help="keep the replicas' SSD directories under --out/work after the run (default: "
                        "removed once the replicas exit; 7-20 GB a run)")
    args = p.parse_args()
    if args.arrival_rate and args.arrival_rate_fraction:
        p.error("--arrival-rate and --arrival-rate-fraction: one or the other")
    if args.arrival_rate_fraction < 0:
        # NOTE: refused here, not after the capacity replay it would have run.
        p.error(f"--arrival-rate-fraction must be > 0, not {args.arrival_rate_fraction}")
    # NOTE: SIGTERM unwinds like an exception, so the Cluster stops its children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    from tools.bench._common import loadavg, machine

    serve = args.serve_args.split() + (["--model", args.model] if args.model else [])
    balance = (None if args.balance_abs_threshold is None
               else (args.balance_abs_threshold, args.balance_rel_threshold))
    if args.from_printout is not None:
        return plot_printout(args.from_printout, args.out)
    if args.overhead:
        return overhead_only(args, serve, balance)
    if args.simulate:
        for turns in (int(t) for t in args.simulate.split(",")):
            w = prefill_work(args, turns, args.replicas)
            print(f"turns {turns:3d} replicas {args.replicas}: prompt {w['prompt_tokens']:.0f} "
                  f"prefill affinity {w['affinity']:.0f} round_robin {w['round_robin']:.0f} "
                  f"ratio {w['ratio']:.2f}; per request p50 {w['affinity_p50']:.0f} vs "
                  f"{w['round_robin_p50']:.0f}: {w['ratio_p50']:.2f}", flush=True)
        return 0
    result: dict[str, Any] = {
        "machine": machine(), "load_before": loadavg(), "replicas": args.replicas,
        "trace": {k: getattr(args, k) for k in ("conversations", "turns", "system_tokens",
                                                  "turn_tokens", "max_tokens", "concurrency",
                                                  "tool_s", "arrival_rate", "arrival_seed")},
        "replica_settings": {"threads": args.threads, "pin": args.pin,
                             "serve_args": serve, "balance": balance},
        "rounds": args.rounds, "policies": {},
    }
    share = ideal_share(args)
    result["trace"].update({"ideal_share": share["share"], "first_share": share["first_share"],
                            "follow_up_share": share["follow_up_share"],
                            "mean_prompt_tokens": share["mean_prompt_tokens"]})
    print(f"trace prefix share {share['share']:.3f} (first turns {share['first_share']:.3f}, "
          f"follow-up turns {share['follow_up_share']:.3f}; mean prompt "
          f"{share['mean_prompt_tokens']:.0f} tokens)", flush=True)
    if not args.arrival_rate_fraction:
        print(loop_mode(result["trace"]), flush=True)
    order = args.policies.split(",")
    gathered: dict[str, dict[str, Any]] = {
        p: {"samples": [], "wall": 0.0, "spread": [0] * args.replicas, "loads": [],
            "router_stats": [], "host_loop_s": []} for p in order}
    with Cluster(args.replicas, args.out / "work", serve, policy=None, threads=args.threads,
                 pin=args.pin, balance=balance, keep_ssd=args.keep_ssd) as cluster:
        urls = [r.url for r in cluster.replicas]
        result["replica_cpus"] = [sorted(os.sched_getaffinity(r.proc.pid))
                                  for r in cluster.replicas]
        if args.arrival_rate_fraction:
            result["capacity"] = measure_capacity(cluster.route("round_robin").url, args)
            args.arrival_rate = result["trace"]["arrival_rate"] = result["capacity"]["arrival_rate"]
            print(loop_mode(result["trace"]), flush=True)
        for rnd in range(args.rounds):
            for policy in order[rnd % len(order):] + order[:rnd % len(order)]:
                target = urls[0] if policy == "single" else cluster.route(policy).url
                before = [_served(u) for u in urls]
                samples, wall, probes = probed_replay(
                    functools.partial(_replay_once, target, policy, args, rnd))
                g = gathered[policy]
                g["host_loop_s"].append(probes)
                g["samples"] += samples
                g["wall"] += wall
                g["spread"] = [a + _served(u) - b
                               for a, u, b in zip(g["spread"], urls, before, strict=True)]
                g["loads"].append(loadavg())
                if policy.startswith("events"):
                    g["router_stats"].append(
                        httpx.get(f"{target}/event_router/stats", timeout=10).json())
                s = summarize(samples, wall, g["spread"])
                print(f"round {rnd} {policy:12s} ttft p50 {s['ttft_p50_s']:.3f}s "
                      f"p99 {s['ttft_p99_s']:.3f}s cached {s['cached_share']:.3f} "
                      f"{s['prompt_tokens_per_s']:.0f} tok/s errors {s['errors']} load {loadavg()} "
                      f"{_in_flight_text(s)} host loop {probes[0]:.3f}/{probes[1]:.3f}s",
                      flush=True)
        for policy in order:
            g = gathered[policy]
            entry: dict[str, Any] = {"summary": summarize(g["samples"], g["wall"], g["spread"]),
                                     "samples": [asdict(x) for x in g["samples"]],
                                     "load_after": g["loads"], "host_loop_s": g["host_loop_s"]}
            if g["router_stats"]:
                entry["router_stats"] = g["router_stats"]
            result["policies"][policy] = entry
        # NOTE: written once before the overhead pairs too: a run cut by its
        # time limit there keeps the trace's figures and plot.
        write_result(result, args.out)
        for policy in order:
            entry = result["policies"][policy]
            target = urls[0] if policy == "single" else cluster.route(policy).url
            if policy != "single" and args.overhead_n:
                entry["overhead"] = asyncio.run(measure_overhead(urls, target, args.overhead_n))
            s = entry["summary"]
            print(f"{policy:12s} ttft p50 {s['ttft_p50_s']:.3f}s p99 {s['ttft_p99_s']:.3f}s "
                  f"mean {s['ttft_mean_s']:.3f}s cached {s['cached_share']:.3f} "
                  f"{s['prompt_tokens_per_s']:.0f} tok/s errors {s['errors']} spread {s['per_replica']} "
                  f"{_in_flight_text(s)} overhead {entry.get('overhead', {})}", flush=True)
        result["exit_codes"] = cluster.stop()
    result["load_after"] = loadavg()
    write_result(result, args.out)
    print(f"wrote {args.out / 'cluster.json'} and {args.out / 'cluster.png'}")
    if cluster.removed_ssd_bytes:
        print(f"removed the replicas' SSD directories ({cluster.removed_ssd_bytes / 2**30:.1f} GiB; "
              f"--keep-ssd keeps them)", flush=True)
    errors = {p: e["summary"]["errors"] for p, e in result["policies"].items() if e["summary"]["errors"]}
    if errors:
        print(f"FAILED ANSWERS {errors}: not a result (the replicas' logs say why)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
