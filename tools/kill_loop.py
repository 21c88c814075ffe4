"""Durability kill loop: flush, SIGKILL at once, restart, and check that every flushed prefix survived.

Each cycle, against a real ``kvtier serve`` on loopback (the default model
unless ``--model``), with one SSD directory for the whole run:

1. the prompts flushed in the previous cycle are sent again: each must be
   served from the SSD tier (``cached_tokens >= prompt_tokens - 1``; the
   server's RAM tier is empty after the kill) with the same greedy answer
   as when it was first generated;
2. ``--prompts`` new prompts (unique to the cycle) are completed;
3. ``POST /admin/cache/flush`` must answer 200 with ``durable: true``;
4. the server is killed with SIGKILL right away (no shutdown, no flush of
   its own) and a new one starts on the same directory.

Write-behind is off (``--ssd-writebehind off``), so only the flush writes:
the check is that the flush's ``durable: true`` is a promise the disk
keeps. The summary (JSON on stdout) counts cycles, flushes, verified and
failed prefixes, and timings; the exit code is 0 when every check held.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/kill_loop.py --cycles 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools._serve_child import Server  # noqa: E402

__all__ = ["Prompt", "Summary", "run"]


@dataclass
class Prompt:
    """A flushed prompt and what it answered the first time."""

    text: str
    prompt_tokens: int
    answer: str


@dataclass
class Summary:
    """What the loop saw (the JSON it prints)."""

    cycles: int = 0
    flushes_durable: int = 0
    flushes_not_durable: int = 0
    prefixes_verified: int = 0
    prefixes_failed: int = 0
    failures: list[str] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    flush_ms: list[float] = field(default_factory=list)
    ssd_entries_last: int | None = None

    @property
    def ok(self) -> bool:
        """Every flush durable and every flushed prefix served from disk with its answer."""
        return not self.failures and self.flushes_not_durable == 0

    def report(self) -> dict[str, Any]:
        """The summary as JSON-ready data (timings as medians and maxima)."""
        out = asdict(self)
        for key in ("start_s", "flush_ms"):
            values = out.pop(key)
            out[f"{key}_median"] = round(statistics.median(values), 3) if values else None
            out[f"{key}_max"] = round(max(values), 3) if values else None
        out["failures"] = self.failures[:20]
        out["ok"] = self.ok
        return out


def _complete(http: httpx.Client, url: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0}
    r = http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


def _text(cycle: int, n: int) -> str:
    # NOTE: unique per cycle and prompt, long enough to be worth a file.
    return (f"Entry {cycle}.{n} of the keeper's log: the wind turned at dusk, the lamp was "
            f"trimmed twice, and ship number {cycle * 31 + n * 7} passed the northern reef "
            "before the fog came in over the cliffs. ") * 2


def run(cycles: int, workdir: Path, *, prompts: int = 2, max_tokens: int = 8,
        serve_args: tuple[str, ...] = (), log: Any = None) -> Summary:
    """Run ``cycles`` flush/kill/restart cycles with the SSD tier in ``workdir / "kv"``."""
    summary = Summary()
    args = ["--ssd-cache", str(workdir / "kv"), "--ssd-writebehind", "off",
            "--admin-loopback", "on", *serve_args]
    flushed: list[Prompt] = []
    with httpx.Client(timeout=300) as http:
        server = Server(workdir, args, append_stderr=True)
        try:
            for cycle in range(cycles):
                summary.start_s.append(server.start_s)
                _verify(http, server.url, flushed, max_tokens, summary, cycle)
                fresh: list[Prompt] = []
                for n in range(prompts):
                    text = _text(cycle, n)
                    done = _complete(http, server.url, text, max_tokens)
                    fresh.append(Prompt(text, done["usage"]["prompt_tokens"],
                                        done["choices"][0]["text"]))
                began = time.perf_counter()
                r = http.post(f"{server.url}/admin/cache/flush",
                              headers={"content-type": "application/json"})
                summary.flush_ms.append((time.perf_counter() - began) * 1e3)
                body = r.json()
                if r.status_code == 200 and body.get("durable") is True:
                    summary.flushes_durable += 1
                    summary.ssd_entries_last = body.get("entries")
                else:
                    summary.flushes_not_durable += 1
                    summary.failures.append(f"cycle {cycle}: flush {r.status_code} {body}")
                flushed = fresh
                server.kill()
                summary.cycles += 1
                if log is not None:
                    print(f"cycle {cycle + 1}/{cycles}: verified {summary.prefixes_verified}, "
                          f"failed {summary.prefixes_failed}", file=log, flush=True)
                server = Server(workdir, args, append_stderr=True)
            summary.start_s.append(server.start_s)
            _verify(http, server.url, flushed, max_tokens, summary, cycles)
        finally:
            server.kill()
    return summary


def _verify(http: httpx.Client, url: str, flushed: list[Prompt], max_tokens: int,
            summary: Summary, cycle: int) -> None:
    """Each prompt flushed before the kill is served from disk with its first answer."""
    for prompt in flushed:
        again = _complete(http, url, prompt.text, max_tokens)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        answer = again["choices"][0]["text"]
        if cached >= prompt.prompt_tokens - 1 and answer == prompt.answer:
            summary.prefixes_verified += 1
            continue
        summary.prefixes_failed += 1
        summary.failures.append(
            f"cycle {cycle}: cached {cached} of {prompt.prompt_tokens} prompt tokens, "
            f"answer {'same' if answer == prompt.answer else 'different'}")
    if flushed:
        stats = http.get(f"{url}/stats").json()["engine"]
        if stats["prompt_cache"]["hits"] != 0 or stats["ssd_cache"]["hits"] != len(flushed):
            summary.failures.append(
                f"cycle {cycle}: hits ram={stats['prompt_cache']['hits']} "
                f"ssd={stats['ssd_cache']['hits']}, expected ssd={len(flushed)}")


def main() -> int:
    """Run the loop; print the summary as JSON; exit 0 when every check held."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=2, help="new prompts per cycle")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="kvtier serve --model (default model)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the SSD tier and logs go (default: a temp directory)")
    ns = parser.parse_args()
    extra: tuple[str, ...] = ("--model", ns.model) if ns.model else ()
    began = time.monotonic()
    if ns.workdir is not None:
        ns.workdir.mkdir(parents=True, exist_ok=True)
        summary = run(ns.cycles, ns.workdir, prompts=ns.prompts, max_tokens=ns.max_tokens,
                      serve_args=extra, log=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-kill-loop-") as tmp:
            summary = run(ns.cycles, Path(tmp), prompts=ns.prompts, max_tokens=ns.max_tokens,
                          serve_args=extra, log=sys.stderr)
    report = summary.report()
    report["wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
