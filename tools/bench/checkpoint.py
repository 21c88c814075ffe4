"""Generation checkpoints: time to finish after a restart at 75 % of an answer, and decode throughput on vs off.

In-process ``Engine`` runs of the default model (unless ``--model``) on this
machine, serial lane (``max_batch`` 1), SSD tier on in every run, one
greedy raw completion of ``--tokens`` tokens:

- ``fresh``: the whole answer from a cold start, checkpoints off (median
  of ``--repeats`` runs, each on a new Engine and an empty SSD directory);
- ``restart``: an Engine checkpointing every ``--restart-every`` tokens
  (0: one checkpoint exactly at 75 % of the answer) streams the request, is
  cancelled one token past 75 % (a cancel keeps the checkpoint), waits until
  its newest checkpoint is durable and closes; a NEW Engine on the same
  directory answers the identical request: the time to its last token is
  the figure (median of ``--repeats``), and its text must equal ``fresh``'s.
  With an interval, the restart resumes the last multiple of it before
  75 %, as a crash under that setting would;
- decode throughput (emitted tokens / decode seconds from the answer's own
  timings) with checkpoints at ``--every`` vs off, median of ``--repeats``.

With ``--batch-streams N`` it measures the batch lane instead (``max_batch``
N): N greedy answers of ``--batch-tokens`` tokens each (distinct prompts,
EOS ignored, so every row decodes to the end) run at once, with checkpoints
off and at each interval of ``--batch-every``, the settings interleaved
within every repeat (each repeat starting with the next one) so that load
drifts on a shared machine hit them alike.
The figure is the aggregate decode rate (the sum over streams of emitted
tokens / decode seconds), median of ``--repeats``, and each interval's ratio
to off, side by side. Every setting's answers must equal off's.

With ``--contenders NAME=TREE:EVERY[:nowrite][:VAR=VALUE...],...`` (and ``--batch-streams``
N; 1 runs the serial lane) it compares source trees side by side (e.g. a
``git archive`` of the commit before a change and of the change): every
run in its own process importing the engine from its tree, the contenders
interleaved and rotated every repeat, ``--lock`` held for one repeat at a
time. Each run also reports the CPU seconds of every thread group of the
process (``/proc/self/task``; a thread blocked in native code without the
GIL counts here, unlike in a Python-frame profiler), the bytes it wrote
(``/proc/self/io``), the machine's CPU by kind (``/proc/stat``) and the
BLAS tuning's state; ``nowrite`` stubs the checkpoint file write out (the
engine's side alone); ``VAR=VALUE`` sets an environment variable for that
contender's process (an ``EngineConfig`` setting such as
``KVTIER_BACKGROUND_IN_CHAIN=on``). Ratios are to the first contender with EVERY 0.

Prints one JSON object.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint.py --repeats 3
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/checkpoint.py --batch-streams 8 --batch-every 256,512
    git archive BASE | tar -x -C /tmp/base
    LD_PRELOAD=... .venv/bin/python tools/bench/checkpoint.py --batch-streams 8 \\
        --contenders off=.:0,base=/tmp/base:100,new=.:100 --lock /tmp/bench.lock --plot out.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

REPO = Path(__file__).resolve().parents[2]

if TYPE_CHECKING:
    from actors.engine import Engine
    from messages.gateway import GenerationParams

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
          "bottle, describing every day of the following month, the weather, the ships, "
          "and the letters the keeper writes back.\n\nChapter 1.")


def _engine(root: Path, every: int, model: str | None, max_batch: int = 1) -> Engine:
    from actors.engine import Engine

    opts: dict[str, Any] = {"ssd_cache": root, "generation_checkpoint": every,
                            "max_batch": max_batch, "ssd_writebehind": False}
    if model is not None:
        opts["model"] = model
    return Engine(**opts)


async def _answer(engine: Engine, params: GenerationParams) -> tuple[str, float, float]:
    """(text, seconds to the last token, decode tokens per second)."""
    began = time.perf_counter()
    done = await engine.complete_prompt(PROMPT, params)
    wall = time.perf_counter() - began
    decode_s = done.timings.decode_s if done.timings is not None else 0.0
    emitted = len(done.token_ids)
    tps = emitted / decode_s if decode_s > 0 else 0.0
    return done.text, wall, tps


async def _cut_at(engine: Engine, params: GenerationParams, tokens: int) -> None:
    from messages.gateway import TokenEvent

    seen = 0
    async with engine.generate(PROMPT, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                seen += 1
                if seen >= tokens:
                    break


async def _written(engine: Engine) -> None:
    """Until a checkpoint is written and none is queued (the newest is then on disk)."""
    with anyio.fail_after(120):
        while True:
            section = (await engine.stats(timeout=5))["generation_checkpoints"]
            if section["written"] >= 1 and section["pending"] == 0:
                return
            await anyio.sleep(0.05)


async def bench(tokens: int, every: int, repeats: int, model: str | None,
                restart_every: int = 0) -> dict[str, Any]:
    """The figures (module docstring)."""
    from messages.gateway import GenerationParams

    params = GenerationParams(max_tokens=tokens, temperature=0.0)
    at = (tokens * 3) // 4
    interval = restart_every if restart_every > 0 else at
    if interval > at:
        raise ValueError("--restart-every must leave a checkpoint before 75 % of the answer")
    fresh_s: list[float] = []
    restart_s: list[float] = []
    tps_off: list[float] = []
    tps_on: list[float] = []
    reference: str | None = None
    equal = True
    resumed_tokens = 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-ckpt-") as tmp:
            async with _engine(Path(tmp) / "off", 0, model) as off:
                text, wall, tps = await _answer(off, params)
            fresh_s.append(wall)
            tps_off.append(tps)
            reference = reference or text
            equal &= text == reference
            async with _engine(Path(tmp) / "on", every, model) as on:
                text, _, tps = await _answer(on, params)
            tps_on.append(tps)
            equal &= text == reference
            root = Path(tmp) / "restart"
            async with _engine(root, interval, model) as first:
                await _cut_at(first, params, at + 1)
                await _written(first)
            async with _engine(root, interval, model) as second:
                text, wall, _ = await _answer(second, params)
                section = (await second.stats(timeout=5))["generation_checkpoints"]
            restart_s.append(wall)
            resumed_tokens = int(section["tokens_saved"])
            equal &= text == reference and section["resumed"] == 1
    fresh, restart = statistics.median(fresh_s), statistics.median(restart_s)
    off_tps, on_tps = statistics.median(tps_off), statistics.median(tps_on)
    return {
        "machine": f"{platform.machine()} {platform.system()}",
        "tokens": tokens,
        "restart_at_tokens": at,
        "restart_every": interval,
        "resumed_tokens": resumed_tokens,
        "repeats": repeats,
        "fresh_s_median": round(fresh, 3),
        "restart_s_median": round(restart, 3),
        "restart_over_fresh": round(restart / fresh, 3),
        "every": every,
        "decode_tps_off_median": round(off_tps, 2),
        "decode_tps_on_median": round(on_tps, 2),
        "decode_on_over_off": round(on_tps / off_tps, 3) if off_tps else None,
        "answers_equal": equal,
        "fresh_s": [round(x, 3) for x in fresh_s],
        "restart_s": [round(x, 3) for x in restart_s],
        "decode_tps_off": [round(x, 2) for x in tps_off],
        "decode_tps_on": [round(x, 2) for x in tps_on],
    }


async def _streams(engine: Engine, streams: int, tokens: int) -> tuple[list[str], float, int]:
    """``streams`` answers at once: (texts, aggregate decode tokens/s, tokens emitted)."""
    from messages.gateway import GenerationParams

    params = GenerationParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    texts = [""] * streams
    rates = [0.0] * streams
    emitted = [0] * streams

    async def one(i: int) -> None:
        done = await engine.complete_prompt(f"{PROMPT} (Variant {i}.)", params)
        decode_s = done.timings.decode_s if done.timings is not None else 0.0
        texts[i] = done.text
        emitted[i] = len(done.token_ids)
        rates[i] = len(done.token_ids) / decode_s if decode_s > 0 else 0.0

    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    return texts, sum(rates), sum(emitted)


async def bench_batch(streams: int, tokens: int, intervals: list[int], repeats: int,
                      model: str | None) -> dict[str, Any]:
    """Aggregate batch-lane decode rate, checkpoints off vs each interval (module docstring)."""
    settings = [0, *intervals]
    rates: dict[int, list[float]] = {e: [] for e in settings}
    taken: dict[int, int] = dict.fromkeys(settings, 0)
    reference: list[str] | None = None
    equal = True
    for r in range(repeats):
        # NOTE: each repeat starts with another setting, so a load that drifts
        # one way over the run does not always favour the same one.
        for every in settings[r % len(settings):] + settings[:r % len(settings)]:
            with tempfile.TemporaryDirectory(prefix="kvtier-bench-ckpt-") as tmp:
                async with _engine(Path(tmp), every, model, max_batch=streams) as engine:
                    texts, rate, emitted = await _streams(engine, streams, tokens)
                    stats = await engine.stats(timeout=5)
            rates[every].append(rate)
            print(json.dumps({"every": every, "decode_tps": round(rate, 2)}), file=sys.stderr,
                  flush=True)
            equal &= emitted == streams * tokens
            reference = reference or texts
            equal &= texts == reference
            section = stats.get("generation_checkpoints")
            if section is not None:
                taken[every] = int(section["taken"])
    off = statistics.median(rates[0])
    return {
        "machine": f"{platform.machine()} {platform.system()}",
        "lane": "batch",
        "streams": streams,
        "tokens_per_stream": tokens,
        "repeats": repeats,
        "decode_tps_off_median": round(off, 2),
        "intervals": {
            str(e): {
                "decode_tps_median": round(statistics.median(rates[e]), 2),
                "on_over_off": round(statistics.median(rates[e]) / off, 3) if off else None,
                "checkpoints_taken_last_run": taken[e],
                "decode_tps": [round(x, 2) for x in rates[e]],
            }
            for e in intervals
        },
        "decode_tps_off": [round(x, 2) for x in rates[0]],
        "answers_equal": equal,
    }


# --- one run in a child process, and the interleaved comparison of trees ----------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _thread_group(name: str) -> str:
    """A thread's group for the CPU breakdown (threads without a Python name are native)."""
    if name.startswith("AnyIO worker"):
        return "anyio_workers"
    if name.startswith(("asyncio_", "ThreadPoolExecutor")):
        return "default_executor"
    stem, _, index = name.rpartition("_")
    return stem if stem and index.isdigit() else name


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every live thread of this process, by native id, with its group."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            raw = Path(f"/proc/self/task/{entry}/stat").read_text()
        except OSError:
            continue  # NOTE: the thread ended between the listing and the read.
        fields = raw[raw.rfind(")") + 2:].split()
        tid = int(entry)
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        out[tid] = (_thread_group(names.get(tid, "native")), cpu)
    return out


