"""Serving benchmark: ``kvtier serve`` vs ``mlx_lm.server`` through a real load generator.

Both servers load the same model directory and run one at a time on the
same port, with the same arguments where their flags overlap (model, host,
port, prefill chunk; ``--rows`` sets kvtier's ``--max-batch`` and mlx-lm's
``--decode-concurrency`` together). Per round, each server gets, after one
warm-up request:

- **concurrency profile** (guidellm ``concurrent``): ``--concurrency`` levels
  (e.g. 1,4,8,32), synthetic prompts of ``--prompt-tokens`` tokens (counted
  with the model directory's own tokenizer), ``--max-tokens`` new tokens,
  streamed, greedy; ``--requests-per-stream`` x streams requests per level;
- **constant-rate profile** (guidellm ``constant``): requests arrive at
  ``--rate-fractions`` x the peer's saturation rate, where the peer is
  ``mlx_lm.server`` and its saturation is the most requests/s it completed
  at any concurrency level of the first round (or ``--rate`` req/s given);
  ``--rate-seconds`` of arrivals;
- **agent trace** (kvtier's own, ``_common.stream_chat``): ``--agent`` N x M =
  N conversations at once, each M turns in sequence over one long shared
  system prompt (``--system-tokens``), each turn carrying the conversation so
  far; TTFT of turn 1 and of turns 2+.

guidellm drives the two profiles (its JSON per run is kept in ``--out``); it
runs from its own environment (``--guidellm-python``) through
``_guidellm_shim.py``, which strips three vLLM-only request fields that
kvtier's strict request schema refuses (the same bodies go to both servers).
Prompts are seeded by the round, so both servers get the same request set
in a round and no round repeats an earlier one. Every round writes its
figures; the summary gives kvtier / mlx_lm ratios side by side; ``--json``
and ``--plot`` write everything. Versions, commit and machine are recorded.
The JSON is rewritten after every phase (``"complete": false`` until the
end), so a run its caller kills keeps every phase it finished. For kvtier,
each level also gets the medians of its requests' timeline phases (and the
admission's parts) from the server's ``request.timeline`` log lines, printed
as a ``phases p50`` line per level: where that level's time to first token went.

CPU (default model; the figures mean something only as ratios in one run)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/serving.py --concurrency 1,4,8 --max-tokens 64 --agent 4x3

The load generator: ``pip install -e .[bench]`` (guidellm) into an
environment of its own, e.g.
``python3 -m venv ~/.cache/kvtier/loadgen-guidellm && ~/.cache/kvtier/loadgen-guidellm/bin/pip install guidellm==0.8.1``
(the default ``--guidellm-python``). GPU: ``tools/bench/gpu_serving.sh``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_GUIDELLM_PYTHON = Path.home() / ".cache" / "kvtier" / "loadgen-guidellm" / "bin" / "python"
SHIM = HERE / "_guidellm_shim.py"
SERVERS = ("mlx_lm", "kvtier")
PEER = "mlx_lm"
"""The server whose saturation sets the constant rate, and the denominator of every ratio."""



# --- figures -----------------------------------------------------------------------


@dataclass
class Dist:
    """A latency distribution in milliseconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Dist:
        """The distribution of ``values_ms`` (nearest-rank percentiles); zeros when empty."""
        if not values_ms:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        xs = sorted(values_ms)

        def pct(q: float) -> float:
            return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

        return cls(len(xs), statistics.fmean(xs), pct(0.50), pct(0.90), pct(0.99), xs[-1])


@dataclass
class LevelResult:
    """One guidellm sub-benchmark (a concurrency level or a constant rate) on one server."""

    profile: str
    """``concurrent`` or ``constant``."""
    level: float
    """Streams (concurrent) or requests per second (constant)."""
    ok: int
    errored: int
    incomplete: int
    seconds: float
    """First request sent -> last successful request done."""
    output_tokens: int
    output_tps: float
    """Output tokens of the successful requests per second of ``seconds``."""
    requests_per_s: float
    ttft_ms: Dist
    itl_ms: Dist
    latency_ms: Dist
    prompt_tokens_p50: float
    output_tokens_p50: float
    first_start: float = 0.0
    """The level's first request sent (epoch seconds, the load generator's clock)."""
    last_end: float = 0.0
    """The level's last request ended, whatever its outcome (epoch seconds)."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """kvtier's timeline phases over the level's requests, median of each (``level_phases``)."""
    timed: int = 0
    """How many of kvtier's ``request.timeline`` lines fell in the level's window."""
    join_steps: dict[str, float] = field(default_factory=dict)
    """kvtier's batch steps that joined rows in the level's window (``level_phases``): ``count``,
    ``step_ms_p50``, ``step_ms_max``, ``prefill_tokens_p50``, ``rows_p50`` and ``share``, their
    summed step time over the window's: what the level's decoding rows waited on joins."""
    scheduler: dict[str, int] = field(default_factory=dict)
    """The load generator's own request counts (created, processed, successful, errored,
    cancelled), to hold against the records: a request it sent but did not record shows here."""


def level_results(report: dict[str, Any]) -> list[LevelResult]:
    """The figures of every sub-benchmark in one guidellm JSON report, from its per-request records."""
    out: list[LevelResult] = []
    for bench in report["benchmarks"]:
        strategy = bench["config"]["strategy"]
        kind = str(strategy["type_"])
        level = float(strategy["streams"] if kind == "concurrent" else strategy.get("rate", 0.0))
        reqs = bench["requests"]
        ok = reqs.get("successful") or []
        every = [r for k in ("successful", "errored", "incomplete") for r in reqs.get(k) or []]
        sent = [float(r["request_start_time"]) for r in every if r.get("request_start_time")]
        done = [float(r["request_end_time"]) for r in every if r.get("request_end_time")]
        starts = [float(r["request_start_time"]) for r in ok]
        ends = [float(r["request_end_time"]) for r in ok]
        seconds = max(ends) - min(starts) if ok else 0.0
        tokens = sum(int(r.get("output_tokens") or 0) for r in ok)

        def ms(key: str, rs: list[dict[str, Any]] = ok) -> list[float]:
            return [float(r[key]) for r in rs if r.get(key) is not None]

        out.append(
            LevelResult(
                profile=kind,
                level=level,
                ok=len(ok),
                errored=len(reqs.get("errored") or []),
                incomplete=len(reqs.get("incomplete") or []),
                seconds=seconds,
                output_tokens=tokens,
                output_tps=tokens / seconds if seconds > 0 else 0.0,
                requests_per_s=len(ok) / seconds if seconds > 0 else 0.0,
                ttft_ms=Dist.of(ms("time_to_first_token_ms")),
                itl_ms=Dist.of(ms("inter_token_latency_ms")),
                latency_ms=Dist.of([1000.0 * x for x in ms("request_latency")]),
                prompt_tokens_p50=statistics.median(ms("prompt_tokens")) if ok else 0.0,
                output_tokens_p50=statistics.median(ms("output_tokens")) if ok else 0.0,
                first_start=min(sent, default=0.0),
                last_end=max(done, default=0.0),
                scheduler=_scheduler_counts(bench),
            )
        )
    return out


_SCHEDULER_COUNTS = ("created", "processed", "successful", "errored", "cancelled")


def _scheduler_counts(bench: dict[str, Any]) -> dict[str, int]:
    """guidellm's scheduler totals of one sub-benchmark (``{}`` where the report has none)."""
    state = bench.get("scheduler_state")
    if not isinstance(state, dict):
        return {}
    return {k: int(state[f"{k}_requests"]) for k in _SCHEDULER_COUNTS
            if isinstance(state.get(f"{k}_requests"), int)}


