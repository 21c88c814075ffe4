"""Slowloris against ``kvtier serve`` on loopback, while a normal client keeps chatting.

Starts its own ``kvtier serve`` on 127.0.0.1 (the default model, logs to a
file), then for ``--ramp`` seconds opens ``--connections`` slow-header
connections (each sends one header byte every ``--drip`` seconds, never
finishing its request head), holds the attack ``--hold`` seconds more, and
meanwhile sends one chat request per second from a normal client (a fresh
connection each, at most one retry). Reports, as JSON on stdout:

- the normal client's success rate (target >= 0.9),
- whether the server stayed up (and answers /health afterwards),
- how much its log grew during the attack (target < 1 MB),
- what happened to the attacking connections (opened, refused at connect,
  closed by the server).

The server runs with ``--server-nofile`` descriptors (default 1024, a
common default limit) so the attack would exhaust them without the
connection cap. Loopback only, bounded in time: about ramp + hold + the
model load.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/load/slowloris.py [--connections 3000] [--ramp 10] [--hold 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"kvtier: ready at (http://\S+)/v1")
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_HOST = "127.0.0.1"


@dataclass
class AttackStats:
    """What happened to the slow connections."""

    opened: int = 0
    refused_at_connect: int = 0
    closed_by_server: int = 0
    still_open: int = 0


@dataclass
class ClientStats:
    """The normal client's requests."""

    sent: int = 0
    ok: int = 0
    retried: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


def _raise_own_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def _start_server(workdir: Path, nofile: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(os.environ)
    if "LD_PRELOAD" not in env and os.path.exists(_OPENBLAS):
        env["LD_PRELOAD"] = _OPENBLAS

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, max(nofile, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1])))

    cmd = [sys.executable, "-m", "actors.cli", "serve", "--host", _HOST, "--port", "0",
           "--prompt-cache", "0", *extra]
    out, err = workdir / "serve.stdout", workdir / "serve.stderr"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=o, stderr=e, preexec_fn=limit)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = _READY.search(out.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"kvtier serve did not start:\n{err.read_text(errors='replace')[-3000:]}")


async def _slow_connection(port: int, drip: float, stop: asyncio.Event, stats: AttackStats) -> None:
    try:
        reader, writer = await asyncio.open_connection(_HOST, port)
    except OSError:
        stats.refused_at_connect += 1
        return
    stats.opened += 1
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
    i = 0
    try:
        while not stop.is_set():
            writer.write(head[i:i + 1])
            i += 1
            await writer.drain()
            try:
                # NOTE: the server answering (408) or closing ends this connection's attack.
                await asyncio.wait_for(reader.read(1024), timeout=drip)
            except TimeoutError:
                continue
            stats.closed_by_server += 1
            return
        stats.still_open += 1
    except OSError:
        stats.closed_by_server += 1
    finally:
        writer.close()


async def _attack(port: int, n: int, ramp: float, drip: float, stop: asyncio.Event,
                  stats: AttackStats) -> None:
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    for k in range(n):
        delay = started + ramp * k / n - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_slow_connection(port, drip, stop, stats)))
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _normal_client(url: str, duration: float, key: str | None, max_tokens: int,
                         stats: ClientStats) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": max_tokens,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # NOTE: no keep-alive: every request is a new connection, the hardest case
    # under a connection flood.
    limits = httpx.Limits(max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient) -> None:
        tick = time.monotonic()
        stats.sent += 1
        for attempt in range(2):
            try:
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                if r.status_code == 200:
                    stats.ok += 1
                    stats.latencies_s.append(round(time.monotonic() - tick, 3))
                    return
                error = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                error = type(exc).__name__
            if attempt == 0:
                stats.retried += 1
        stats.failures.append(error)

    async with httpx.AsyncClient(base_url=url, timeout=15, limits=limits) as client:
        requests: list[asyncio.Task[None]] = []
        started = time.monotonic()
        # NOTE: one request a second whatever the previous one's latency.
        for k in range(int(duration)):
            await asyncio.sleep(max(0.0, started + k - time.monotonic()))
            requests.append(asyncio.create_task(one(client)))
        await asyncio.gather(*requests)


