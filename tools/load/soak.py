"""Soak: many clients doing what real clients do, at once, to one ``kvtier serve``, for a while.

Starts its own ``kvtier serve`` (the default model, the SSD tier in a
temporary directory, ``--max-batch`` rows, any ``--serve-arg``), then runs
``--clients`` clients for ``--seconds``; each loops over behaviours drawn at
random (seeded by ``--seed``):

- ``greedy``: one of ``--conversations`` fixed chats over one shared system
  prompt, temperature 0, streamed or not. Every answer to the same chat must
  be the same text, whatever else runs beside it (batch rows joining and
  leaving, prompt-cache hits, SSD restores, memory reliefs).
- ``agent``: a three-turn conversation over the same system prompt, sampled
  (seeded), each turn sent with the previous answer appended.
- ``cancel``: a stream closed after its first one to three chunks.
- ``stall``: a raw socket with a 4 KiB receive buffer and 536-byte segments
  asks for 200 tokens with ``top_logprobs`` 20 and ``ignore_eos`` (about
  2 KB a token, so the answer outgrows the socket and server buffers within
  seconds), reads the head, stops reading for ``--stall-s`` seconds, then
  reads the rest: the answer ends normally (``[DONE]``; ``stall.cut`` when
  its last event is an error), or the server's write deadline
  (``--stream-write-timeout``) aborts the connection mid-answer
  (``stall.write_deadline``, never more of them than the server logged).
- ``invalid``: a malformed request (bad JSON, a bad field, an unknown model,
  a prompt past the context): a 4xx with an OpenAI-style error body.
- ``logprobs``: a text completion with ``logprobs`` 3.
- ``json``: a chat answer constrained to a small JSON schema; one that
  finishes with ``stop`` must parse.
- ``choices``: a text completion of two fixed prompts with ``n`` 2, greedy,
  streamed or not (a streamed one closed after a few chunks now and then):
  four choices by index, equal within a prompt and to every earlier answer
  to that prompt.

Meanwhile ``/health`` is timed every half second and ``/stats`` read every
five (the process's resident memory). When the clients stop, the server
must come to rest within 30 s: no request in flight, no batch row, no held
stream, no prompt-cache lease, nothing queued. Its log must hold no
traceback and no error-level line.

Prints a JSON summary (outcomes per behaviour, violations, /health latency,
the answer times of greedy chats and agent turns, the server's per-request
timeline of streamed requests, RSS at the start, middle and end) and exits 1 when anything was violated.
``tools/bench/soak_compare.py`` plots the answer times of several summaries.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/load/soak.py --clients 12 --seconds 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tools._serve_child import Server  # noqa: E402

_WORDS = ("ledger", "harbor", "quartz", "meadow", "signal", "lantern", "copper", "orchard",
          "summit", "canyon", "beacon", "timber", "violet", "archive", "river", "policy")
SYSTEM = ("You are a careful assistant for a shipping company. Tools: "
          + " ".join(f"{w}_lookup(id) returns the {w} record;" for w in _WORDS) + " "
          + " ".join(_WORDS * 12))
"""The shared system prompt (~400 tokens)."""

BEHAVIOURS: dict[str, float] = {
    "greedy": 4.0, "agent": 2.0, "cancel": 1.0, "stall": 0.5, "invalid": 1.0,
    "logprobs": 1.0, "json": 0.5, "choices": 0.5,
}
"""Each behaviour's weight in a client's draw."""

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@dataclass
class Soak:
    """What the clients saw."""

    url: str
    conversations: int
    stall_s: float
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    answers: dict[int, str] = field(default_factory=dict)
    choice_answers: dict[int, str] = field(default_factory=dict)
    """The greedy answer of each ``choices`` prompt, as first seen."""
    health_ms: list[float] = field(default_factory=list)
    latency_ms: dict[str, list[float]] = field(default_factory=dict)
    """Each answered request's whole time, by kind (``greedy``, ``agent_turn``)."""
    timeline: dict[str, Any] = field(default_factory=dict)
    """``/stats`` ``http.timeline`` at the end: where streamed requests' time to first byte went."""
    rss: list[tuple[float, int]] = field(default_factory=list)

    def violate(self, what: str) -> None:
        """Record one violation (the first 50 kept in full)."""
        self.outcomes["violation"] += 1
        if len(self.violations) < 50:
            self.violations.append(what)