_LEVEL_SLACK_S = 1.0
"""How long after a level's last request ended its requests' timeline lines may be logged."""


def level_phases(levels: Sequence[LevelResult], logs: Sequence[Path]) -> None:
    """Give each level the median of every timeline phase (and admission part) of its requests.

    NOTE: the load generator names no request, so a ``request.timeline``
    line (logged when its stream closes) belongs to the level whose window,
    its first request sent to its last ended, holds the line's time; the
    levels run one after another, and both clocks are this machine's.
    """
    lines = [(f["_time"], row) for f in log_events(logs, "request.timeline")
             if isinstance(f.get("_time"), float) and (row := _timeline_row(f)) is not None]
    steps = [(f["_time"], figures) for f in log_events(logs, "batch.join_step")
             if isinstance(f.get("_time"), float) and (figures := _join_step_figures(f)) is not None]
    for lv in levels:
        if lv.last_end <= 0.0:
            continue
        rows = [row for at, row in lines if lv.first_start <= at <= lv.last_end + _LEVEL_SLACK_S]
        lv.timed = len(rows)
        keys = [k for row in rows for k in row]
        lv.phases_ms = {k: statistics.median(r[k] for r in rows if k in r) for k in dict.fromkeys(keys)}
        lv.join_steps = _join_step_share(steps, lv.first_start, lv.last_end)


def _join_step_share(steps: Sequence[tuple[float, dict[str, float]]], start: float,
                     end: float) -> dict[str, float]:
    """The join steps logged in ``start..end`` (epoch seconds): count, medians, and their summed
    step time as a share of the window (``{}`` where none fell in it)."""
    inside = [s for at, s in steps if start <= at <= end and "step_ms" in s]
    if not inside or end <= start:
        return {}
    ms = [s["step_ms"] for s in inside]
    return {"count": float(len(inside)), "step_ms_p50": statistics.median(ms), "step_ms_max": max(ms),
            "prefill_tokens_p50": statistics.median(s.get("prefill_tokens", 0.0) for s in inside),
            "rows_p50": statistics.median(s["rows"] for s in inside),
            "share": sum(ms) / ((end - start) * 1e3)}


def print_level_phases(who: str, rnd: int, levels: Sequence[LevelResult]) -> None:
    """Per level: the median of each of kvtier's timeline phases over its requests."""
    for lv in levels:
        if lv.phases_ms:
            print(f"{_level_label(who, rnd, lv)} phases p50: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in lv.phases_ms.items())
                  + f" ({lv.timed}/{lv.ok + lv.errored + lv.incomplete} timed)", flush=True)
        if (j := lv.join_steps):
            print(f"{_level_label(who, rnd, lv)} join steps: {j['count']:.0f}, step p50 "
                  f"{j['step_ms_p50']:.1f} ms (max {j['step_ms_max']:.1f}), rows p50 {j['rows_p50']:.0f}, "
                  f"prefill tokens p50 {j['prefill_tokens_p50']:.0f}, {100 * j['share']:.1f} % of the "
                  "level's time", flush=True)


def saturation_rps(levels: Sequence[LevelResult]) -> float:
    """The most requests per second completed at any concurrency level (0 when none ran)."""
    return max((lv.requests_per_s for lv in levels if lv.profile == "concurrent"), default=0.0)


@dataclass
class AgentTurn:
    """One turn of one conversation of the agent trace."""

    conversation: int
    turn: int
    ttft_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None
    request_id: str | None = None
    phases_ms: dict[str, float] | None = None
    """kvtier: the server's timeline phases of this request (its ``request.timeline`` log line)."""
    join_step: dict[str, float] | None = None
    """kvtier: the batch step it joined in (its ``batch.join_step`` log line): ``step_ms``,
    ``join_ms``, ``rows`` joined, ``prefill_tokens``, ``decode_rows``."""


@dataclass
class AgentResult:
    """The agent trace on one server."""

    conversations: int
    turns: int
    system_tokens: int
    turns_list: list[AgentTurn] = field(default_factory=list)

    def ttft(self, first: bool) -> Dist:
        """TTFT of turn 1 (``first``) or of turns 2+."""
        return Dist.of([t.ttft_ms for t in self.turns_list if (t.turn == 1) == first])


@dataclass
class ServerRun:
    """Everything one server did in one round."""

    server: str
    ready_s: float
    levels: list[LevelResult] = field(default_factory=list)
    agent: AgentResult | None = None
    guidellm_reports: list[str] = field(default_factory=list)
    warm_up: dict[str, Any] = field(default_factory=dict)
    """kvtier only: its start-up warm-up pass (``engine.warm_up`` log line: steps, rows,
    seconds; ``{}`` where it ran none, e.g. ``--warm-up auto`` off CUDA)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """kvtier only: parts of ``/stats`` (the tiers, the lanes, the timeline) after the load
    generator (``loads``) and after the agent trace (``agent``)."""
    code: str = ""
    """kvtier only: the directory whose ``actors`` package the server imported (which tree ran)."""
    host_loop_s: list[float] = field(default_factory=list)
    """The host's speed probe (``_common.host_loop``, seconds) before the server started and after
    its run: a host-bound step's time moves with it on a shared host."""
    host_state: list[dict[str, Any]] = field(default_factory=list)
    """``_common.host_state`` before the server started and after its run: memory, page cache,
    dirty pages, free disk, the GPU's clocks (what earlier calls on the same machine left)."""
    died: str | None = None
    """How the server ended before its run did (the round, the phase, its exit status, its
    last error line); ``None`` when it lasted. What it finished before is kept."""


# --- guidellm ----------------------------------------------------------------------


def scenario(
    *,
    url: str,
    model: str,
    profile: dict[str, Any],
    counts: list[int],
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    output: Path,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """A guidellm scenario: streamed greedy chat requests of synthetic prompts, JSON out."""
    constraints: list[dict[str, Any]] = [
        {"kind": "max_requests", "count": counts if len(counts) > 1 else counts[0]}
    ]
    if max_seconds is not None:
        constraints.append({"kind": "max_duration", "seconds": max_seconds})
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/chat/completions",
                # NOTE: neither server speaks HTTP/2 without TLS.
                "http2": False,
                "timeout": 1800.0,
                "extras": {"body": {"temperature": 0.0}},
            },
            # NOTE: the model directory's tokenizer: nothing is downloaded.
            "tokenizer": {"kind": "huggingface_auto", "model": model},
            "profile": profile,
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": prompt_tokens,
                    "output_tokens": max_tokens,
                }
            ],
            "seed": {"kind": "static", "value": seed},
            "constraints": constraints,
            "outputs": [{"kind": "json", "path": str(output)}],
        }
    }


