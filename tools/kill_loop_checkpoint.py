"""Generation-checkpoint kill loop: SIGKILL a long answer after its first checkpoint, restart, ask again.

Against a real ``kvtier serve`` on loopback (the default model unless
``--model``), one SSD directory for the whole run, checkpoints every
``--every`` emitted tokens:

1. a reference server without checkpoints answers the request once,
   uninterrupted (``--max-tokens`` tokens, greedy, or sampled with
   ``--temperature`` and ``--seed``);
2. each cycle streams the identical request from a fresh server and, after
   a random number of streamed chunks past the first checkpoint, kills the
   server with SIGKILL (no shutdown, no flush);
3. a new server starts on the same directory and answers the identical
   request (not streamed): its text and token count must equal the
   reference. ``/stats`` says whether it resumed a checkpoint (and how
   many tokens it replayed) or ran fresh (the kill came before any
   checkpoint was durable).

A completed answer removes its checkpoints, so every cycle starts from an
empty checkpoint directory.

``--progress FILE`` makes one recorded run span several sittings: after
every cycle the file is replaced (write, fsync, rename) with the summary so
far, the loop's random state and the reference answer; started again with
the same file (and the same ``--workdir``-independent settings), the loop
answers the reference again, refuses to go on unless it equals the stored
one and the settings and commit are the same, and continues the count
where it stopped (``--cycles`` is the run's total).

Every cycle starts new server processes from this tree: run the loop from
a frozen copy (``git archive HEAD | tar -x -C DIR && git rev-parse --short
HEAD > DIR/.archived-commit``, then run DIR's tool with this checkout's
venv), never from a checkout that others edit while it runs, or a restart
may load half-edited code. The summary records the commit and whether the
tree held uncommitted changes to code (``tree_dirty``; a frozen copy is
clean by construction). The summary (JSON on stdout) counts cycles,
equal and different answers, resumed cycles and tokens saved; the exit code
is 0 when every answer was equal.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/kill_loop_checkpoint.py --cycles 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
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

__all__ = ["PROMPT", "ProgressMismatch", "Summary", "run"]

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
          "bottle, describing every day of the following month, the weather, the ships, "
          "and the letters the keeper writes back.\n\nChapter 1.")


@dataclass
class Summary:
    """What the loop saw (the JSON it prints)."""

    cycles: int = 0
    equal: int = 0
    different: int = 0
    resumed: int = 0
    fresh: int = 0
    tokens_saved: int = 0
    deltas: int = 0
    """Checkpoint files the restarted servers wrote as deltas (``KVTIER_CHECKPOINT_DELTA``)."""
    reference_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    kill_at_chunks: list[int] = field(default_factory=list)
    answer_s: list[float] = field(default_factory=list)
    commit: str | None = None
    tree_dirty: bool | None = None

    @property
    def ok(self) -> bool:
        """Every restarted answer equal to the reference."""
        return not self.failures and self.different == 0

    def report(self) -> dict[str, Any]:
        """The summary as JSON-ready data."""
        out = asdict(self)
        kills, times = out.pop("kill_at_chunks"), out.pop("answer_s")
        out["kill_at_chunks_min"] = min(kills) if kills else None
        out["kill_at_chunks_max"] = max(kills) if kills else None
        out["answer_s_median"] = round(statistics.median(times), 3) if times else None
        out["failures"] = self.failures[:20]
        out["ok"] = self.ok
        return out


def _provenance(root: Path) -> tuple[str | None, bool | None]:
    """The tree's commit and whether its code differs from it (``None``: not a git checkout)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                 "actors", "kernels", "messages"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        archived = root / ".archived-commit"
        if archived.is_file():
            return archived.read_text().strip()[:40] or None, False
        return None, None
    return commit, bool(status.strip())


def _body(max_tokens: int, temperature: float, seed: int | None, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": max_tokens,
                            "temperature": temperature, "stream": stream}
    if seed is not None:
        body["seed"] = seed
    return body


def _answer(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, int]:
    r = http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    done = r.json()
    return str(done["choices"][0]["text"]), int(done["usage"]["completion_tokens"])


def _stream_until(http: httpx.Client, url: str, body: dict[str, Any], chunks: int) -> int:
    """Stream the request until ``chunks`` text chunks arrived (or it ended); chunks seen."""
    seen = 0
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("choices") and event["choices"][0].get("text"):
                seen += 1
                if seen >= chunks:
                    break
    return seen


def _checkpoints(http: httpx.Client, url: str) -> dict[str, Any]:
    section: dict[str, Any] = http.get(f"{url}/stats").json()["engine"]["generation_checkpoints"]
    return section


class ProgressMismatch(RuntimeError):
    """A progress file written by a run with other settings, another commit or another reference answer."""