def _user(i: int) -> str:
    return f"Question {i}: which {_WORDS[i % len(_WORDS)]} record comes after {_WORDS[(3 * i) % 16]}?"


def _chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "default", "messages": messages, **extra}


async def _stream_text(client: httpx.AsyncClient, body: dict[str, Any],
                       path: str = "/v1/chat/completions") -> tuple[int, str, str | None, str | None]:
    """Stream ``body``: (status, text, finish reason, error message of an error event)."""
    text: list[str] = []
    finish: str | None = None
    error: str | None = None
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", None, r.text[:200]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = str(chunk["error"].get("message"))
                continue
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return 200, "".join(text), finish, error


async def greedy(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """A fixed chat, greedy: the same text every time."""
    i = rng.randrange(s.conversations)
    body = _chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(i)}],
                 temperature=0, max_tokens=24)
    began = time.perf_counter()
    if rng.random() < 0.5:
        status, text, finish, error = await _stream_text(client, body)
    else:
        r = await client.post("/v1/chat/completions", json=body)
        status, error = r.status_code, None
        text = r.json()["choices"][0]["message"]["content"] if status == 200 else ""
        finish = r.json()["choices"][0]["finish_reason"] if status == 200 else None
    if status != 200 or error is not None or finish not in ("stop", "length"):
        s.violate(f"greedy {i}: status {status}, finish {finish}, error {error}")
        return
    s.latency_ms.setdefault("greedy", []).append((time.perf_counter() - began) * 1e3)
    seen = s.answers.setdefault(i, text)
    if seen != text:
        s.violate(f"greedy {i}: answer {text!r} differs from {seen!r}")
        return
    s.outcomes["greedy.ok"] += 1