def run_guidellm(python: Path, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """One guidellm run of ``spec`` (its own process, offline); its JSON report."""
    path = workdir / f"{name}.scenario.json"
    path.write_text(json.dumps(spec, indent=1))
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    # NOTE: guidellm runs in its own environment and this tree must not be on
    # its path: transformers takes kvtier's top-level ``kernels`` package for
    # Hugging Face's ``kernels``, imports it and fails to load any model config
    # (a tree benchmarked with PYTHONPATH at it would break every run).
    search = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO.resolve()
    ]
    if search:
        env["PYTHONPATH"] = os.pathsep.join(search)
    else:
        env.pop("PYTHONPATH", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        # NOTE: one worker process: the load generator shares the machine with
        # the server; one asyncio worker holds hundreds of streams.
        GUIDELLM__MAX_WORKER_PROCESSES=os.environ.get("GUIDELLM__MAX_WORKER_PROCESSES", "1"),
        GUIDELLM__LOGGING__LOG_FILE=str(workdir / f"{name}.guidellm.log"),
    )
    with (
        (workdir / f"{name}.stdout").open("wb") as out,
        (workdir / f"{name}.stderr").open("wb") as err,
    ):
        rc = subprocess.run(
            [str(python), str(SHIM), "run", "--scenario", str(path), "--disable-progress"],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=err,
            check=False,
        ).returncode
    report_path = Path(spec["spec"]["outputs"][0]["path"])
    if rc != 0 or not report_path.exists():
        tail = (workdir / f"{name}.stderr").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited {rc}: {tail}")
    return dict(json.loads(report_path.read_text()))


# --- agent trace -----------------------------------------------------------------


def agent_trace(
    url: str,
    model: str,
    conversations: int,
    turns: int,
    system_tokens: int,
    max_tokens: int,
    nonce: str,
) -> AgentResult:
    """N conversations at once, M turns each over one shared system prompt; TTFT per turn."""
    from _common import QUESTIONS, in_threads, stream_chat, system_prompt

    system = system_prompt(system_tokens, nonce)
    result = AgentResult(conversations, turns, system_tokens)
    lock = threading.Lock()

    def conversation(c: int) -> None:
        import httpx

        messages = [{"role": "system", "content": system}]
        # NOTE: one connection pool per conversation, as an agent holds its
        # client (a client made per request put its SSL setup, ~150 ms with 8
        # threads at once, into every turn's TTFT, for both servers alike).
        with httpx.Client(timeout=1800.0) as client:
            for t in range(1, turns + 1):
                turn(c, t, messages, client)

    def turn(c: int, t: int, messages: list[dict[str, str]], client: Any) -> None:
        q = QUESTIONS[(c * turns + t) % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"[{c}.{t}] {q}"})
        r = stream_chat(url, messages, model, max_tokens, client=client)
        messages.append({"role": "assistant", "content": r.text})
        prompt = (r.usage or {}).get("prompt_tokens")
        with lock:
            result.turns_list.append(
                AgentTurn(
                    c,
                    t,
                    1000.0 * r.ttft_s,
                    int(prompt) if isinstance(prompt, int) else None,
                    r.cached_tokens,
                    r.request_id,
                )
            )

    in_threads(conversation, conversations)
    result.turns_list.sort(key=lambda t: (t.conversation, t.turn))
    return result


def warm_up(url: str, model: str, levels: Sequence[int], prompt_tokens: int, nonce: str) -> None:
    """One burst of short requests at each concurrency level, before anything is measured.

    NOTE: MLX compiles kernels on first use per shape (on CUDA at every new
    batch size and prompt length); without this the server that runs first
    on a fresh machine pays those compiles inside its measured levels.
    Distinct prompts of the measured length, 4 new tokens each.
    """
    from _common import in_threads, stream_chat, system_prompt

    for level in levels:
        def one(i: int, level: int = level) -> None:
            text = system_prompt(prompt_tokens, f"warm {nonce} {level} {i}")
            stream_chat(url, [{"role": "user", "content": text}], model, 4)

        in_threads(one, level)


# --- servers -----------------------------------------------------------------------


def start_server(
    who: str, model: Path, port: int, workdir: Path, args: argparse.Namespace, tag: str
) -> Any:
    """``who`` on ``port`` with the shared flags; waits until ``/v1/models`` answers."""
    from _common import Server

    common = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    if args.prefill_step_size:
        common += ["--prefill-step-size", str(args.prefill_step_size)]
    if who == "kvtier":
        extra = list(args.kvtier_arg)
        if args.rows:
            extra += ["--max-batch", str(args.rows)]
        if "--ssd-cache" not in extra and "KVTIER_SSD_CACHE" not in (kvtier_env(args) or {}):
            # NOTE: the default SSD tier, in a directory of this start only;
            # `--kvtier-env KVTIER_SSD_CACHE=off` (an A/B's variant) names
            # the tier itself, which a flag here would override.
            extra += ["--ssd-cache", str(workdir / f"kv-{tag}")]
        cmd = [sys.executable, "-m", "actors.cli", "serve", *common, *extra]
    else:
        extra = list(args.mlx_lm_arg)
        if args.rows:
            extra += ["--decode-concurrency", str(args.rows)]
        cmd = [sys.executable, "-m", "mlx_lm.server", *common, *extra]
    env = kvtier_env(args) if who == "kvtier" else None
    server = Server(cmd, workdir, f"{who}-{tag}", env=env, cwd=server_cwd(who, env, workdir))
    server.wait_ready(f"http://127.0.0.1:{port}", timeout=args.start_timeout)
    return server


def kvtier_env(args: argparse.Namespace) -> dict[str, str] | None:
    """``--kvtier-env``'s assignments (``None``: none)."""
    # NOTE: kvtier's process only: MLX's own switches (e.g.
    # MLX_CUDA_USE_CUDNN_SDPA) would otherwise change the peer too.
    return dict(item.split("=", 1) for item in args.kvtier_env) if args.kvtier_env else None


def server_cwd(who: str, env: dict[str, str] | None, workdir: Path) -> Path:
    """Where a server child runs: this checkout, or, for kvtier given a ``PYTHONPATH``, ``workdir``.

    NOTE: ``python -m actors.cli`` puts its working directory first on
    ``sys.path``, ahead of ``PYTHONPATH``: run from this checkout, an earlier
    tree named on ``PYTHONPATH`` (an A/B against an older commit) loses to the
    checkout's own code, and both variants run the same code. From
    ``workdir`` (no ``actors`` there), ``PYTHONPATH`` decides, then the
    installed package.
    """
    if who == "kvtier" and env is not None and env.get("PYTHONPATH"):
        return workdir
    return REPO