def _system_cpu() -> dict[str, float]:
    """The machine's CPU seconds by kind since boot (``/proc/stat``)."""
    kinds = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return {k: int(v) / _CLK_TCK for k, v in zip(kinds, first, strict=False)}


def _proc_io() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


async def _child_run(streams: int, tokens: int, every: int, model: str | None,
                     max_batch: int = 0) -> dict[str, Any]:
    """One run of ``streams`` answers at once (``max_batch``, 0: ``streams``): rate and CPU by thread."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-ckpt-") as tmp:
        async with _engine(Path(tmp), every, model, max_batch=max_batch or streams) as engine:
            threads0, sys0, io0 = _thread_cpu(), _system_cpu(), _proc_io()
            proc0, wall0 = time.process_time(), time.perf_counter()
            texts, rate, emitted = await _streams(engine, streams, tokens)
            wall = time.perf_counter() - wall0
            proc = time.process_time() - proc0
            threads1, sys1, io1 = _thread_cpu(), _system_cpu(), _proc_io()
            stats = await engine.stats(timeout=5)
    groups: dict[str, float] = {}
    for tid, (group, cpu) in threads1.items():
        groups[group] = groups.get(group, 0.0) + cpu - threads0.get(tid, (group, 0.0))[1]
    # NOTE: threads that ended during the run are in the process's total only.
    groups["ended_threads"] = proc - sum(groups.values())
    section = stats.get("generation_checkpoints") or {}
    return {
        "decode_tps": rate,
        "emitted": emitted,
        "texts_sha": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16],
        "wall_s": round(wall, 3),
        "process_cpu_s": round(proc, 3),
        "cpu_s_by_thread": {k: round(v, 3) for k, v in sorted(groups.items()) if abs(v) >= 0.005},
        "system_cpu_s": {k: round(sys1[k] - sys0[k], 2) for k in sys0},
        "write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
        "checkpoints": {k: section.get(k) for k in ("taken", "written", "bytes", "unsent",
                                                     "read_ahead_used", "read_ahead_missed")},
        "blas": _find(stats, "blas"),
    }


def _find(tree: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a nested stats dict (``None``: absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _stub_writes() -> None:
    """Replace the store worker's checkpoint file write by a no-op (the ``nowrite`` contender).

    The checkpoint is still taken, queued, planned and its views lent, but
    no byte is read, hashed or written: what stays is the engine's side.
    """
    import os as _os

    from actors.ssd_writer import store

    def no_write(port: Any, directory: str, plan: Any, tensor: Any) -> str:
        ck = plan.header.checkpoint
        return _os.path.join(directory, f"{ck.request_key}-{ck.sample_index}.kvc")

    store.write_checkpoint = no_write  # type: ignore[assignment]


def _label(tree: Path) -> str:
    marker = tree / ".bench-label"
    if marker.exists():
        return marker.read_text().strip()
    # NOTE: the device machine's copy of the working tree carries a stale .git
    # (a past commit's HEAD); gpu_serving.sh names the code sent in KVTIER_COMMIT.
    sent = os.environ.get("KVTIER_COMMIT")
    if sent and tree.resolve() == Path.cwd().resolve():
        return sent
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip() or tree.name
    except (OSError, subprocess.CalledProcessError):
        return tree.name


class _Contender:
    """One measured setting: a source tree, a checkpoint interval, optionally stubbed writes and
    extra environment variables (e.g. ``KVTIER_BACKGROUND_IN_CHAIN=on``)."""

    def __init__(self, spec: str) -> None:
        name, _, rest = spec.partition("=")
        parts = rest.split(":")
        extras = parts[2:]
        if not name or len(parts) < 2 or any(x != "nowrite" and "=" not in x for x in extras):
            raise ValueError(f"a contender is NAME=TREE:EVERY[:nowrite][:VAR=VALUE...], got {spec!r}")
        self.name = name
        self.tree = Path(parts[0]).resolve()
        self.every = int(parts[1])
        self.stub = "nowrite" in extras
        self.env = dict(x.split("=", 1) for x in extras if x != "nowrite")


class _BenchLock:
    """The shared benchmark lock, held for one repeat at a time (``None``: no lock)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> None:
        if self._path:
            import fcntl

            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # NOTE: closing the descriptor releases the flock.
            self._fd = None