async def agent(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """Three turns over the shared system prompt, each with the answer before it."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(3):
        messages.append({"role": "user", "content": _user(rng.randrange(1000)) + f" (turn {turn})"})
        began = time.perf_counter()
        r = await client.post("/v1/chat/completions", json=_chat(
            messages, temperature=0.7, seed=rng.randrange(1 << 30), max_tokens=16))
        if r.status_code != 200:
            s.violate(f"agent turn {turn}: {r.status_code} {r.text[:400]}")
            return
        s.latency_ms.setdefault("agent_turn", []).append((time.perf_counter() - began) * 1e3)
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    s.outcomes["agent.ok"] += 1


async def cancel(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """A stream closed after one to three chunks."""
    body = _chat([{"role": "user", "content": _user(rng.randrange(1000))}], max_tokens=200,
                 stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            s.violate(f"cancel: {r.status_code}")
            return
        n = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if n >= rng.randint(1, 3):
                    break
    s.outcomes["cancel.ok"] += 1


async def stall(s: Soak, rng: random.Random) -> None:
    """A reader with a 4 KiB buffer that stops reading for a while mid-answer."""
    parts = urlsplit(s.url)
    body = json.dumps(_chat([{"role": "user", "content": _user(rng.randrange(1000))}],
                            max_tokens=200, stream=True, ignore_eos=True,
                            logprobs=True, top_logprobs=20)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # NOTE: loopback's 64 KiB segments let the server's send buffer grow to megabytes
    # (the whole answer): small segments keep it at tens of KiB, so a stall can fill it.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (parts.hostname or "127.0.0.1", parts.port or 80))
    # NOTE: a StreamReader reads ahead up to twice its limit before it stops taking
    # bytes: a small limit keeps the client's own buffer at a few KiB too.
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    began = time.monotonic()
    phase = "status line"
    chunks: list[bytes] = []
    reset = False
    try:
        writer.write(head + body)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 60)
        await asyncio.sleep(s.stall_s)
        phase = "end of the answer"
        async with asyncio.timeout(180):
            while chunk := await reader.read(1 << 16):
                chunks.append(chunk)
    except TimeoutError:
        s.violate(f"stall: no {phase} {time.monotonic() - began:.1f} s after the request")
        return
    except ConnectionResetError:
        # NOTE: the server's write deadline aborts the connection (no graceful close
        # while the client reads nothing): what arrived before it is all there is.
        reset = True
    finally:
        writer.close()
    text = b"".join(chunks).decode(errors="replace")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if b" 200 " not in status:
        s.violate(f"stall: {status!r}")
    elif events and events[-1] == "[DONE]":
        last = json.loads(events[-2]) if len(events) > 1 else {}
        s.outcomes["stall.cut" if "error" in last else "stall.done"] += 1
    else:
        # NOTE: an answer that ends without [DONE] (the connection reset or closed
        # mid-stream) must be the write deadline's abort: main() holds this count
        # against the server log's http.stream_write_timeout warnings.
        s.outcomes["stall.write_deadline"] += 1
        s.outcomes["stall.write_deadline.reset"] += int(reset)


INVALID: list[tuple[str, Any]] = [
    ("bad json", b"{not json"),
    ("negative max_tokens", _chat([{"role": "user", "content": "x"}], max_tokens=-1)),
    ("unknown role", {"model": "default", "messages": [{"role": "wizard", "content": "x"}]}),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    ("empty messages", {"model": "default", "messages": []}),
    ("past the context", _chat([{"role": "user", "content": "ledger " * 9000}], max_tokens=4)),
    ("bad schema", _chat([{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})),
]


async def invalid(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """A malformed request: a 4xx with an OpenAI-style error body."""
    name, body = rng.choice(INVALID)
    if isinstance(body, bytes):
        r = await client.post("/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
    else:
        r = await client.post("/v1/chat/completions", json=body)
    try:
        error = r.json()["error"]
        shaped = isinstance(error["message"], str) and isinstance(error["type"], str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not 400 <= r.status_code < 500 or not shaped:
        s.violate(f"invalid ({name}): {r.status_code} {r.text[:200]}")
        return
    s.outcomes["invalid.ok"] += 1


async def logprobs(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """A text completion reporting logprobs."""
    r = await client.post("/v1/completions", json={
        "model": "default", "prompt": _user(rng.randrange(1000)), "max_tokens": 8, "logprobs": 3})
    if r.status_code != 200:
        s.violate(f"logprobs: {r.status_code} {r.text[:200]}")
        return
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    # NOTE: an answer that is only the end-of-sequence token reports no token.
    if not lp or len(lp["tokens"]) != len(lp["token_logprobs"]) \
            or (not lp["tokens"] and choice["finish_reason"] != "stop"):
        s.violate(f"logprobs: malformed {str(lp)[:200]}")
        return
    s.outcomes["logprobs.ok"] += 1


async def structured(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """A chat answer constrained to a JSON schema: a finished one parses."""
    r = await client.post("/v1/chat/completions", json=_chat(
        [{"role": "user", "content": "Give a name and a number. " + _user(rng.randrange(100))}],
        max_tokens=48, response_format={"type": "json_schema",
                                        "json_schema": {"name": "pair", "schema": SCHEMA}}))
    if r.status_code != 200:
        s.violate(f"json: {r.status_code} {r.text[:200]}")
        return
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        try:
            value = json.loads(choice["message"]["content"])
        except ValueError:
            s.violate(f"json: a finished answer does not parse: {choice['message']['content']!r}")
            return
        if not isinstance(value, dict) or set(value) != {"name", "n"}:
            s.violate(f"json: {value!r} does not fit the schema")
            return
    s.outcomes[f"json.{choice['finish_reason']}"] += 1


async def choices(s: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    """Two fixed prompts, n=2, greedy: four choices, equal within a prompt and across runs."""
    picks = rng.sample(range(s.conversations), 2)
    body = {"model": "default", "prompt": [_user(i) for i in picks], "n": 2, "max_tokens": 12,
            "temperature": 0}
    texts: dict[int, str] = {}
    if rng.random() < 0.5:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            s.violate(f"choices: {r.status_code} {r.text[:200]}")
            return
        texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    else:
        cut = rng.random() < 0.3
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                s.violate(f"choices: {r.status_code}")
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                if cut and events >= 3:
                    s.outcomes["choices.cut"] += 1
                    return
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    s.violate(f"choices: error event {event['error']}")
                    return
                for c in event["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    if sorted(texts) != [0, 1, 2, 3]:
        s.violate(f"choices: indices {sorted(texts)}")
        return
    for k, i in enumerate(picks):
        a, b = texts[2 * k], texts[2 * k + 1]
        seen = s.choice_answers.setdefault(i, a)
        if a != b or a != seen:
            s.violate(f"choices {i}: {a!r} / {b!r}, first seen {seen!r}")
            return
    s.outcomes["choices.ok"] += 1


async def client_loop(s: Soak, seed: int, until: float) -> None:
    """One client: behaviours drawn at random until ``until``."""
    rng = random.Random(seed)
    names, weights = list(BEHAVIOURS), list(BEHAVIOURS.values())
    async with httpx.AsyncClient(base_url=s.url, timeout=httpx.Timeout(180.0)) as client:
        while time.monotonic() < until:
            name = rng.choices(names, weights)[0]
            try:
                match name:
                    case "greedy":
                        await greedy(s, client, rng)
                    case "agent":
                        await agent(s, client, rng)
                    case "cancel":
                        await cancel(s, client, rng)
                    case "stall":
                        await stall(s, rng)
                    case "invalid":
                        await invalid(s, client, rng)
                    case "logprobs":
                        await logprobs(s, client, rng)
                    case "choices":
                        await choices(s, client, rng)
                    case _:
                        await structured(s, client, rng)
            except (httpx.HTTPError, OSError, TimeoutError, ValueError, KeyError) as exc:
                s.violate(f"{name}: {type(exc).__name__}: {exc}")


async def probe(s: Soak, until: float) -> None:
    """/health every half second (its latency), /stats every five (resident memory)."""
    async with httpx.AsyncClient(base_url=s.url, timeout=30.0) as client:
        last_stats = 0.0
        while time.monotonic() < until:
            began = time.perf_counter()
            try:
                r = await client.get("/health")
                s.health_ms.append((time.perf_counter() - began) * 1e3)
                if r.status_code != 200:
                    s.violate(f"/health: {r.status_code}")
                if time.monotonic() - last_stats >= 5:
                    last_stats = time.monotonic()
                    memory = (await client.get("/stats")).json()["engine"]["memory"]
                    s.rss.append((round(time.monotonic(), 1), int(memory.get("resident_bytes") or 0)))
            except httpx.HTTPError as exc:
                s.violate(f"/health: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)


def _at_rest(stats: dict[str, Any]) -> dict[str, Any]:
    """The figures that must be zero once every client has stopped."""
    e = stats["engine"]
    batch = e.get("batch", {}).get("batch", {})
    rows = batch.get("rows", {})
    return {
        "http.in_flight": stats["http"]["in_flight"],
        "batch.rows": sum(int(v) for v in rows.values()) if rows else 0,
        "batch.streams.held": batch.get("streams", {}).get("held", 0),
        "prompt_cache.active_leases": e["prompt_cache"]["active_leases"],
        "gateway.queued": e["gateway"]["token"]["queued"],
        "gateway.parked": e["gateway"]["token"].get("parked", 0),
        "engine_thread.queue_depth": e["engine_thread"]["queue_depth"],
    }


async def settle(s: Soak) -> dict[str, Any]:
    """Wait (30 s at most) until the server is at rest; the last figures read."""
    async with httpx.AsyncClient(base_url=s.url, timeout=30.0) as client:
        figures: dict[str, Any] = {}
        for _ in range(60):
            figures = _at_rest((await client.get("/stats")).json())
            # NOTE: the /stats request itself is in flight while it answers.
            if figures["http.in_flight"] <= 1 and not any(
                    v for k, v in figures.items() if k != "http.in_flight"):
                return figures
            await asyncio.sleep(0.5)
    s.violate(f"not at rest 30 s after the clients stopped: {figures}")
    return figures


_MEMORY_FIGURES = ("refused_at_admission", "busy_at_admission", "admission_waits",
                   "admission_busy_failed", "refused_in_turn", "refused_before_prefill",
                   "readmissions", "reliefs", "relieved_entries")


async def soak(url: str, args: argparse.Namespace) -> Soak:
    """Run the clients and the probe; then the check at rest."""
    s = Soak(url, args.conversations, args.stall_s)
    until = time.monotonic() + args.seconds
    await asyncio.gather(probe(s, until), *[client_loop(s, args.seed * 1000 + c, until)
                                            for c in range(args.clients)])
    s.outcomes["rest"] = 1
    rest = await settle(s)
    s.outcomes.update({f"rest.{k}": int(v) for k, v in rest.items()})
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        stats = (await client.get("/stats")).json()
    engine = stats["engine"]
    s.timeline = stats.get("http", {}).get("timeline", {})
    memory = engine.get("memory", {})
    s.outcomes.update({f"memory.{k}": int(memory[k]) for k in _MEMORY_FIGURES if k in memory})
    taken_back = engine.get("batch", {}).get("batch", {}).get("memory_taken_back")
    if taken_back is not None:
        s.outcomes["memory.batch_taken_back"] = int(taken_back)
    token = engine["gateway"]["token"]
    # NOTE: serial-lane turns that ended on a full stream, and how often such a request parked.
    s.outcomes["gateway.blocked_turns"] = int(token.get("blocked_turns", 0))
    s.outcomes["gateway.parked_turns"] = int(token.get("parked_turns", 0))
    return s


def _log_text(server: Server) -> str:
    return server.stderr.read_text(errors="replace") + server.stdout.read_text(errors="replace")


def _log_problems(server: Server) -> list[str]:
    text = _log_text(server)
    return [line[:300] for line in text.splitlines()
            if "Traceback" in line or "[error" in line or '"level": "error"' in line][:20]


def _spread(values: list[float]) -> dict[str, float | int | None]:
    """n, p50, p90, p99 and max of ``values`` (milliseconds, one decimal)."""
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return round(ordered[int(q * (len(ordered) - 1))], 1) if ordered else None

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "max": at(1.0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--stall-s", type=float, default=8.0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more `kvtier serve` argument (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument("--keep-log", type=Path, default=None, help="copy the server's log here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        work = Path(tmp)
        server = Server(work, ["--ssd-cache", str(work / "kv"), "--max-batch", str(args.max_batch),
                               *args.serve_arg])
        try:
            began = time.monotonic()
            s = asyncio.run(soak(server.url, args))
            wall = time.monotonic() - began
            problems = _log_problems(server)
            deadlines = _log_text(server).count("http.stream_write_timeout")
            if args.keep_log is not None:
                args.keep_log.write_text(_log_text(server))
            alive = server.alive()
        finally:
            server.stop()
    for line in problems:
        s.violate(f"server log: {line}")
    if s.outcomes["stall.write_deadline"] > deadlines:
        s.violate(f"{s.outcomes['stall.write_deadline']} stalled answers ended without [DONE], "
                  f"{deadlines} write deadlines in the server log")
    if not alive:
        s.violate("the server died")
    summary = {
        "clients": args.clients, "seconds": args.seconds, "wall_s": round(wall, 1),
        "outcomes": dict(sorted(s.outcomes.items())),
        "violations": s.violations,
        "distinct_greedy_chats": len(s.answers),
        "greedy_repeats": s.outcomes["greedy.ok"] - len(s.answers),
        "health_ms": _spread(s.health_ms),
        "latency_ms": {kind: _spread(values) for kind, values in sorted(s.latency_ms.items())},
        "timeline": s.timeline,
        "rss_mib": {k: round(v / 2**20, 1) for k, v in (
            ("start", s.rss[0][1] if s.rss else 0),
            ("middle", s.rss[len(s.rss) // 2][1] if s.rss else 0),
            ("end", s.rss[-1][1] if s.rss else 0))},
        "serve_args": args.serve_arg,
    }
    out = json.dumps(summary, indent=2)
    print(out)
    if args.json is not None:
        args.json.write_text(out + "\n")
    return 1 if s.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