def code_dir(env: dict[str, str] | None, cwd: Path) -> str:
    """The directory whose ``actors`` package a ``kvtier serve`` child with ``env`` in ``cwd`` imports."""
    from _common import child_env

    done = subprocess.run(
        [sys.executable, "-c", "import actors, os; print(os.path.dirname(os.path.dirname(actors.__file__)))"],
        cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=120, check=False,
    )
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def run_server(
    who: str,
    model: Path,
    port: int,
    workdir: Path,
    args: argparse.Namespace,
    rnd: int,
    rates: list[float],
    progress: Callable[[ServerRun], None] | None = None,
) -> ServerRun:
    """Start ``who``, warm it up, run the profiles and the agent trace, stop it.

    ``progress`` is called with the run after each phase that added figures
    (``main`` writes the JSON then, so a run killed later keeps them).
    """
    from _common import host_loop, host_state, host_state_line, model_id, stream_chat

    def phase_done() -> None:
        if progress is not None:
            progress(run)

    def levels_done(new: list[LevelResult]) -> None:
        run.levels += new
        _print_levels(who, rnd, new)
        if who == "kvtier":
            level_phases(new, [server.stdout, server.stderr])
            print_level_phases(who, rnd, new)
        phase_done()

    tag = f"r{rnd}"
    before = host_loop()
    state_before = host_state(workdir)
    server = start_server(who, model, port, workdir, args, tag)
    run = ServerRun(who, server.ready_s, host_loop_s=[before], host_state=[state_before])
    if who == "kvtier":
        env = kvtier_env(args)
        run.code = code_dir(env, server_cwd(who, env, workdir))
        print(f"round {rnd} kvtier  code: {run.code}", flush=True)
    if who == "kvtier" and (warm := warm_up_pass([server.stdout, server.stderr])):
        run.warm_up = warm
        print(f"round {rnd} kvtier  start-up warm-up: {warm.get('steps')} steps, {warm.get('rows')} rows, "
              f"{warm.get('seconds')} s (ready after {server.ready_s:.1f} s)", flush=True)
    phase = "warm-up"
    try:
        url = server.url
        # NOTE: both servers know the model by the directory they loaded
        # (mlx_lm.server's /v1/models lists its Hugging Face cache instead).
        served = str(model)
        if who == "kvtier" and model_id(url) != served:
            raise RuntimeError(f"kvtier serves {model_id(url)!r}, not {served!r}")
        stream_chat(url, [{"role": "user", "content": f"warm-up {rnd}"}], served, 8)
        if args.warmup and not args.skip_loadgen:
            warm_up(url, served, [int(c) for c in args.concurrency.split(",") if c],
                    args.prompt_tokens, f"{who}-{tag}")
        if not args.skip_loadgen:
            phase = "the load generator's levels"
            levels = [int(c) for c in args.concurrency.split(",") if c]
            counts = [max(args.min_requests, c * args.requests_per_stream) for c in levels]
            name = f"{who}-{tag}-concurrent"
            spec = scenario(
                url=url,
                model=served,
                profile={"kind": "concurrent", "streams": levels},
                counts=counts,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                seed=1000 + rnd,
                output=workdir / f"{name}.json",
            )
            report = run_guidellm(args.guidellm_python, spec, workdir, name)
            run.guidellm_reports.append(str(workdir / f"{name}.json"))
            levels_done(level_results(report))
            if not rates and who == PEER and args.rate_fractions:
                sat = saturation_rps(run.levels)
                rates[:] = [round(f * sat, 4) for f in _floats(args.rate_fractions)]
                print(f"{PEER} saturation {sat:.3f} req/s -> constant rates {rates}", flush=True)
            for rate in rates:
                phase = f"the constant rate {rate:g}"
                name = f"{who}-{tag}-constant-{rate:g}"
                n = max(args.min_requests, math.ceil(rate * args.rate_seconds))
                spec = scenario(
                    url=url,
                    model=served,
                    profile={"kind": "constant", "rate": [rate]},
                    counts=[n],
                    prompt_tokens=args.prompt_tokens,
                    max_tokens=args.max_tokens,
                    seed=2000 + rnd,
                    output=workdir / f"{name}.json",
                    max_seconds=args.rate_seconds * 6 + 60,
                )
                report = run_guidellm(args.guidellm_python, spec, workdir, name)
                run.guidellm_reports.append(str(workdir / f"{name}.json"))
                levels_done(level_results(report))
        if who == "kvtier":
            run.stats["loads"] = server_stats(url)
        if args.agent:
            phase = "the agent trace"
            n, m = (int(x) for x in args.agent.lower().split("x"))
            if args.warmup and args.skip_loadgen:
                # NOTE: without the load generator's warm-up, the first turns
                # would pay the first long prompts' one-time costs (kernel
                # compilation on CUDA): two conversations of the same shape first.
                agent_trace(url, served, 2, 2, args.system_tokens, args.agent_max_tokens,
                            f"agent-warm-r{rnd}")
            run.agent = agent_trace(
                url, served, n, m, args.system_tokens, args.agent_max_tokens, f"agent-r{rnd}"
            )
            a = run.agent
            print(
                f"round {rnd} {who:<7} agent {n}x{m}: TTFT p50 turn 1 {a.ttft(True).p50:.0f} ms, "
                f"turns 2+ {a.ttft(False).p50:.0f} ms (p90 {a.ttft(False).p90:.0f})",
                flush=True,
            )
            if who == "kvtier":
                run.stats["agent"] = server_stats(url)
                attach_phases(a, [server.stdout, server.stderr])
                print_turn_phases(who, rnd, a)
            phase_done()
    except Exception:
        # NOTE: a server that exits mid-run (mlx_lm.server's generation
        # thread died of CUDA out-of-memory on an H100, and the process with
        # it) ends its own run, not the benchmark's: what it finished is
        # kept and reported, and main() exits 1. Any other failure, with the
        # server still up, is the benchmark's and propagates.
        code = server.proc.poll()
        if code is None:
            raise
        run.died = f"round {rnd}: exited with status {code} during {phase}: {_last_error(server.stderr)}"
        print(f"{who:<7} DIED {run.died}", flush=True)
    finally:
        server.stop()
    run.host_loop_s.append(host_loop())
    run.host_state.append(host_state(workdir))
    print(f"round {rnd} {who:<7} host loop: {before:.3f} s before, {run.host_loop_s[-1]:.3f} s after",
          flush=True)
    print(f"round {rnd} {who:<7} host before: {host_state_line(run.host_state[0])}", flush=True)
    print(f"round {rnd} {who:<7} host after:  {host_state_line(run.host_state[-1])}", flush=True)
    if who == "kvtier":
        slow = slow_background_turns([server.stdout, server.stderr])
        run.stats["background_slow"] = slow
        for name, f in slow.items():
            print(f"round {rnd} {who:<7} slow background turns {name}: {f['count']:.0f} x median "
                  f"{f['median_ms']:.1f} ms (max {f['max_ms']:.1f}, {f['total_ms']:.0f} ms in all)",
                  flush=True)
        tier = ssd_tier_line(run.stats)
        if tier is not None:
            print(f"round {rnd} {who:<7} ssd tier: {tier}", flush=True)
        clears = cache_clears([server.stdout, server.stderr])
        run.stats["cache_clears"] = clears
        if clears:
            print(f"round {rnd} {who:<7} buffer cache emptied {clears['count']:.0f} x: median "
                  f"{clears['median_ms']:.1f} ms (max {clears['max_ms']:.1f}), freed median "
                  f"{clears['median_freed_gb']:.2f} GB, the step it ended median "
                  f"{clears['median_step_ms']:.1f} ms", flush=True)
    return run