async def _baseline(url: str, args: argparse.Namespace) -> ClientStats:
    """The normal client alone: how fast this machine answers without an attack."""
    stats = ClientStats()
    await _normal_client(url, args.baseline, args.api_key, args.max_tokens, stats)
    return stats


async def _run(args: argparse.Namespace, url: str, port: int) -> tuple[AttackStats, ClientStats]:
    attack, client = AttackStats(), ClientStats()
    stop = asyncio.Event()
    attacker = asyncio.create_task(
        _attack(port, args.connections, args.ramp, args.drip, stop, attack))
    await _normal_client(url, args.ramp + args.hold, args.api_key, args.max_tokens, client)
    stop.set()
    await attacker
    return attack, client


def _summary(stats: ClientStats) -> dict[str, object]:
    lat = sorted(stats.latencies_s)
    return {"sent": stats.sent, "ok": stats.ok, "retried": stats.retried,
            "success_rate": round(stats.ok / max(1, stats.sent), 3),
            "failures": stats.failures,
            "latency_p50_s": lat[len(lat) // 2] if lat else None,
            "latency_max_s": lat[-1] if lat else None}


def main() -> int:
    """Run the attack once and print the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=3000)
    p.add_argument("--ramp", type=float, default=10.0, help="seconds to open them over")
    p.add_argument("--hold", type=float, default=10.0, help="seconds to keep attacking after")
    p.add_argument("--drip", type=float, default=2.0, help="seconds between header bytes")
    p.add_argument("--server-nofile", type=int, default=1024)
    p.add_argument("--api-key", default="slowloris-test")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="of each normal chat request (1: the attack, not this CPU, is measured)")
    p.add_argument("--baseline", type=float, default=5.0,
                   help="seconds of normal traffic alone first (0: none)")
    args = p.parse_args()
    _raise_own_nofile(args.connections + 256)
    with tempfile.TemporaryDirectory(prefix="kvtier-slowloris-") as tmp:
        workdir = Path(tmp)
        extra = ["--api-key", args.api_key] if args.api_key else []
        proc, url = _start_server(workdir, args.server_nofile, extra)
        try:
            port = int(url.rsplit(":", 1)[1])
            log = workdir / "serve.stderr"
            base = asyncio.run(_baseline(url, args)) if args.baseline >= 1 else ClientStats()
            log_before = log.stat().st_size
            started = time.monotonic()
            attack, client = asyncio.run(_run(args, url, port))
            elapsed = time.monotonic() - started
            alive = proc.poll() is None
            health: int | str | None = None
            if alive:
                try:
                    health = httpx.get(f"{url}/health", timeout=10).status_code
                except httpx.HTTPError as exc:
                    health = type(exc).__name__
            log_growth = log.stat().st_size - log_before
            shed = [line for line in log.read_text(errors="replace").splitlines()
                    if "http.connections_shed" in line]
        finally:
            proc.terminate()
            code = proc.wait(timeout=60)
    report = {
        "connections": args.connections, "ramp_s": args.ramp, "hold_s": args.hold,
        "drip_s": args.drip, "server_nofile": args.server_nofile, "elapsed_s": round(elapsed, 1),
        "attack": attack.__dict__,
        "baseline_client": _summary(base),
        "client": _summary(client),
        "server_alive": alive, "health_after": health, "server_exit_code": code,
        "log_growth_bytes": log_growth, "last_shed_report": shed[-1] if shed else None,
    }
    print(json.dumps(report, indent=2))
    ok = (client.ok / max(1, client.sent) >= 0.9 and alive and health == 200
          and log_growth < 1_000_000)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
