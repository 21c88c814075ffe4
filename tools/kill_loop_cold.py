"""Cold tier kill -9 loop: SIGKILL at random moments of write-behind and flush, restart, check.

Against a real ``kvtier serve`` running a tiny random-weight Llama (built
once into the work directory; a server starts in a few seconds), with one
SSD directory for the whole run:

0. A server without any cache (``--ssd-cache off --prompt-cache 0``) runs
   beside it and answers every prompt once, when the prompt is made: the
   reference greedy answers. Prompts come from conversations of up to
   ``turns`` turns; a turn's prompt is the previous turn's prompt, its
   reference answer and a new paragraph, so a later turn's entry supersedes
   the earlier one on disk. The pool grows all along.
1. Each cycle starts a server on the SSD directory (write-behind on) and
   checks it: every prompt acknowledged durable in the cycle just killed,
   and ``old`` drawn from earlier cycles, is served with ``cached_tokens >=
   prompt_tokens - 1`` by the SSD tier (shortest first, so the RAM tier,
   empty after the kill, cannot answer for the disk; ``/stats`` must count
   one SSD hit per check) and with its reference answer; ``spot``
   unacknowledged prompts must give their reference answers too (a
   half-written file is never served).
2. A work phase follows. It opens with a new prompt and a flush (no kill
   can come yet, so every cycle acknowledges something), then goes on with
   requests for random prompts of the pool, random pauses (write-behind
   snapshots and stores run in them) and now and then ``POST
   /admin/cache/flush``. A flush answered 200 with ``durable: true``
   acknowledges every prompt completed before it was sent. NOTE: before a
   flush the loop waits until the RAM tier has counted the put of every
   completed request (``/stats`` ``prompt_cache.puts``): the HTTP answer
   may arrive before the put, and a flush only covers puts it follows.
3. A timer SIGKILLs the server, and the next cycle starts on what the kill
   left. Cycles take turns in where they aim (``TARGETS``): a uniformly
   random moment of the work phase; a random moment within 50 ms of sending
   a request; within 100 ms of sending a flush; or 0.9-1.5 s after a
   request finished, when write-behind snapshots and stores it (its
   debounce is 1 s). The summary counts where each kill landed.

The summary (JSON on stdout) counts cycles, where the kills landed,
flushes that had to wait for a put (``late_puts``), acknowledged prefixes
checked, lost (not served from disk), corrupt (an answer other than the
reference), temp files the startup reaped (kills in the middle of a write)
and timings; exit code 0 when nothing was lost or
corrupt. ``docs/benchmarks.md`` ("Cold tier kill -9 loop") has a result.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        nice -n 19 .venv/bin/python tools/kill_loop_cold.py --cycles 1000
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools._serve_child import Server  # noqa: E402

__all__ = ["Pool", "Prompt", "Summary", "run", "write_tiny_model"]

# NOTE: weights scaled x2: the plain random init answers every prompt with
# one repeated character; scaled, answers differ per prompt and change when
# the KV does, which is what makes "same answer as without a cache" a check.
_SEED = 0
_SCALE = 2.0


def write_tiny_model(directory: Path) -> Path:
    """Save a tiny random-weight Llama with the test suite's tiny tokenizer to ``directory``.

    Seeded and deterministic: the same directory content every time.
    Greedy answers of this model were checked to be the same whether a
    prompt is computed at once or after a cached prefix (fp32).
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import save_config, save_model

    from tests.tiny_models import tiny_llama, tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").exists():
        return directory
    tok = tiny_tokenizer()
    vocab = len(tok._tokenizer)
    model = tiny_llama(seed=_SEED, vocab_size=vocab)
    model.update(tree_map(lambda p: p * _SCALE, model.parameters()))
    mx.eval(model.parameters())
    save_model(directory, model)
    tok._tokenizer.save_pretrained(str(directory))
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    }  # fmt: skip
    save_config(config, directory / "config.json")
    return directory