def _last_error(log: Path) -> str:
    """The last line of ``log`` that names an error (else its last line), shortened."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    named = [ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()]
    last = named[-1] if named else (lines[-1] if lines else "(no output)")
    return last[-300:]


def cache_clears(logs: Sequence[Path]) -> dict[str, float]:
    """The ``batch.cache_cleared`` lines: count, median / max ms, median GB freed, median step ms ({} if none)."""
    ms: list[float] = []
    freed: list[float] = []
    steps: list[float] = []
    for fields in log_events(logs, "batch.cache_cleared"):
        clear_ms, freed_b, step_ms = (fields.get(k) for k in ("clear_ms", "freed_bytes", "step_ms"))
        if isinstance(clear_ms, int | float):
            ms.append(float(clear_ms))
            freed.append(float(freed_b) / 1e9 if isinstance(freed_b, int | float) else 0.0)
            steps.append(float(step_ms) if isinstance(step_ms, int | float) else 0.0)
    if not ms:
        return {}
    return {"count": float(len(ms)), "median_ms": statistics.median(ms), "max_ms": max(ms),
            "median_freed_gb": statistics.median(freed), "median_step_ms": statistics.median(steps)}


_FIELD = re.compile(r"(\w+)=(\{[^}]*\}|\[[^\]]*\]|\S+)")


def log_events(logs: Sequence[Path], event: str) -> Iterator[dict[str, Any]]:
    """The fields of every ``event`` line of kvtier's logs, console (``key=value``) or JSON format.

    ``_time``: the line's timestamp in epoch seconds, where it has one.

    NOTE: console values that are Python literals (dicts, lists, numbers,
    quoted strings) come back as such; the rest as text.
    """
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if event not in line:
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("event") == event:
                    at = _epoch(obj.get("timestamp"))
                    yield obj if at is None else obj | {"_time": at}
                continue
            fields: dict[str, Any] = {}
            for key, raw in _FIELD.findall(line):
                try:
                    fields[key] = ast.literal_eval(raw)
                except (ValueError, SyntaxError):
                    fields[key] = raw
            stamp = _STAMP.match(line)
            at = _epoch(stamp.group(1)) if stamp else None
            if at is not None:
                fields["_time"] = at
            yield fields


_STAMP = re.compile(r"\s*(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?)\s")
"""A console line's leading ISO timestamp (structlog's, UTC)."""


def _epoch(stamp: object) -> float | None:
    """An ISO timestamp (UTC when it names no zone) as epoch seconds; ``None`` if it is not one."""
    if not isinstance(stamp, str):
        return None
    try:
        at = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return at.timestamp()


def timeline_phases(logs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Each ``request.timeline`` log line's phases (ms) by request id, its admission's parts
    (``admission.parse`` ...) after them where the line has them (a rendered prompt)."""
    found: dict[str, dict[str, float]] = {}
    for fields in log_events(logs, "request.timeline"):
        rid, row = fields.get("request_id"), _timeline_row(fields)
        if isinstance(rid, str) and row is not None:
            found[rid] = row
    return found


def _timeline_row(fields: dict[str, Any]) -> dict[str, float] | None:
    """A ``request.timeline`` line's phases (ms), then its admission's parts as ``admission.<part>``
    where it has them, then ``decode_per_token`` (its ``decode_ms`` over the tokens after the first)
    where it streamed more than one token; ``None`` for a line without phases.

    NOTE: the per-token figure is the server's own, without the client's
    reading: it tells a slower decode from a slower delivery.
    """
    phases = fields.get("phases_ms")
    if not isinstance(phases, dict):
        return None
    row = {str(k): float(v) for k, v in phases.items()}
    parts = fields.get("admission_parts_ms")
    if isinstance(parts, dict):
        row |= {f"admission.{k}": float(v) for k, v in parts.items()}
    decode, tokens = fields.get("decode_ms"), fields.get("tokens")
    if isinstance(decode, int | float) and isinstance(tokens, int) and tokens > 1:
        row["decode_per_token"] = float(decode) / (tokens - 1)
    return row


_STEP_FIELDS = ("step_ms", "join_ms", "prefill_tokens", "decode_rows", "since_clear")


def _join_step_figures(fields: dict[str, Any]) -> dict[str, float] | None:
    """A ``batch.join_step`` line's figures and its joined ``rows``; ``None`` without a joined list."""
    joined = fields.get("joined")
    if not isinstance(joined, list):
        return None
    figures = {k: float(fields[k]) for k in _STEP_FIELDS if isinstance(fields.get(k), int | float)}
    figures["rows"] = float(len(joined))
    return figures