def compare(contenders: list[_Contender], streams: int, tokens: int, repeats: int,
            model: str | None, lock: str, partial: str = "", max_batch: int = 0) -> dict[str, Any]:
    """Every contender once a repeat, each run in its own process, the order rotated each repeat.

    Ratios are to the first contender with checkpoints off: the ratio of
    medians, and each repeat's paired ratio (two runs minutes apart, so a
    slow drift of the machine's load hits both alike). ``partial``: a file
    that holds the runs so far (JSON lines), one appended after each run.
    """
    offs = [c for c in contenders if c.every == 0]
    if not offs:
        raise ValueError("one contender must have checkpoints off (EVERY 0)")
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        shift = r % len(contenders)
        with _BenchLock(lock):
            for c in contenders[shift:] + contenders[:shift]:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child-tree", str(c.tree),
                       "--batch-streams", str(streams), "--batch-tokens", str(tokens),
                       "--child-every", str(c.every), "--max-batch", str(max_batch)]
                if c.stub:
                    cmd.append("--child-nowrite")
                if model is not None:
                    cmd += ["--model", model]
                load = _load()
                done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                      env={**os.environ, **c.env})
                if done.returncode != 0:
                    raise RuntimeError(f"child failed ({c.name}):\n{done.stderr[-4000:]}")
                out = json.loads(done.stdout.strip().splitlines()[-1])
                out.update(contender=c.name, tree=_label(c.tree), every=c.every, stub=c.stub,
                           env=c.env, repeat=r, load_before=load, load_after=_load())
                runs.append(out)
                if partial:
                    with open(partial, "a") as f:
                        f.write(json.dumps(out) + "\n")
                print(json.dumps({k: out[k] for k in ("contender", "repeat", "decode_tps",
                                                       "load_before", "cpu_s_by_thread")}),
                      file=sys.stderr, flush=True)
    ref = offs[0].name
    off = {x["repeat"]: x["decode_tps"] for x in runs if x["contender"] == ref}
    off_median = statistics.median(off.values())
    digests = {x["texts_sha"] for x in runs}
    summary: dict[str, Any] = {}
    for c in contenders:
        mine = [x for x in runs if x["contender"] == c.name]
        rates = [x["decode_tps"] for x in mine]
        summary[c.name] = {
            "tree": _label(c.tree),
            "every": c.every,
            "writes": not c.stub,
            "env": c.env,
            "decode_tps_median": round(statistics.median(rates), 2),
            "over_off": round(statistics.median(rates) / off_median, 3),
            "paired_over_off": [round(x["decode_tps"] / off[x["repeat"]], 3) for x in mine],
            "decode_tps": [round(x, 2) for x in rates],
            "loads": [x["load_before"] for x in mine],
        }
    return {
        "machine": f"{platform.machine()} {platform.system()}",
        "lane": "batch" if (max_batch or streams) > 1 else "serial",
        "max_batch": max_batch or streams,
        "streams": streams,
        "tokens_per_stream": tokens,
        "repeats": repeats,
        "reference": ref,
        "summary": summary,
        "answers_equal": len(digests) == 1
        and all(x["emitted"] == streams * tokens for x in runs),
        "runs": runs,
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    """One panel per ``compare`` result: each contender's runs (dots) and median (bar), its ratio to off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        names = list(res["summary"])
        for x, name in enumerate(names):
            entry = res["summary"][name]
            rates = entry["decode_tps"]
            ax.bar(x, entry["decode_tps_median"], color="#9ecae1" if entry["every"] else "#cccccc")
            ax.scatter([x] * len(rates), rates, color="#08519c", s=14, zorder=3)
            label = f"{entry['over_off']:.3f}x" if entry["every"] else "off"
            ax.annotate(label, (x, entry["decode_tps_median"]), textcoords="offset points",
                        xytext=(0, 4), ha="center", fontsize=9)
        ticks = [f"{n}\n{res['summary'][n]['tree']}"
                 + (f" /{res['summary'][n]['every']}" if res["summary"][n]["every"] else "")
                 + ("" if res["summary"][n]["writes"] else "\nno write")
                 for n in names]
        ax.set_xticks(range(len(names)), ticks, fontsize=8)
        loads = [r["load_before"] for r in res["runs"]]
        ax.set_title(f"{res['streams']} stream(s) x {res['tokens_per_stream']} tokens, "
                     f"{res['repeats']} repeats\nload {min(loads):.1f}-{max(loads):.1f}",
                     fontsize=9)
        ax.set_ylabel("aggregate decode tok/s")
    fig.suptitle("generation checkpoints: decode rate vs checkpoints off (median ratio)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--every", type=int, default=256, help="checkpoint interval for 'on'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--restart-every", type=int, default=0,
                        help="checkpoint interval of the restart run in tokens; 0 = one "
                             "checkpoint exactly at 75 %% of the answer")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-streams", type=int, default=0,
                        help="measure the batch lane with this many answers at once instead "
                             "(0 = the serial-lane figures)")
    parser.add_argument("--max-batch", type=int, default=0,
                        help="with --contenders: the engine's batch rows (0: --batch-streams; "
                             "e.g. 8 with --batch-streams 1 measures one answer on the batch "
                             "lane, as kvtier serve runs a lone client, not the serial lane)")
    parser.add_argument("--batch-tokens", type=int, default=600,
                        help="tokens each batch-lane answer decodes")
    parser.add_argument("--batch-every", default="256,512",
                        help="comma-separated checkpoint intervals in tokens, each compared "
                             "with checkpoints off")
    parser.add_argument("--contenders", default="",
                        help="comma-separated NAME=TREE:EVERY[:nowrite][:VAR=VALUE...] (TREE a "
                             "source tree, e.g. a git archive of a baseline commit; nowrite: the "
                             "checkpoint file write stubbed out; VAR=VALUE: the contender's "
                             "environment) compared with --batch-streams, each run in "
                             "its own process, interleaved; one must have EVERY 0")
    parser.add_argument("--lock", default="",
                        help="with --contenders: hold this flock file for one repeat at a time")
    parser.add_argument("--out", default="", help="also write the JSON to this file")
    parser.add_argument("--plot", default="",
                        help="with --contenders: a PNG of the result; with --plot-from: of those")
    parser.add_argument("--plot-from", default="",
                        help="comma-separated JSON files of --contenders runs: plot them side "
                             "by side to --plot and exit")
    parser.add_argument("--child-tree", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-nowrite", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child_tree:
        # NOTE: the child imports the engine from the tree it measures.
        sys.path.insert(0, str(Path(ns.child_tree).resolve()))
        if ns.child_nowrite:
            _stub_writes()
        child = anyio.run(_child_run, ns.batch_streams, ns.batch_tokens, ns.child_every, ns.model,
                          ns.max_batch)
        print(json.dumps(child))
        return 0
    if ns.plot_from:
        plot([json.loads(Path(p).read_text()) for p in ns.plot_from.split(",") if p], ns.plot)
        return 0
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    intervals = [int(x) for x in ns.batch_every.split(",") if x.strip()]
    if ns.contenders:
        if ns.batch_streams <= 0:
            parser.error("--contenders needs --batch-streams (1 runs the serial lane unless "
                         "--max-batch is above 1)")
        contenders = [_Contender(c) for c in ns.contenders.split(",") if c.strip()]
        out = compare(contenders, ns.batch_streams, ns.batch_tokens, ns.repeats, ns.model,
                      ns.lock, f"{ns.out}.runs" if ns.out else "", max_batch=ns.max_batch)
    elif ns.batch_streams > 0:
        out = anyio.run(bench_batch, ns.batch_streams, ns.batch_tokens, intervals, ns.repeats,
                        ns.model)
    else:
        out = anyio.run(bench, ns.tokens, ns.every, ns.repeats, ns.model, ns.restart_every)
    print(json.dumps(out, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=2) + "\n")
    if ns.plot and ns.contenders:
        plot([out], ns.plot)
    return 0 if out["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