@dataclass(frozen=True)
class Prompt:
    """One prompt of the pool with its reference (cache-less) greedy answer."""

    text: str
    prompt_tokens: int
    answer: str


@dataclass
class Summary:
    """What the loop saw (the JSON it prints)."""

    cycles: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    acknowledged: int = 0
    acknowledged_checks: int = 0
    lost: int = 0
    corrupt: int = 0
    spot_checks: int = 0
    not_from_disk: int = 0
    flushes_durable: int = 0
    flushes_not_durable: int = 0
    requests: int = 0
    late_puts: int = 0
    orphans_reaped: int = 0
    corrupt_removed: int = 0
    failures: list[str] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    flush_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing acknowledged lost, nothing corrupt served, every check ran."""
        return not (self.lost or self.corrupt or self.not_from_disk or self.failures)

    def report(self) -> dict[str, Any]:
        """JSON-ready: counters, timings as median and maximum, the first failures."""
        out = asdict(self)
        out["kills"] = dict(self.kills)
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


def _stats(http: httpx.Client, url: str) -> dict[str, Any]:
    r = http.get(f"{url}/stats")
    r.raise_for_status()
    engine: dict[str, Any] = r.json()["engine"]
    return engine


_WORDS = (
    "wind", "lamp", "oil", "reef", "gulls", "fog", "tide", "ship", "bell", "cliff", "rain",
    "keeper", "lens", "storm", "north", "dusk", "harbour", "signal", "rope", "log",
)  # fmt: skip


def _paragraph(rng: random.Random, chain: int, turn: int) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(25, 45)))
    return f"\n[{chain}.{turn}] {words}.\n"


class Pool:
    """Prompts and their reference answers, from a server without any cache that runs all along.

    The pool grows: a new prompt is the next turn of an open conversation
    (its last prompt, that prompt's reference answer and a new paragraph),
    or the first turn of a new one once every conversation has ``turns``
    turns or by chance.
    """

    def __init__(
        self, http: httpx.Client, reference: Server, *, turns: int, max_tokens: int, seed: int
    ) -> None:
        self._http = http
        self._reference = reference
        self._turns = turns
        self._max_tokens = max_tokens
        self._rng = random.Random(seed)
        self.prompts: list[Prompt] = []
        self._open: list[list[int]] = []
        self._chains = 0

    def new(self) -> int:
        """Add a prompt (answered by the reference server); its index."""
        rng = self._rng
        self._open = [c for c in self._open if len(c) < self._turns]
        if self._open and rng.random() < 0.75:
            chain = rng.choice(self._open)
            last = self.prompts[chain[-1]]
            text = last.text + last.answer + _paragraph(rng, len(self._open), len(chain))
        else:
            chain = []
            self._open.append(chain)
            self._chains += 1
            text = f"Keeper's log, book {self._chains}." + _paragraph(rng, self._chains, 0)
        done = _complete(self._http, self._reference.url, text, self._max_tokens)
        if done["usage"]["prompt_tokens_details"]["cached_tokens"]:
            raise RuntimeError("the reference server reused a cache")
        self.prompts.append(
            Prompt(text, done["usage"]["prompt_tokens"], done["choices"][0]["text"])
        )
        chain.append(len(self.prompts) - 1)
        return len(self.prompts) - 1

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


TARGETS = ("any", "request", "flush", "write-behind")
"""Where a cycle aims its kill: ``any`` moment of the work phase, or a random moment soon
after a request or a flush is sent, or about when write-behind snapshots a finished request
(its debounce is 1 s)."""


class _Killer:
    """SIGKILLs ``server`` once armed and its delay passed; ``phase`` says what the loop was
    doing at that moment. Nothing arms it before :meth:`start`. Then a cycle aimed at ``any``
    moment arms it at once with a random delay; one aimed at an event arms it when the event
    happens, or at once when no such event came within ``fallback_s``."""

    def __init__(
        self, server: Server, target: str, rng: random.Random, *, any_max_s: float
    ) -> None:
        self.server = server
        self.target = target
        self.phase = "pause"
        self.fired_in: str | None = None
        self._rng = rng
        self._any_max_s = any_max_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._started_at: float | None = None

    def start(self) -> None:
        """From now on the kill may be armed."""
        with self._lock:
            self._started_at = time.monotonic()
            if self.target == "any":
                self._arm(self._rng.uniform(0.0, self._any_max_s))

    def _arm(self, delay: float) -> None:
        if self._timer is None:
            self._timer = threading.Timer(delay, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def doing(self, phase: str, *, fallback_s: float = 10.0) -> None:
        """The loop starts ``phase`` (``request``, ``flush``, ``pause``, or ``done`` after a
        request)."""
        with self._lock:
            self.phase = "pause" if phase == "done" else phase
            if self._started_at is None:
                return
            if self.target == "request" and phase == "request":
                self._arm(self._rng.uniform(0.0, 0.05))
            elif self.target == "flush" and phase == "flush":
                self._arm(self._rng.uniform(0.0, 0.1))
            elif self.target == "write-behind" and phase == "done":
                self._arm(self._rng.uniform(0.9, 1.5))
            elif time.monotonic() - self._started_at > fallback_s:
                self._arm(0.0)

    def _fire(self) -> None:
        with self._lock:
            if self.server.alive():
                self.fired_in = self.phase
                self.server.proc.send_signal(signal.SIGKILL)

    def wait(self) -> str | None:
        """Wait for the kill (and the process's end); where it landed (``None``: the server
        had already died on its own)."""
        with self._lock:
            self._arm(0.0)
        assert self._timer is not None
        self._timer.join()
        self.server.kill()
        return self.fired_in


def _check(
    http: httpx.Client,
    server: Server,
    pool: Pool,
    acked: dict[int, int],
    cycle: int,
    *,
    old: int,
    spot: int,
    rng: random.Random,
    max_tokens: int,
    summary: Summary,
    completed: list[int],
) -> None:
    """Check a server that started on what a kill left (see the module docstring).

    ``acked``: prompt -> the cycle whose flush acknowledged it. Every prompt
    acknowledged in the cycle just killed is checked, and ``old`` more drawn
    from earlier cycles (each was checked right after the kill that followed
    its acknowledgement); ``spot`` unacknowledged prompts are checked for
    their answers only.
    """
    stats = _stats(http, server.url)
    ssd = stats.get("ssd_cache") or {}
    summary.orphans_reaped += int(ssd.get("orphans_reaped", 0))
    summary.corrupt_removed += int(ssd.get("corrupt_removed", 0))
    if ssd.get("corrupt_removed"):
        summary.failures.append(f"cycle {cycle}: the startup removed corrupt files after a kill")
    hits_before = int(ssd.get("hits", 0))
    fresh = [i for i, at in acked.items() if at == cycle - 1]
    earlier = [i for i, at in acked.items() if at < cycle - 1]
    chosen = fresh + rng.sample(earlier, min(old, len(earlier)))
    # NOTE: shortest first: a longer prompt of the same conversation checked
    # earlier would leave a RAM entry that serves a shorter one without the disk.
    chosen.sort(key=lambda i: len(pool[i].text))
    for i in chosen:
        p = pool[i]
        done = _complete(http, server.url, p.text, max_tokens)
        completed.append(i)
        summary.acknowledged_checks += 1
        cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached < p.prompt_tokens - 1:
            summary.lost += 1
            summary.failures.append(
                f"cycle {cycle}: acknowledged prompt {i} served {cached} of {p.prompt_tokens}"
            )
        if done["choices"][0]["text"] != p.answer:
            summary.corrupt += 1
            summary.failures.append(f"cycle {cycle}: prompt {i} answered differently")
    if chosen:
        hits = int((_stats(http, server.url).get("ssd_cache") or {}).get("hits", 0))
        if hits - hits_before != len(chosen):
            summary.not_from_disk += len(chosen) - (hits - hits_before)
            summary.failures.append(
                f"cycle {cycle}: {hits - hits_before} SSD hits for {len(chosen)} checks"
            )
    others = [i for i in range(len(pool)) if i not in acked]
    for i in rng.sample(others, min(spot, len(others))):
        done = _complete(http, server.url, pool[i].text, max_tokens)
        completed.append(i)
        summary.spot_checks += 1
        if done["choices"][0]["text"] != pool[i].answer:
            summary.corrupt += 1
            summary.failures.append(f"cycle {cycle}: spot prompt {i} answered differently")


def _wait_puts(http: httpx.Client, url: str, completed: int, timeout: float = 10.0) -> bool:
    """Wait until the RAM tier has counted ``completed`` puts (see the module docstring);
    whether it had to wait (a put still in flight after its request's answer)."""
    deadline = time.monotonic() + timeout
    waited = False
    while True:
        puts = int(_stats(http, url)["prompt_cache"]["puts"])
        if puts >= completed:
            return waited
        if time.monotonic() > deadline:
            raise RuntimeError(f"{completed} requests completed, {puts} puts")
        waited = True
        time.sleep(0.01)


def _flush(
    http: httpx.Client,
    server: Server,
    acked: dict[int, int],
    cycle: int,
    summary: Summary,
    completed: list[int],
    killer: _Killer | None = None,
) -> None:
    """One flush; a durable one acknowledges every prompt completed before it."""
    if killer is not None:
        killer.doing("pause")
    summary.late_puts += _wait_puts(http, server.url, len(completed))
    covered = set(completed)
    if killer is not None:
        killer.doing("flush")
    began = time.perf_counter()
    r = http.post(f"{server.url}/admin/cache/flush", headers={"content-type": "application/json"})
    if killer is not None:
        killer.doing("pause")
    summary.flush_ms.append((time.perf_counter() - began) * 1e3)
    if r.status_code == 200 and r.json().get("durable") is True:
        summary.flushes_durable += 1
        for i in covered:
            acked.setdefault(i, cycle)
    else:
        summary.flushes_not_durable += 1


def _work(
    http: httpx.Client,
    server: Server,
    killer: _Killer,
    pool: Pool,
    acked: dict[int, int],
    cycle: int,
    *,
    rng: random.Random,
    max_tokens: int,
    summary: Summary,
    completed: list[int],
) -> None:
    """Requests, pauses and flushes until the killer fires (see the module docstring).

    NOTE: it opens with a new prompt and a flush before the killer may be armed, so every
    cycle acknowledges something (unless that flush is not durable) whatever the timing.
    """
    i = pool.new()
    _complete(http, server.url, pool[i].text, max_tokens)
    summary.requests += 1
    completed.append(i)
    _flush(http, server, acked, cycle, summary, completed)
    killer.start()
    while killer.fired_in is None and server.alive():
        roll = rng.random()
        try:
            if roll < 0.5:
                # NOTE: half new prompts (the pool grows), half old ones.
                i = pool.new() if rng.random() < 0.5 or not len(pool) else rng.randrange(len(pool))
                killer.doing("request")
                done = _complete(http, server.url, pool[i].text, max_tokens)
                killer.doing("done")
                summary.requests += 1
                completed.append(i)
                if done["choices"][0]["text"] != pool[i].answer:
                    summary.corrupt += 1
                    summary.failures.append(f"cycle {cycle}: prompt {i} answered differently")
            elif roll < 0.75:
                killer.doing("pause")
                time.sleep(rng.uniform(0.0, 1.0))
            else:
                _flush(http, server, acked, cycle, summary, completed, killer)
        except (httpx.TransportError, httpx.HTTPStatusError):
            if killer.fired_in is None and server.alive():
                raise
            return


def run(
    cycles: int,
    workdir: Path,
    *,
    turns: int = 5,
    max_tokens: int = 8,
    old: int = 4,
    spot: int = 2,
    kill_max_s: float = 3.0,
    seed: int = 0,
    log: Any = None,
    progress: Path | None = None,
) -> Summary:
    """Run ``cycles`` start/check/work/kill cycles with the SSD tier in ``workdir / "kv"``.

    ``progress``: a file rewritten with the summary's JSON after every cycle.
    """
    rng = random.Random(seed)
    model = write_tiny_model(workdir / "model")
    summary = Summary()
    # NOTE: --ssd-restore always: the checks ask what is on disk, so a hit
    # must be read even where the estimator would advise recomputing it.
    args = ["--model", str(model), "--ssd-cache", str(workdir / "kv"), "--ssd-writebehind", "on",
            "--ssd-restore", "always", "--admin-loopback", "on"]
    acked: dict[int, int] = {}
    serve_dir, ref_dir = workdir / "serve", workdir / "reference"
    serve_dir.mkdir(exist_ok=True)
    ref_dir.mkdir(exist_ok=True)
    reference = Server(
        ref_dir, ["--model", str(model), "--ssd-cache", "off", "--prompt-cache", "0"]
    )
    try:
        with httpx.Client(timeout=300) as http:
            pool = Pool(http, reference, turns=turns, max_tokens=max_tokens, seed=seed)
            for cycle in range(cycles + 1):
                server = Server(serve_dir, args)
                try:
                    summary.start_s.append(server.start_s)
                    # NOTE: every request this server completed, checks included (one put each).
                    completed: list[int] = []
                    _check(http, server, pool, acked, cycle, old=old, spot=spot, rng=rng,
                           max_tokens=max_tokens, summary=summary, completed=completed)  # fmt: skip
                    if cycle == cycles:
                        break
                    target = TARGETS[cycle % len(TARGETS)]
                    killer = _Killer(server, target, rng, any_max_s=kill_max_s)
                    _work(http, server, killer, pool, acked, cycle, rng=rng,
                          max_tokens=max_tokens, summary=summary, completed=completed)  # fmt: skip
                    landed = killer.wait()
                    if landed is None:
                        summary.failures.append(f"cycle {cycle}: the server died before the kill")
                        landed = "died"
                    summary.kills[f"{target}: {landed}"] += 1
                    summary.cycles += 1
                    summary.acknowledged = len(acked)
                    if progress is not None:
                        progress.write_text(json.dumps(summary.report(), indent=2))
                    if log is not None:
                        print(
                            f"cycle {cycle + 1}/{cycles}: prompts {len(pool)}, acknowledged "
                            f"{len(acked)}, checks {summary.acknowledged_checks}, lost "
                            f"{summary.lost}, corrupt {summary.corrupt}, failures "
                            f"{len(summary.failures)}",
                            file=log,
                            flush=True,
                        )
                finally:
                    server.kill()
    finally:
        reference.stop()
    summary.acknowledged = len(acked)
    return summary


def main() -> int:
    """Run the loop; print the summary as JSON; exit 0 when nothing was lost or corrupt."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--old", type=int, default=4,
                        help="prompts acknowledged in earlier cycles checked per cycle")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--spot", type=int, default=2, help="unacknowledged prompts checked")
    parser.add_argument("--kill-max-s", type=float, default=3.0, help="latest kill in a cycle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", type=Path, default=None,
                        help="a file rewritten with the summary after every cycle")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None,
                        help="model, SSD tier and logs (default: a temp directory)")  # fmt: skip
    ns = parser.parse_args()
    began = time.monotonic()

    def go(workdir: Path) -> Summary:
        return run(ns.cycles, workdir, turns=ns.turns, max_tokens=ns.max_tokens, old=ns.old,
                   spot=ns.spot, kill_max_s=ns.kill_max_s, seed=ns.seed,
                   log=sys.stderr, progress=ns.progress)  # fmt: skip

    if ns.workdir is not None:
        summary = go(ns.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-kill-loop-cold-") as tmp:
            summary = go(Path(tmp))
    report = summary.report()
    report["wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