def join_steps(logs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Each ``batch.join_step`` log line's figures by the request ids it joined."""
    found: dict[str, dict[str, float]] = {}
    for fields in log_events(logs, "batch.join_step"):
        if (figures := _join_step_figures(fields)) is not None:
            for rid in fields["joined"]:
                found[str(rid)] = figures
    return found


def warm_up_pass(logs: Sequence[Path]) -> dict[str, Any]:
    """kvtier's ``engine.warm_up`` line (its steps, rows, warm rows, seconds, skipped); ``{}``
    where the server ran no pass."""
    keys = ("steps", "rows", "warm_rows", "seconds", "skipped")
    for fields in log_events(logs, "engine.warm_up"):
        return {k: fields[k] for k in keys if k in fields}
    return {}


def slow_background_turns(logs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """The ``engine.background_step_slow`` lines by the callable's short name: count, median, max, total ms.

    NOTE: each such engine turn (write-behind plans and reads, checkpoint
    views, their finish) stalled every decoding row for its length.
    """
    found: dict[str, list[float]] = {}
    for fields in log_events(logs, "engine.background_step_slow"):
        fn, ms = fields.get("fn"), fields.get("ms")
        if isinstance(fn, str) and isinstance(ms, int | float):
            name = fn.split(".<locals>")[0].rsplit(".", 1)[-1]
            found.setdefault(name, []).append(float(ms))
    return {name: {"count": float(len(v)), "median_ms": statistics.median(v), "max_ms": max(v),
                   "total_ms": sum(v)} for name, v in sorted(found.items())}


def attach_phases(agent: AgentResult, logs: Sequence[Path]) -> None:
    """Give each agent turn the server's timeline phases of its request and the step it joined in."""
    phases = timeline_phases(logs)
    steps = join_steps(logs)
    for turn in agent.turns_list:
        if turn.request_id is not None:
            turn.phases_ms = phases.get(turn.request_id)
            turn.join_step = steps.get(turn.request_id)


def print_turn_phases(who: str, rnd: int, agent: AgentResult) -> None:
    """Per turn of the agent trace: the median TTFT and the median of each server-side phase."""
    for t in sorted({x.turn for x in agent.turns_list}):
        turns = [x for x in agent.turns_list if x.turn == t]
        timed = [x.phases_ms for x in turns if x.phases_ms]
        parts = [f"TTFT p50 {statistics.median(x.ttft_ms for x in turns):.0f} ms"]
        if timed:
            keys = [k for k in timed[0] if k != "first_byte"]
            parts += [f"{k} {statistics.median(p.get(k, 0.0) for p in timed):.1f}" for k in keys]
            parts.append(f"({len(timed)}/{len(turns)} timed)")
        steps = [x.join_step for x in turns if x.join_step]
        if steps:
            parts.append("join step " + ", ".join(
                f"{k} {statistics.median(s.get(k, 0.0) for s in steps):.1f}"
                for k in ("step_ms", "join_ms", "rows", "prefill_tokens", "decode_rows")))
            slowest = max(steps, key=lambda s: s.get("step_ms", 0.0))
            # NOTE: the slowest join step and its since_clear: the steps since
            # the batch lane last emptied MLX's buffer cache (or since the
            # lane started), this one included (1: the first step after one).
            parts.append(f"slowest step_ms {slowest.get('step_ms', 0.0):.1f}"
                         + (f" (since_clear {slowest['since_clear']:.0f})"
                            if "since_clear" in slowest else ""))
        print(f"round {rnd} {who:<7} agent turn {t}: " + ", ".join(parts), flush=True)


def ssd_tier_line(stats: dict[str, Any]) -> str | None:
    """The SSD tier's cap and what it kept, dropped and evicted, from the last phase of ``stats`` that has it.

    NOTE: printed per server: the cap is a quarter of the free disk by
    default, so a machine whose earlier runs left their files gives a later
    server a smaller tier that evicts and drops what an earlier one kept
    (docs/benchmarks.md, 2026-12-07 16:56: 3.5 against 12.4 GB).
    """
    tier: dict[str, Any] | None = None
    for phase in stats.values():
        if isinstance(phase, dict) and isinstance(phase.get("ssd_cache"), dict):
            tier = phase["ssd_cache"]
    if not tier or "max_bytes" not in tier:
        return None
    gb = 1e9
    return (f"cap {tier['max_bytes'] / gb:.1f} GB, holds {tier.get('bytes', 0) / gb:.1f} GB in "
            f"{tier.get('entries', 0)} entries; written {tier.get('writebehind_written', 0)}, evicted "
            f"{tier.get('evicted', 0)}, dropped spills {tier.get('dropped_spills', 0)}, evicted unwritten "
            f"{tier.get('writebehind_evicted_unwritten', 0)}")


_STATS_KEYS = ("prompt_cache", "ssd_cache", "batch", "memory", "gateway", "checkpoints")
"""The ``/stats`` ``engine`` sections a run keeps (the rest is the actors' mailboxes)."""


def server_stats(url: str) -> dict[str, Any]:
    """The parts of kvtier's ``/stats`` that say what the tiers and lanes did (``{"error": ...}`` if unreadable).

    NOTE: read between phases, so a run's JSON shows e.g. how many of the
    agent trace's hits came from RAM and how many from the SSD tier.
    """
    import httpx

    try:
        body = httpx.get(f"{url}/stats", timeout=10.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": repr(exc)}
    engine = body.get("engine", {}) if isinstance(body, dict) else {}
    out = {key: engine[key] for key in _STATS_KEYS if key in engine}
    out["timeline"] = body.get("http", {}).get("timeline") if isinstance(body, dict) else None
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _level_label(who: str, rnd: int, lv: LevelResult) -> str:
    """The start of a level's printed lines: round, server, profile and level."""
    unit = "streams" if lv.profile == "concurrent" else "req/s"
    return f"round {rnd} {who:<7} {lv.profile:<10} {lv.level:>7g} {unit:<7}"


def _print_levels(who: str, rnd: int, levels: Sequence[LevelResult]) -> None:
    for lv in levels:
        print(
            f"{_level_label(who, rnd, lv)} ok {lv.ok:>4} err {lv.errored:>2}"
            f"  {lv.output_tps:>8.1f} tok/s  TTFT p50 {lv.ttft_ms.p50:>8.1f} p99 {lv.ttft_ms.p99:>8.1f} ms"
            f"  ITL p50 {lv.itl_ms.p50:>6.1f} ms",
            flush=True,
        )
        unrecorded = unrecorded_requests(lv)
        if unrecorded:
            print(f"{_level_label(who, rnd, lv)} UNRECORDED: {unrecorded}; the load generator's "
                  f"counts {lv.scheduler}", flush=True)


def unrecorded_requests(lv: LevelResult) -> int:
    """Requests the load generator created but recorded in none of its lists (0 where it has no counts)."""
    created = lv.scheduler.get("created")
    if created is None:
        return 0
    return max(0, created - (lv.ok + lv.errored + lv.incomplete))


# --- summary -----------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(rounds: Sequence[dict[str, ServerRun]]) -> dict[str, Any]:
    """Medians over rounds per server and level, and kvtier / mlx_lm ratios (with per-round values)."""
    keys: list[tuple[str, float]] = []
    for rnd in rounds:
        for run in rnd.values():
            for lv in run.levels:
                if (lv.profile, lv.level) not in keys:
                    keys.append((lv.profile, lv.level))
    rows: list[dict[str, Any]] = []
    for profile, level in keys:
        row: dict[str, Any] = {"profile": profile, "level": level}
        per: dict[str, dict[str, list[float]]] = {}
        for who in SERVERS:
            vals: dict[str, list[float]] = {
                "output_tps": [],
                "ttft_p50": [],
                "ttft_p99": [],
                "itl_p50": [],
                "errors": [],
            }
            for rnd in rounds:
                got = rnd.get(who)
                for lv in got.levels if got else []:
                    if (lv.profile, lv.level) == (profile, level):
                        vals["output_tps"].append(lv.output_tps)
                        vals["ttft_p50"].append(lv.ttft_ms.p50)
                        vals["ttft_p99"].append(lv.ttft_ms.p99)
                        vals["itl_p50"].append(lv.itl_ms.p50)
                        vals["errors"].append(float(lv.errored + lv.incomplete))
            per[who] = vals
            row[who] = {k: _median(v) for k, v in vals.items()} | {
                "rounds": len(vals["output_tps"])
            }
        k, m = per["kvtier"], per[PEER]
        if k["output_tps"] and m["output_tps"]:
            row["ratio"] = {
                metric: {
                    "median": _median(k[metric]) / _median(m[metric]),
                    "per_round": [a / b for a, b in zip(k[metric], m[metric], strict=False) if b],
                }
                for metric in ("output_tps", "ttft_p50", "ttft_p99", "itl_p50")
                if _median(m[metric])
            }
        rows.append(row)
    agent: dict[str, Any] = {}
    for who in SERVERS:
        firsts = [r[who].agent.ttft(True).p50 for r in rounds if who in r and r[who].agent]  # type: ignore[union-attr]
        later = [r[who].agent.ttft(False).p50 for r in rounds if who in r and r[who].agent]  # type: ignore[union-attr]
        if later:
            agent[who] = {
                "ttft_p50_turn1_ms": _median(firsts),
                "ttft_p50_turns2plus_ms": _median(later),
            }
    if "kvtier" in agent and PEER in agent:
        agent["ratio_turns2plus"] = (
            agent["kvtier"]["ttft_p50_turns2plus_ms"] / agent[PEER]["ttft_p50_turns2plus_ms"]
        )
    died = [f"{who} {r[who].died}" for r in rounds for who in r if r[who].died]
    return {"levels": rows, "agent": agent, "died": died}


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as a table: medians per server, kvtier / mlx_lm ratios."""
    header = (
        f"{'profile':<11}{'level':>8} | {'tok/s mlx_lm':>13}{'kvtier':>9}{'ratio':>7} |"
        f" {'TTFT p50 ms mlx':>16}{'kvtier':>9}{'ratio':>7} | {'TTFT p99 mlx':>13}{'kvtier':>9}{'ratio':>7} |"
        f" {'ITL p50 mlx':>12}{'kvtier':>8}"
    )
    lines = [header]
    for row in summary["levels"]:
        m, k = row.get(PEER, {}), row.get("kvtier", {})
        ratio = row.get("ratio", {})

        def r(metric: str, ratio: dict[str, Any] = ratio) -> str:
            return f"{ratio[metric]['median']:.2f}" if metric in ratio else "-"

        lines.append(
            f"{row['profile']:<11}{row['level']:>8g} | {m.get('output_tps', float('nan')):>13.1f}"
            f"{k.get('output_tps', float('nan')):>9.1f}{r('output_tps'):>7} |"
            f" {m.get('ttft_p50', float('nan')):>16.0f}{k.get('ttft_p50', float('nan')):>9.0f}{r('ttft_p50'):>7} |"
            f" {m.get('ttft_p99', float('nan')):>13.0f}{k.get('ttft_p99', float('nan')):>9.0f}{r('ttft_p99'):>7} |"
            f" {m.get('itl_p50', float('nan')):>12.1f}{k.get('itl_p50', float('nan')):>8.1f}"
        )
    agent = summary["agent"]
    for who in SERVERS:
        if who in agent:
            a = agent[who]
            lines.append(
                f"agent {who:<7}: TTFT p50 turn 1 {a['ttft_p50_turn1_ms']:.0f} ms, "
                f"turns 2+ {a['ttft_p50_turns2plus_ms']:.0f} ms"
            )
    if "ratio_turns2plus" in agent:
        lines.append(
            f"agent kvtier / mlx_lm, TTFT p50 of turns 2+: {agent['ratio_turns2plus']:.2f}"
        )
    lines += [f"DIED {how}" for how in summary.get("died", [])]
    return lines


def plot(
    rounds: Sequence[dict[str, ServerRun]], summary: dict[str, Any], path: Path, title: str
) -> None:
    """Four panels: output tok/s, TTFT (p50, p99) and ITL p50 per concurrency; constant-rate and agent TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=110)
    conc = [r for r in summary["levels"] if r["profile"] == "concurrent"]
    xs = [r["level"] for r in conc]
    colors = {"mlx_lm": "tab:blue", "kvtier": "tab:orange"}
    label = {"mlx_lm": "mlx_lm.server", "kvtier": "kvtier serve"}
    for who in SERVERS:
        if not any(who in r and r[who]["rounds"] for r in conc):
            continue
        c = colors[who]
        # every round's point, the median as the line
        for rnd in rounds:
            run = rnd.get(who)
            pts = [lv for lv in run.levels if lv.profile == "concurrent"] if run else []
            axes[0][0].scatter(
                [lv.level for lv in pts], [lv.output_tps for lv in pts], color=c, s=10, alpha=0.5
            )
            axes[0][1].scatter(
                [lv.level for lv in pts], [lv.ttft_ms.p50 for lv in pts], color=c, s=10, alpha=0.5
            )
        axes[0][0].plot(xs, [r[who]["output_tps"] for r in conc], "-o", color=c, label=label[who])
        axes[0][1].plot(
            xs, [r[who]["ttft_p50"] for r in conc], "-o", color=c, label=f"{label[who]} p50"
        )
        axes[0][1].plot(
            xs, [r[who]["ttft_p99"] for r in conc], "--", color=c, label=f"{label[who]} p99"
        )
        axes[1][0].plot(xs, [r[who]["itl_p50"] for r in conc], "-o", color=c, label=label[who])
    for ax, ylabel in (
        (axes[0][0], "aggregate output tok/s"),
        (axes[0][1], "TTFT ms"),
        (axes[1][0], "ITL p50 ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    # constant-rate and agent bars
    names: list[str] = []
    vals: dict[str, list[float]] = {w: [] for w in SERVERS}
    for r in summary["levels"]:
        if r["profile"] != "constant":
            continue
        for stat in ("ttft_p50", "ttft_p99"):
            names.append(f"{r['level']:g} req/s\nTTFT {stat[5:]}")
            for w in SERVERS:
                vals[w].append(r.get(w, {}).get(stat, float("nan")))
    agent = summary["agent"]
    for key, name in (
        ("ttft_p50_turn1_ms", "agent turn 1\nTTFT p50"),
        ("ttft_p50_turns2plus_ms", "agent turns 2+\nTTFT p50"),
    ):
        if any(w in agent for w in SERVERS):
            names.append(name)
            for w in SERVERS:
                vals[w].append(agent.get(w, {}).get(key, float("nan")))
    ax = axes[1][1]
    for j, w in enumerate(SERVERS):
        pos = [i + (j - 0.5) * 0.4 for i in range(len(names))]
        bars = ax.bar(pos, vals[w], 0.4, color=colors[w], label=label[w])
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def guidellm_version(python: Path) -> str:
    """The guidellm version in the load generator's environment."""
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or f"unavailable ({out.stderr.strip()[-200:]})"


# --- a random-weight model on disk (GPU runs) --------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""The tokenizer directory's files a random model gets (those that exist)."""


def write_random_model(
    directory: Path, shape: str, tok_dir: Path, seed: int, dtype: str = "bfloat16"
) -> Path:
    """A seeded random-weight mlx-lm ``llama`` of ``shape`` in ``dtype``, with ``tok_dir``'s tokenizer.

    The shapes are ``gpu_engine.SHAPES`` (the vocabulary is the tokenizer's).
    Both servers load the directory (also ``served_steps.py``'s). Nothing is
    written when it already holds a ``config.json`` (a later run on the same
    machine reuses it).
    """
    import shutil

    if (directory / "config.json").exists():
        return directory
    import mlx.core as mx
    from gpu_engine import SHAPES, build_model, load_tokenizer
    from mlx_lm.utils import save_config, save_model

    vocab = len(load_tokenizer(tok_dir))
    model, params_b = build_model(shape, vocab, seed, getattr(mx, dtype))
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp, model, donate_model=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, tmp / name)
    config = {
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        **SHAPES[shape],
    }
    # NOTE: config.json last, then the rename: a directory with a config is complete.
    save_config(config, tmp / "config.json")
    tmp.rename(directory)
    print(
        f"wrote {shape} ({params_b:.2f} B parameters, {dtype}, vocab {vocab}) to {directory}",
        flush=True,
    )
    return directory


# --- main --------------------------------------------------------------------------


def _assignment(text: str) -> str:
    """A ``KEY=VALUE`` command-line item, checked."""
    key, sep, _ = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model directory (default: kvtier's default model)"
    )
    p.add_argument("--servers", default=",".join(SERVERS), help="comma list of mlx_lm,kvtier")
    p.add_argument(
        "--rounds", type=int, default=1, help="rounds; the server order alternates per round"
    )
    p.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="number of the first round (prompts are seeded by the round: a later run continues the series)",
    )
    p.add_argument("--concurrency", default="1,4,8", help="concurrent-stream levels")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before the measured levels, one burst of short requests per concurrency level (first compiles)",
    )
    p.add_argument(
        "--requests-per-stream", type=int, default=3, help="requests per level = this x streams"
    )
    p.add_argument(
        "--min-requests", type=int, default=4, help="at least this many requests per level or rate"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=256, help="synthetic prompt tokens per request"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument(
        "--rate-fractions",
        default="0.8",
        help="constant rates as fractions of mlx_lm's saturation (empty: no constant-rate profile)",
    )
    p.add_argument(
        "--rate", default="", help="constant rates in req/s, instead of --rate-fractions"
    )
    p.add_argument(
        "--rate-seconds", type=float, default=30.0, help="seconds of arrivals per constant rate"
    )
    p.add_argument(
        "--agent", default="4x3", help="agent trace: conversations x turns (empty: none)"
    )
    p.add_argument(
        "--system-tokens", type=int, default=1000, help="the agent trace's shared system prompt"
    )
    p.add_argument("--agent-max-tokens", type=int, default=32, help="new tokens per agent turn")
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="kvtier --max-batch and mlx_lm --decode-concurrency (0: defaults)",
    )
    p.add_argument(
        "--prefill-step-size", type=int, default=0, help="both servers' prefill chunk (0: defaults)"
    )
    p.add_argument(
        "--kvtier-arg", action="append", default=[], help="extra `kvtier serve` argument (repeat)"
    )
    p.add_argument(
        "--kvtier-env",
        action="append",
        default=[],
        type=_assignment,
        help="KEY=VALUE in kvtier serve's environment only (repeat); PYTHONPATH=TREE runs TREE's "
             "code (an earlier commit's worktree: each run prints the tree it imported)",
    )
    p.add_argument(
        "--mlx-lm-arg", action="append", default=[], help="extra mlx_lm.server argument (repeat)"
    )
    p.add_argument(
        "--port", type=int, default=0, help="the one port both servers use (0: a free one)"
    )
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds a server may take to start"
    )
    p.add_argument(
        "--guidellm-python",
        type=Path,
        default=Path(os.environ.get("KVTIER_GUIDELLM_PYTHON", DEFAULT_GUIDELLM_PYTHON)),
        help="Python of the environment guidellm is installed in (env KVTIER_GUIDELLM_PYTHON)",
    )
    p.add_argument("--skip-loadgen", action="store_true", help="only the agent trace (no guidellm)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="keep logs and guidellm reports here (default: a temp dir)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    p.add_argument("--title", default="", help="extra text for the plot's title")
    p.add_argument(
        "--random-model",
        default="",
        metavar="SHAPE",
        help="first write a seeded random-weight bf16 model of SHAPE (gpu_engine.py's, e.g. llama3-8b) "
        "to --model unless it is there, with --tok-dir's tokenizer",
    )
    p.add_argument("--tok-dir", type=Path, default=None, help="tokenizer files for --random-model")
    p.add_argument("--seed", type=int, default=0, help="--random-model's seed")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="smoke sizes: 1,2 streams, 32-token prompts, 8 new tokens, 2x2 agent, no constant rate",
    )
    # NOTE: --tiny changes the defaults only; options given on the line win.
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(
            concurrency="1,2",
            requests_per_stream=1,
            min_requests=2,
            prompt_tokens=32,
            max_tokens=8,
            rate_fractions="",
            agent="2x2",
            system_tokens=200,
            agent_max_tokens=4,
        )
    args = p.parse_args(argv)
    return args