def _settings(every: int, max_tokens: int, temperature: float, seed: int | None,
              rng_seed: int, serve_args: tuple[str, ...]) -> dict[str, Any]:
    return {"every": every, "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed, "rng_seed": rng_seed, "serve_args": list(serve_args)}


def _save_progress(path: Path, summary: Summary, rng: random.Random,
                   settings: dict[str, Any], expected: tuple[str, int]) -> None:
    """Replace ``path`` with the run so far: written and fsynced beside it, then renamed over it."""
    version, internal, gauss = rng.getstate()
    state = {"settings": settings, "expected": list(expected), "summary": asdict(summary),
             "rng": [version, list(internal), gauss]}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_progress(path: Path, settings: dict[str, Any],
                   summary: Summary) -> tuple[Summary, random.Random, tuple[str, int]] | None:
    """The run ``path`` holds, checked against this run's settings and commit (``None``: no file yet)."""
    if not path.is_file():
        return None
    state = json.loads(path.read_text(encoding="utf-8"))
    if state.get("settings") != settings:
        raise ProgressMismatch(f"{path} was written with {state.get('settings')}, not {settings}")
    stored = Summary(**state["summary"])
    if (stored.commit, stored.tree_dirty) != (summary.commit, summary.tree_dirty):
        raise ProgressMismatch(f"{path} was written by commit {stored.commit} "
                               f"(dirty {stored.tree_dirty}), this tree is {summary.commit} "
                               f"(dirty {summary.tree_dirty})")
    version, internal, gauss = state["rng"]
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    text, tokens = state["expected"]
    return stored, rng, (str(text), int(tokens))


def run(cycles: int, workdir: Path, *, every: int = 64, max_tokens: int = 400,
        temperature: float = 0.0, seed: int | None = None, rng_seed: int = 0,
        serve_args: tuple[str, ...] = (), log: Any = None,
        progress: Path | None = None) -> Summary:
    """Run stream/kill/restart cycles with the SSD tier in ``workdir / "kv"`` until ``cycles`` in all.

    ``progress``: the run's state after every cycle, and where a run
    started again with the same file continues (module docstring).
    """
    if max_tokens <= every + 2:
        raise ValueError("max_tokens must leave room past the first checkpoint")
    summary = Summary()
    summary.commit, summary.tree_dirty = _provenance(REPO)
    rng = random.Random(rng_seed)
    settings = _settings(every, max_tokens, temperature, seed, rng_seed, serve_args)
    resumed = _load_progress(progress, settings, summary) if progress is not None else None
    args = ["--ssd-cache", str(workdir / "kv"), "--ssd-writebehind", "off",
            "--generation-checkpoint", str(every), "--max-batch", "1", *serve_args]
    with httpx.Client(timeout=600) as http:
        ref = Server(workdir, ["--ssd-cache", "off", "--max-batch", "1", *serve_args],
                     append_stderr=True)
        try:
            expected = _answer(http, ref.url, _body(max_tokens, temperature, seed, stream=False))
        finally:
            ref.kill()
        if resumed is not None:
            summary, rng, stored = resumed
            if expected != stored:
                raise ProgressMismatch(
                    f"the reference answer ({expected[1]} tokens) differs from the one in "
                    f"{progress} ({stored[1]} tokens)")
        summary.reference_tokens = expected[1]
        if expected[1] <= every + 1:
            raise RuntimeError(f"the reference answer has only {expected[1]} tokens")
        server = Server(workdir, args, append_stderr=True)
        try:
            for cycle in range(summary.cycles, cycles):
                # NOTE: past the first checkpoint, before the answer's end.
                target = rng.randint(every + 1, expected[1] - 1)
                summary.kill_at_chunks.append(target)
                _stream_until(http, server.url, _body(max_tokens, temperature, seed, stream=True),
                              target)
                server.kill()
                server = Server(workdir, args, append_stderr=True)
                began = time.perf_counter()
                got = _answer(http, server.url, _body(max_tokens, temperature, seed, stream=False))
                summary.answer_s.append(time.perf_counter() - began)
                section = _checkpoints(http, server.url)
                summary.cycles += 1
                summary.deltas += int(section.get("deltas", 0))
                if got == expected:
                    summary.equal += 1
                else:
                    summary.different += 1
                    at = next((i for i, (a, b) in enumerate(zip(got[0], expected[0], strict=False))
                               if a != b), min(len(got[0]), len(expected[0])))
                    summary.failures.append(
                        f"cycle {cycle}: killed at {target} chunks, answer of {got[1]} tokens "
                        f"differs from character {at} on; resumed {section['resumed']} "
                        f"({section['tokens_saved']} tokens replayed): "
                        f"{got[0][max(0, at - 20):at + 40]!r} vs "
                        f"{expected[0][max(0, at - 20):at + 40]!r}")
                if section["resumed"]:
                    summary.resumed += 1
                    summary.tokens_saved += int(section["tokens_saved"])
                else:
                    summary.fresh += 1
                if progress is not None:
                    _save_progress(progress, summary, rng, settings, expected)
                if log is not None:
                    print(f"cycle {cycle + 1}/{cycles}: killed at {target}, equal "
                          f"{summary.equal}, resumed {summary.resumed}", file=log, flush=True)
        finally:
            server.kill()
    return summary


def main() -> int:
    """Run the loop; print the summary as JSON; exit 0 when every answer was equal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--every", type=int, default=64, help="--generation-checkpoint N")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=None, help="kvtier serve --model (default model)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the SSD tier and logs go (default: a temp directory)")
    parser.add_argument("--progress", type=Path, default=None,
                        help="the run's state after every cycle; started again with the same "
                             "file, the run continues where it stopped")
    parser.add_argument("--rng-seed", type=int, default=0,
                        help="seed of the kill points")
    ns = parser.parse_args()
    extra: tuple[str, ...] = ("--model", ns.model) if ns.model else ()
    began = time.monotonic()
    kwargs: dict[str, Any] = {"every": ns.every, "max_tokens": ns.max_tokens,
                              "temperature": ns.temperature, "seed": ns.seed,
                              "serve_args": extra, "log": sys.stderr,
                              "rng_seed": ns.rng_seed, "progress": ns.progress}
    if ns.workdir is not None:
        ns.workdir.mkdir(parents=True, exist_ok=True)
        summary = run(ns.cycles, ns.workdir, **kwargs)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-kill-ckpt-") as tmp:
            summary = run(ns.cycles, Path(tmp), **kwargs)
    report = summary.report()
    report["wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
