"""One client stops reading a serial-lane stream; how long do other clients' requests take?

Starts its own ``kvtier serve`` (the default model, any ``--serve-arg``) unless ``--url`` names
one, opens a raw socket with a 4 KiB receive buffer and 536-byte segments, asks for a
streamed text completion of a ~1,600-token prompt with ``echo`` and ``logprobs`` 5 (the
prompt is scored: served on the serial lane; the scores of the prompt's tokens, about half a
megabyte, fill the socket and server buffers at once, each later token carries its
alternatives) and reads none of it. Meanwhile it
sends ``--requests`` short batch-lane chat requests, one every ``--every`` seconds, and
prints each one's time; a server whose serial lane waited on the stalled reader inside its
engine turn held them for up to ``--stream-write-timeout`` (30 s by default). With
``--lane serial`` the short requests are text completions that score their prompt (``echo``
with ``logprobs``: the serial lane, queued behind the stalled request; a ``json_object`` answer
was one too before grammar requests became batch rows): a server whose stalled request kept
the lane held them as long.
Prints a JSON summary (``--json`` also writes it): each request's start and duration, their
median and maximum, and the server's ``blocked_turns``, ``parked_turns`` and write-deadline
warnings.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/load/stalled_probe.py --requests 12
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tools._serve_child import Server  # noqa: E402


def _stall(url: str) -> socket.socket:
    """Send a streamed, scored completion on a small-windowed socket that reads nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    body = json.dumps({
        "prompt": "Write a very long story about a dragon. " * 160, "max_tokens": 4000,
        "temperature": 0, "stream": True, "echo": True, "logprobs": 5, "ignore_eos": True,
    }).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def probe(url: str, requests: int, every: float, lane: str = "batch") -> dict[str, Any]:
    """Stall one stream; time ``requests`` short requests of ``lane`` beside it."""
    serial = lane == "serial"
    sock = _stall(url)
    began = time.monotonic()
    rows: list[dict[str, float | int]] = []
    try:
        with httpx.Client(base_url=url, timeout=180.0) as client:
            for i in range(requests):
                time.sleep(every)
                sent = time.monotonic()
                if serial:
                    r = client.post("/v1/completions", json={
                        "prompt": f"Say hello {i}.", "max_tokens": 8, "temperature": 0,
                        "echo": True, "logprobs": 1})
                else:
                    r = client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"Say hello {i}."}],
                        "max_tokens": 8, "temperature": 0})
                took = time.monotonic() - sent
                rows.append({"at_s": round(sent - began, 2), "took_s": round(took, 3),
                             "status": r.status_code})
                print(f"t={sent - began:5.1f}s request took {took:6.2f}s status {r.status_code}",
                      flush=True)
            token = client.get("/stats").json()["engine"]["gateway"]["token"]
    finally:
        sock.close()
    times = [float(r["took_s"]) for r in rows]
    return {"requests": rows, "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3), "lane": lane, "blocked_turns": token.get("blocked_turns"),
            "parked_turns": token.get("parked_turns")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--every", type=float, default=3.0, help="seconds between requests")
    p.add_argument("--lane", choices=("batch", "serial"), default="batch",
                   help="the short requests' lane (serial: a completion scoring its prompt)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more `kvtier serve` argument (repeatable)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.url is not None:
        summary = probe(args.url, args.requests, args.every, args.lane)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-stall-") as tmp:
            server = Server(Path(tmp), ["--ssd-cache", str(Path(tmp) / "kv"), *args.serve_arg])
            try:
                summary = probe(server.url, args.requests, args.every, args.lane)
                log = server.stderr.read_text(errors="replace")
                summary["write_deadline_warnings"] = log.count("stream_write_timeout")
            finally:
                server.stop()
    out = json.dumps(summary, indent=2)
    print(out)
    if args.json is not None:
        args.json.write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