def write_json(path: Path, meta: dict[str, Any], args: argparse.Namespace, rates: list[float],
               rounds: Sequence[dict[str, ServerRun]], *, complete: bool) -> None:
    """The run's JSON, replaced whole (``complete``: false while a run is still going).

    NOTE: written after every phase, so a benchmark killed by its caller's
    time limit (a device call) still leaves every phase it finished.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": meta,
        "complete": complete,
        "args": {k: str(v) for k, v in vars(args).items()},
        "constant_rates": rates,
        "summary": summarize(rounds),
        "rounds": [{w: asdict(r) for w, r in rnd.items()} for rnd in rounds],
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every round, print the summary, write JSON and the PNG."""
    args = parse_args(argv)
    # NOTE: SIGTERM unwinds like an exception, so the server child is stopped
    # and guidellm's process killed (subprocess.run kills its child on the way out).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    from _common import free_port, loadavg, machine

    if args.random_model:
        if args.model is None or args.tok_dir is None:
            raise SystemExit("--random-model needs --model (where to write it) and --tok-dir")
        write_random_model(args.model.resolve(), args.random_model, args.tok_dir, args.seed)
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    model = args.model.resolve()
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in SERVERS:
            raise SystemExit(f"unknown server {s!r}; choose from {SERVERS}")
    if not args.skip_loadgen and not args.guidellm_python.exists():
        raise SystemExit(
            f"no guidellm environment at {args.guidellm_python}; install guidellm there "
            "(see this script's docstring) or pass --guidellm-python / --skip-loadgen"
        )
    port = args.port or free_port()
    meta: dict[str, Any] = machine() | {
        "model": str(model),
        "guidellm": "skipped" if args.skip_loadgen else guidellm_version(args.guidellm_python),
        "loadavg_start": loadavg(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "port": port,
    }
    if not meta["commit"]:
        # NOTE: the device machine gets the working tree without .git;
        # gpu_serving.sh prepare records the commit for it.
        meta["commit"] = os.environ.get("KVTIER_COMMIT", "")
    print(json.dumps(meta), flush=True)
    rates = _floats(args.rate)
    rounds: list[dict[str, ServerRun]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-serving-") as tmp:
        workdir = args.out or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for rnd in range(args.first_round, args.first_round + args.rounds):
            # NOTE: the peer goes first while the constant rate is unknown (its
            # saturation sets it); after that the order alternates by round so
            # load drift cancels out.
            order = sorted(servers, key=lambda s: s != PEER)
            if rnd % 2 == 1 and (rates or not args.rate_fractions):
                order.reverse()
            runs: dict[str, ServerRun] = {}
            for who in order:

                def progress(run: ServerRun, who: str = who, runs: dict[str, ServerRun] = runs) -> None:
                    if args.json is not None:
                        write_json(args.json, meta, args, rates, [*rounds, runs | {who: run}],
                                   complete=False)

                runs[who] = run_server(who, model, port, workdir, args, rnd, rates, progress)
            rounds.append(runs)
        meta["loadavg_end"] = loadavg()
        summary = summarize(rounds)
        print()
        for line in summary_lines(summary):
            print(line)
        print(f"load average: start {meta['loadavg_start']}, end {meta['loadavg_end']}")
        if args.json is not None:
            write_json(args.json, meta, args, rates, rounds, complete=True)
            print(f"json: {args.json}")
        if args.plot is not None:
            title = (
                f"{model.name}: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, "
                f"{args.rounds} round(s), {meta['commit']}, {meta['date']} {args.title}"
            )
            plot(rounds, summary, args.plot, title)
            print(f"plot: {args.plot}")
    return 1 if summary["died"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
