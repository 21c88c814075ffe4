"""SSD cold tier: TTFT across a restart, kvtier serve vs mlx_lm.server, side by side in one run.

Each round builds a fresh ~3.4k-token conversation (a long system prompt with
a per-round nonce, then user/assistant turns, greedy answers) and sends the
same turns to both servers, one server at a time (never together: the CPU is
shared). TTFT = streaming chat request sent -> first content chunk.

- cold:          turn 1, a prompt the server has never seen;
- RAM-warm:      turn 2 (turn 1 + its answer + a new question) right away;
- after restart: the server is stopped and started again, then turn 3.
  kvtier: ``POST /admin/cache/flush`` when the route exists, then SIGTERM
  (whose shutdown flushes too), restart on the same ``--ssd-cache``
  directory. mlx_lm.server keeps nothing, so turn 3 is cold again.
- after restart, page cache dropped (kvtier only): flush, stop,
  ``posix_fadvise(DONTNEED)`` on every ``.kvt`` file of the tier, start,
  turn 4: the restore reads from the disk, not from the OS page cache.

Every (re)started server first answers one short warm-up prompt of its own
(unique, so never a cache hit), so one-time costs of a fresh process are not
billed to the turn measured. kvtier's after-restart turns are checked to have
been served from disk (``/stats`` ``ssd_cache.hits``).

``--decode`` adds the write-behind check: decode tok/s of conversation turns
whose predecessor's put is being written behind (the client waits just past
the 1 s debounce before each turn), against the same turns with
``KVTIER_SSD_WRITEBEHIND=0``; servers interleaved per round.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/cold_tier.py [--rounds 3] [--decode] \\
        [--json out.json] [--io-json io.json] [--plot docs/benchmarks/cold_tier.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ChatResult,
    Server,
    loadavg,
    machine,
    model_id,
    start_kvtier,
    start_mlx_lm,
    stream_chat,
    system_prompt,
)

QUESTIONS = [
    "Summarize rule 3 in one sentence.",
    "What is rule 7 about?",
    "How do rules 3 and 7 relate?",
    "Which rule mentions a harbor?",
    "List two words from rule 12.",
    "What does rule 20 say?",
    "Is there a rule about copper?",
    "Name one rule that mentions a river.",
    "Which rule comes after rule 9?",
    "Quote the first words of rule 15.",
    "Does any rule mention a falcon?",
    "What is the shortest rule?",
    "Which rules mention quartz?",
    "Give rule 4 in your own words.",
    "What do rules 1 and 2 share?",
    "Is rule 30 about timber?",
]
SCENARIOS = ("cold", "ram_warm", "after_restart", "after_restart_dropped")
LABELS = {
    "cold": "cold",
    "ram_warm": "RAM-warm",
    "after_restart": "after restart",
    "after_restart_dropped": "after restart, page cache dropped",
}


class Conversation:
    """A chat: system prompt, then user/assistant turns; ``branch`` asks without extending it."""

    def __init__(self, system: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.asked = 0

    def _question(self) -> str:
        q = QUESTIONS[self.asked % len(QUESTIONS)]
        self.asked += 1
        return q

    def ask(self) -> list[dict[str, str]]:
        """The messages of the next turn (a new question appended)."""
        self.messages.append({"role": "user", "content": self._question()})
        return list(self.messages)

    def answer(self, text: str) -> None:
        """Record the assistant's answer to the last question."""
        self.messages.append({"role": "assistant", "content": text})

    def branch(self) -> list[dict[str, str]]:
        """The conversation so far plus a new question, leaving the conversation as it is.

        Every branch shares the same prefix (everything up to the last
        answer), so each one reuses the same cached tokens.
        """
        return [*self.messages, {"role": "user", "content": self._question()}]


def _stats(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/stats", timeout=30)
    r.raise_for_status()
    engine: dict[str, Any] = r.json()["engine"]
    return engine


def _warm_up(server: Server, model: str, tag: str) -> None:
    stream_chat(server.url, [{"role": "user", "content": f"Warm-up {tag}: say hello."}], model, 4)


def _flush(server: Server) -> dict[str, Any]:
    """``POST /admin/cache/flush`` when the server has it: its status, answer and seconds."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{server.url}/admin/cache/flush", timeout=600,
                       headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return {"route": False, "error": repr(exc)}
    took = time.perf_counter() - t0
    if r.status_code in (404, 405):
        return {"route": False, "status": r.status_code}
    body: Any
    try:
        body = r.json()
    except ValueError:
        body = r.text[:500]
    return {"route": True, "status": r.status_code, "seconds": took, "body": body}


def _stop(server: Server) -> tuple[float, int | None]:
    t0 = time.perf_counter()
    rc = server.stop(timeout=300)
    return time.perf_counter() - t0, rc


def _drop_page_cache(root: Path) -> int:
    """``posix_fadvise(DONTNEED)`` on every ``.kvt`` file under ``root``; bytes covered."""
    total = 0
    for path in root.rglob("*.kvt"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _turn(server: Server, model: str, conv: Conversation, answer_tokens: int) -> ChatResult:
    result = stream_chat(server.url, conv.ask(), model, answer_tokens)
    conv.answer(result.text)
    return result


def _record(result: ChatResult) -> dict[str, Any]:
    usage = result.usage or {}
    return {
        "ttft_s": result.ttft_s,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": result.cached_tokens,
    }


def _sample(server: Server, model: str, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
    result = stream_chat(server.url, messages, model, n)
    return {**_record(result), "load": loadavg()}


def kvtier_round(
    args: argparse.Namespace, work: Path, system: str, r: int, log: list[str]
) -> dict[str, Any]:
    """One round on kvtier serve.

    Start, warm-up, turn 1 (cold), one branch of turn 2 (RAM-warm), flush,
    stop. Then ``--restarts`` times: start, warm-up, a new branch of turn 2
    (after restart: served from the file), another new branch (RAM-warm:
    served from the restored entry in RAM), flush, stop. Last: drop the
    tier's files from the page cache, start, warm-up, a new branch (after
    restart, page cache dropped), stop. Every branch reuses the same prefix.
    """
    kv = work / "kvtier-kv"
    extra = ("--ssd-cache", str(kv), "--admin-loopback", "on")
    n = args.answer_tokens
    out: dict[str, Any] = {s: [] for s in SCENARIOS}
    out.update(flush=[], stop_s=[], stop_rc=[], ready_s=[])
    conv = Conversation(system)
    server = start_kvtier(args.model, work, *extra, name="kvtier")
    model = model_id(server.url)
    try:
        _warm_up(server, model, f"k{r}-{time.time_ns()}")
        first = stream_chat(server.url, conv.ask(), model, n)
        conv.answer(first.text)
        out["cold"].append({**_record(first), "load": loadavg()})
        out["ram_warm"].append(_sample(server, model, conv.branch(), n))
        out["flush"].append(_flush(server))
    finally:
        stop_s, rc = _stop(server)
        out["stop_s"].append(stop_s)
        out["stop_rc"].append(rc)
    plan = ["after_restart"] * args.restarts + ["after_restart_dropped"]
    for i, scenario in enumerate(plan):
        if scenario == "after_restart_dropped":
            out["dropped_bytes"] = _drop_page_cache(kv)
        server = start_kvtier(args.model, work, *extra, name="kvtier")
        out["ready_s"].append(server.ready_s)
        try:
            _warm_up(server, model, f"k{r}.{i}-{time.time_ns()}")
            hits = _stats(server)["ssd_cache"].get("hits", 0)
            sample = _sample(server, model, conv.branch(), n)
            after = _stats(server)["ssd_cache"]
            sample["served_by"] = "ssd" if after.get("hits", 0) > hits else "not ssd"
            sample["restore_ms_last"] = after.get("restore_ms_last")
            sample["ssd_bytes"] = after.get("bytes")
            out[scenario].append(sample)
            if scenario == "after_restart":
                warm = _sample(server, model, conv.branch(), n)
                ram_hits = _stats(server)["prompt_cache"]["hits"]
                warm["served_by"] = "ram" if ram_hits >= 1 else "not ram"
                out["ram_warm"].append(warm)
                out["flush"].append(_flush(server))
        finally:
            stop_s, rc = _stop(server)
            out["stop_s"].append(stop_s)
            out["stop_rc"].append(rc)
    log.append(
        f"kvtier round {r + 1}: "
        + "; ".join(
            f"{s} " + ", ".join(f"{x['ttft_s'] * 1e3:.0f}" for x in out[s]) + " ms"
            for s in SCENARIOS
        )
        + "; after-restart served by "
        + ",".join(x["served_by"] for x in out["after_restart"] + out["after_restart_dropped"])
        + f", {out['after_restart'][0]['cached_tokens']}/{out['after_restart'][0]['prompt_tokens']}"
        " tokens cached"
    )
    return out


def mlx_lm_round(
    args: argparse.Namespace, work: Path, system: str, r: int, log: list[str]
) -> dict[str, Any]:
    """One round on mlx_lm.server: turn 1 (cold), ``--restarts + 1`` branches of turn 2
    (RAM-warm), stop, start, one more branch (after restart: cold again, so only one)."""
    n = args.answer_tokens
    out: dict[str, Any] = {"cold": [], "ram_warm": [], "after_restart": [], "ready_s": []}
    conv = Conversation(system)
    model = str(args.model)
    server = start_mlx_lm(args.model, work)
    try:
        _warm_up(server, model, f"m{r}a-{time.time_ns()}")
        first = stream_chat(server.url, conv.ask(), model, n)
        conv.answer(first.text)
        out["cold"].append({**_record(first), "load": loadavg()})
        for _ in range(args.restarts + 1):
            out["ram_warm"].append(_sample(server, model, conv.branch(), n))
    finally:
        server.stop()
    server = start_mlx_lm(args.model, work)
    out["ready_s"].append(server.ready_s)
    try:
        _warm_up(server, model, f"m{r}b-{time.time_ns()}")
        out["after_restart"].append(_sample(server, model, conv.branch(), n))
    finally:
        server.stop()
    log.append(
        f"mlx_lm round {r + 1}: "
        + "; ".join(
            f"{s} " + ", ".join(f"{x['ttft_s'] * 1e3:.0f}" for x in out[s]) + " ms"
            for s in SCENARIOS
            if out.get(s)
        )
    )
    return out


def _writing(server: Server) -> tuple[int, int]:
    """(spills queued or being written, plus one while a file's bytes are reserved; files stored so far)."""
    ssd = _stats(server)["ssd_cache"]
    busy = int(ssd.get("pending_spills", 0) or 0) + (1 if ssd.get("reserved_bytes") else 0)
    return busy, int(ssd.get("spills", 0) or 0)


def _wait_for_write(server: Server, longest: float) -> tuple[float, int, int]:
    """Poll ``/stats`` every 20 ms until a write-behind store is in flight, at most ``longest`` s.

    Returns (seconds waited, in-flight count, files stored so far). With
    write-behind off nothing is ever in flight, so the wait is ``longest``.
    """
    t0 = time.perf_counter()
    while True:
        busy, spills = _writing(server)
        waited = time.perf_counter() - t0
        if busy or waited >= longest:
            return waited, busy, spills
        time.sleep(0.02)


def decode_round(
    args: argparse.Namespace, work: Path, r: int, mode: str, log: list[str]
) -> dict[str, Any]:
    """Decode tok/s of conversation turns with write-behind ``on`` or ``off``.

    Before each turn the client waits until the previous turn's put is being
    written behind (or ``--think`` seconds), then sends the next turn at
    once, so its decode runs while that store is in flight. A turn counts as
    overlapped when a store was in flight at its start or its end, or one
    was committed while it ran.
    """
    env = {"KVTIER_SSD_WRITEBEHIND": "1" if mode == "on" else "0"}
    server = start_kvtier(
        args.model,
        work,
        "--ssd-cache",
        str(work / f"decode-kv-{mode}"),
        name=f"decode-{mode}",
        env=env,
    )
    model = model_id(server.url)
    out: dict[str, Any] = {
        "tps": [],
        "overlapped": [],
        "waited_s": [],
        "load": loadavg(),
    }
    try:
        _warm_up(server, model, f"d{r}{mode}-{time.time_ns()}")
        conv = Conversation(system_prompt(args.decode_context, f"decode-{r}-{time.time_ns()}"))
        _turn(server, model, conv, args.decode_tokens)
        for _ in range(args.decode_turns):
            waited, busy_start, spills_start = _wait_for_write(server, args.think)
            result = _turn(server, model, conv, args.decode_tokens)
            busy_end, spills_end = _writing(server)
            out["tps"].append(result.decode_tps)
            out["waited_s"].append(waited)
            out["overlapped"].append(bool(busy_start or busy_end or spills_end > spills_start))
        ssd = _stats(server)["ssd_cache"]
        out["writebehind_written"] = ssd.get("writebehind_written")
        out["spills"] = ssd.get("spills")
    finally:
        server.stop(timeout=300)
    log.append(
        f"decode round {r + 1} write-behind {mode}: median {statistics.median(out['tps']):.2f} tok/s "
        f"over {len(out['tps'])} turns, {sum(out['overlapped'])} overlapped a store; "
        f"written {out['writebehind_written']}; load {out['load']}"
    )
    return out


def _ttfts(rd: dict[str, Any], scenario: str) -> list[float]:
    samples = rd.get(scenario) or []
    if isinstance(samples, dict):  # NOTE: the first runs kept one sample per scenario
        samples = [samples]
    return [float(x["ttft_s"]) for x in samples]


def _overlaps(rd: dict[str, Any]) -> list[bool]:
    if "overlapped" in rd:
        return [bool(x) for x in rd["overlapped"]]
    # NOTE: the first runs recorded only what was in flight at each turn's start.
    return [bool(x) for x in rd["pending_at_start"]]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians, spreads and the target ratios of a run's records."""
    summary: dict[str, Any] = {}
    for server in ("kvtier", "mlx_lm"):
        rounds = results.get(server) or []
        for s in SCENARIOS:
            xs = [x for rd in rounds for x in _ttfts(rd, s)]
            if xs:
                summary[f"{server}.{s}"] = {
                    "median": statistics.median(xs),
                    "min": min(xs),
                    "max": max(xs),
                    "runs": xs,
                }
    k = results.get("kvtier") or []
    if k:
        med = {s: summary[f"kvtier.{s}"]["median"] for s in SCENARIOS}

        def per_round(num: str, den: str) -> list[float]:
            return [
                statistics.median(_ttfts(rd, num)) / statistics.median(_ttfts(rd, den)) for rd in k
            ]

        # NOTE: each restart cycle measures an after-restart branch and a
        # RAM-warm branch back to back, under the same load: their ratio is
        # the least noisy figure on a shared machine.
        pairs = [
            a / b
            for rd in k
            for a, b in zip(_ttfts(rd, "after_restart"), _ttfts(rd, "ram_warm")[1:], strict=False)
        ]
        summary["ratio.restart_over_warm"] = {
            "median_of_medians": med["after_restart"] / med["ram_warm"],
            "per_round": per_round("after_restart", "ram_warm"),
            "pairs": pairs,
            "target": 1.3,
        }
        summary["ratio.restart_over_cold"] = {
            "median_of_medians": med["after_restart"] / med["cold"],
            "per_round": per_round("after_restart", "cold"),
            "target": 0.03,
        }
        summary["ratio.dropped_over_warm"] = {
            "median_of_medians": med["after_restart_dropped"] / med["ram_warm"],
            "per_round": per_round("after_restart_dropped", "ram_warm"),
        }
    d = results.get("decode")
    if d:
        on = [x for rd in d["on"] for x in rd["tps"]]
        off = [x for rd in d["off"] for x in rd["tps"]]
        summary["decode"] = {
            "on_median": statistics.median(on),
            "off_median": statistics.median(off),
            "on_range": [min(on), max(on)],
            "off_range": [min(off), max(off)],
            "ratio": statistics.median(on) / statistics.median(off),
            "per_round_ratio": [
                statistics.median(a["tps"]) / statistics.median(b["tps"])
                for a, b in zip(d["on"], d["off"], strict=True)
            ],
            "target": 0.98,
            "turns_with_writebehind_in_flight": sum(
                1 for rd in d["on"] for p in _overlaps(rd) if p
            ),
            "turns": len(on),
        }
        hit = [x for rd in d["on"] for x, p in zip(rd["tps"], _overlaps(rd), strict=True) if p]
        if hit:
            summary["decode"]["overlapped_median"] = statistics.median(hit)
            summary["decode"]["overlapped_ratio"] = statistics.median(hit) / statistics.median(off)
    return summary


def report(results: dict[str, Any], summary: dict[str, Any]) -> None:
    """Print the tables."""
    print(f"\n{results.get('rounds')} rounds; TTFT ms, median [min..max]")
    print(f"{'scenario':<36}{'kvtier serve':>28}{'mlx_lm.server':>28}")
    for s in SCENARIOS:
        row = f"{LABELS[s]:<36}"
        for server in ("kvtier", "mlx_lm"):
            f = summary.get(f"{server}.{s}")
            row += (
                f"{f['median'] * 1e3:>12.1f} [{f['min'] * 1e3:.0f}..{f['max'] * 1e3:.0f}]".rjust(28)
                if f
                else "-".rjust(28)
            )
        print(row)
    for key, label in (
        ("ratio.restart_over_warm", "kvtier after-restart / RAM-warm"),
        ("ratio.restart_over_cold", "kvtier after-restart / cold"),
        ("ratio.dropped_over_warm", "kvtier after-restart (page cache dropped) / RAM-warm"),
    ):
        if key in summary:
            f = summary[key]
            target = f.get("target")
            verdict = ""
            if target is not None:
                verdict = (
                    "  met" if f["median_of_medians"] <= target else "  MISSED"
                ) + f" (target <= {target})"
            print(
                f"{label:<54}{f['median_of_medians']:>8.4f}  per round "
                + ", ".join(f"{x:.4f}" for x in f["per_round"])
                + verdict
            )
            if f.get("pairs"):
                label = f"  back-to-back pairs (median {statistics.median(f['pairs']):.3f})"
                print(f"{label:<64}" + ", ".join(f"{x:.3f}" for x in f["pairs"]))
    if "mlx_lm.after_restart" in summary and "kvtier.after_restart" in summary:
        print(
            "kvtier / mlx_lm after restart: "
            f"{summary['kvtier.after_restart']['median'] / summary['mlx_lm.after_restart']['median']:.4f}"
        )
    if "decode" in summary:
        d = summary["decode"]
        print(
            f"decode tok/s, write-behind on {d['on_median']:.2f} [{d['on_range'][0]:.2f}..{d['on_range'][1]:.2f}]"
            f" vs off {d['off_median']:.2f} [{d['off_range'][0]:.2f}..{d['off_range'][1]:.2f}]: ratio "
            f"{d['ratio']:.3f} (per round "
            + ", ".join(f"{x:.3f}" for x in d["per_round_ratio"])
            + ")"
            + ("  met" if d["ratio"] >= d["target"] else "  MISSED")
            + f" (target >= {d['target']}); "
            f"{d['turns_with_writebehind_in_flight']}/{d['turns']} turns overlapped a store"
        )
        if "overlapped_ratio" in d:
            print(
                f"  turns that overlapped a store: median {d['overlapped_median']:.2f} tok/s, "
                f"ratio to all off turns {d['overlapped_ratio']:.3f}"
            )


def plot(
    results: dict[str, Any], summary: dict[str, Any], io: dict[str, Any] | None, path: Path
) -> None:
    """Bars with min..max whiskers: TTFT per scenario, file throughput vs dd, decode with write-behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + (io is not None) + ("decode" in summary)
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.6), squeeze=False)
    ax = axes[0][0]
    width = 0.38
    labels: list[tuple[float, float]] = []
    for j, (server, color) in enumerate((("kvtier", "#1f77b4"), ("mlx_lm", "#ff7f0e"))):
        xs, meds, lo, hi = [], [], [], []
        for i, s in enumerate(SCENARIOS):
            f = summary.get(f"{server}.{s}")
            if f:
                xs.append(i + (j - 0.5) * width)
                meds.append(f["median"] * 1e3)
                lo.append(f["median"] * 1e3 - f["min"] * 1e3)
                hi.append(f["max"] * 1e3 - f["median"] * 1e3)
        label = "kvtier serve" if server == "kvtier" else "mlx_lm.server"
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, color=color, label=label)
        for x, m in zip(xs, meds, strict=True):
            labels.append((x, m))
    ax.set_yscale("log")
    bottom = (
        min(f["min"] for key, f in summary.items() if key.count(".") == 1 and "min" in f) * 1e3 / 4
    )
    ax.set_ylim(bottom=bottom)
    for x, m in labels:
        y = (bottom * m) ** 0.5
        ax.text(x, y, f"{m:,.0f}", ha="center", va="center", fontsize=7, color="white", rotation=90)
    ax.set_xticks(range(len(SCENARIOS)))
    ax.set_xticklabels(
        ["cold", "RAM-warm", "after\nrestart", "after restart,\npage cache\ndropped"], fontsize=8
    )
    ax.set_ylabel("TTFT, ms (log scale)")
    ax.set_title(
        f"~3.4k-token conversation, {results.get('rounds')} rounds: median of all samples,"
        " whiskers min..max",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    k = 1
    if io is not None:
        ax = axes[0][k]
        k += 1
        pairs = [
            ("store\n(fsync)", "store", "dd_write"),
            ("restore\npage cache dropped", "restore_cold_verify_on", "dd_read_cold"),
            ("restore\nwarm", "restore_warm_verify_on", "dd_read_warm"),
        ]
        for j, (name, color) in enumerate((("kvtier codec", "#1f77b4"), ("dd", "#7f7f7f"))):
            xs, meds, lo, hi = [], [], [], []
            for i, (_, ours, theirs) in enumerate(pairs):
                v = io["gbps"][ours if j == 0 else theirs]
                m = statistics.median(v)
                xs.append(i + (j - 0.5) * width)
                meds.append(m)
                lo.append(m - min(v))
                hi.append(max(v) - m)
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, color=color, label=name)
            for x, m in zip(xs, meds, strict=True):
                ax.text(x, m + 0.05, f"{m:.2f}", ha="center", fontsize=7)
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([p[0] for p in pairs], fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"{io['file_bytes'] / 2**30:.2f} GiB bf16 entry vs dd, same file system", fontsize=9
        )
        ax.legend(fontsize=8)
    if "decode" in summary:
        ax = axes[0][k]
        d = results["decode"]
        data = [[x for rd in d["on"] for x in rd["tps"]], [x for rd in d["off"] for x in rd["tps"]]]
        ax.boxplot(data)
        ax.set_xticks([1, 2])
        ax.set_xticklabels(["write-behind on", "write-behind off"], fontsize=8)
        ax.set_ylabel("decode tok/s per turn")
        ax.set_title(
            f"decode while writing behind: ratio {summary['decode']['ratio']:.3f}", fontsize=9
        )
    ones = [float(x.split()[0]) for x in results["loads"]]
    fig.suptitle(
        f"kvtier SSD cold tier, {results['machine']['date']}, {results['machine']['cpus']} CPUs,"
        f" 1-min load average {min(ones):.1f}..{max(ones):.1f}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> int:
    """Run the rounds, print, optionally save JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model dir (default model if unset)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=2830,
        help="system prompt size; 2830 gives ~3.4k prompt tokens at the measured turns",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument(
        "--restarts", type=int, default=3, help="kvtier restart cycles per round (one sample each)"
    )
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument(
        "--decode", action="store_true", help="also run the write-behind decode check"
    )
    parser.add_argument("--decode-context", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-turns", type=int, default=8)
    parser.add_argument(
        "--think",
        type=float,
        default=3.0,
        help="longest wait before a decode turn for a write-behind store to be in flight (s)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="skip the run; report and plot these (merged: e.g. a TTFT run and a --decode run)",
    )
    parser.add_argument(
        "--io-json", type=Path, default=None, help="cold_tier_io.py figures for the plot"
    )
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()

    if args.from_json is not None:
        results: dict[str, Any] = {}
        for path in args.from_json:
            part = json.loads(path.read_text())
            loads = results.get("loads", []) + part.get("loads", [])
            results.update({k: v for k, v in part.items() if v or k not in results})
            results["loads"] = loads
    else:
        if args.model is None:
            from kernels import ensure_default_model

            args.model = ensure_default_model()
        results = {
            "machine": machine(),
            "rounds": args.rounds,
            "loads": [loadavg()],
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        print(f"model {args.model}; load average {results['loads'][0]}", flush=True)
        log: list[str] = []
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if not args.skip_ttft:
                results["kvtier"], results["mlx_lm"] = [], []
                for r in range(args.rounds):
                    system = system_prompt(args.tokens, f"round-{r}-{time.time_ns()}")
                    # NOTE: the order alternates per round so a load trend does not favour one server.
                    order = ("kvtier", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "kvtier")
                    for name in order:
                        if name == "kvtier":
                            results["kvtier"].append(kvtier_round(args, work, system, r, log))
                        elif not args.skip_mlx_lm:
                            results["mlx_lm"].append(mlx_lm_round(args, work, system, r, log))
                        print(log[-1] if log else "", flush=True)
                    results["loads"].append(loadavg())
            if args.decode:
                results["decode"] = {"on": [], "off": []}
                for r in range(args.rounds):
                    for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                        results["decode"][mode].append(decode_round(args, work, r, mode, log))
                        print(log[-1], flush=True)
                    results["loads"].append(loadavg())
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1))
    summary = summarize(results)
    report(results, summary)
    print(f"load averages: {' | '.join(results['loads'])}")
    if args.plot is not None:
        io = json.loads(args.io_json.read_text()) if args.io_json else None
        plot(results, summary, io, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
