"""A minimal event-driven router: kvtier replicas' KV events in, longest cached prefix out.

    python tools/cluster/event_router.py --port 8000 \\
        --replica http://127.0.0.1:8001,tcp://127.0.0.1:5601,tcp://127.0.0.1:5602 \\
        --replica http://127.0.0.1:8002,tcp://127.0.0.1:5611,tcp://127.0.0.1:5612

Each ``--replica`` is ``URL,PUB,REPLAY``: the replica's HTTP base URL and
the endpoints of its ``--kv-events`` and ``--kv-events-replay``. For every
replica the router

- subscribes with a ZeroMQ SUB socket and keeps a block index
  (``tools/cluster/_event_index.py``), replaying from seq 0 at start (a late
  subscriber), from the missing seq on a gap, and from 0 again when the
  replica's seq goes back to 0 (a restart);
- reads ``/server_info``'s ``kv_events`` (model fingerprint, KV scheme,
  block size) to hash requests as the replica does
  (``actors.kv_events.block_hash``).

A chat or completion request is tokenized as kvtier tokenizes it (the
model's tokenizer and chat template through ``kernels.render_chat``; the
namespace from the body's ``cache_salt``), hashed into its block chain, and
sent to the replica holding its longest cached prefix (the fewest blocks to
compute there), counting the chains this router sent it that its events
have not announced yet (in flight and ``--predict-ttl`` seconds after);
with ``--rule prefill``, to the least prefill work before its first token
(those blocks plus the uncached blocks of the requests in flight to it; for
replicas with a device each, see ``_event_index.choose``). A tie goes to
the replica with the fewest requests in flight through this router, then
to the next in turn. The tokenizer keeps every piece of the conversations
it rendered (``_chat_tokens.ChatTokens``), so an agent's next call encodes
only what it added. When the requests in flight are imbalanced by sglang-router's rule
(``--balance-abs-threshold``, ``--balance-rel-threshold``, its defaults and
meaning), only the least loaded replicas are candidates. Any other request goes to the least loaded replica. The body is forwarded unchanged and the answer streamed back,
with an ``x-kvtier-replica`` header naming the replica's index.
``GET /event_router/stats`` shows the indexes and the routing counts.

Limits (it is a documented minimal subscriber, not a production router):
requests under ``--cache-namespace api-key`` are hashed in the shared
namespace (the router does not see the server's scope rule), so they fall
back to load; no health checks or retries; one process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import httpx  # noqa: E402
import uvicorn  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.background import BackgroundTask  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from actors.kv_events.block_hash import block_digests, external_hash, namespace_root  # noqa: E402
from messages.prompt_cache import cache_namespace  # noqa: E402
from tools.cluster._chat_tokens import ChatTokens  # noqa: E402
from tools.cluster._event_index import RULES, BlockIndex, Predicted, choose, decode_payload  # noqa: E402

__all__ = ["EventRouter", "ReplicaLink", "main"]

_log = logging.getLogger("event_router")
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
_REPLAY_DEADLINE_S = 10.0


@dataclass
class ReplicaLink:
    """One replica: its URL, event endpoints, block index, hashing facts and load."""

    url: str
    pub: str
    replay: str
    index: BlockIndex = field(default_factory=BlockIndex)
    predicted: Predicted = field(default_factory=Predicted)
    last_seq: int = -1
    in_flight: int = 0
    queued_blocks: int = 0
    """Uncached blocks of the requests in flight to this replica (its prefill queue)."""
    routed: int = 0
    replays: int = 0
    replay_failures: int = 0
    model_fingerprint: str = ""
    kv_scheme: str = ""
    block_size: int = 16

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq`` once (earlier or repeated seqs are skipped)."""
        if seq <= self.last_seq:
            return
        self.index.apply(decode_payload(payload))
        self.last_seq = seq


def _token_ids(prompt: object) -> TypeGuard[list[int]]:
    """Whether ``prompt`` is one prompt of token ids (kvtier prefills them verbatim)."""
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


class EventRouter:
    """The subscribers, the tokenizer and the forwarding client of one router process."""

    def __init__(self, replicas: Sequence[ReplicaLink], tokenizer: Any, *,
                 predict_ttl: float = 30.0, balance_abs: float = 64.0,
                 balance_rel: float = 1.5, rule: str = "prefix") -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}")
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.rule = rule
        self._chat: ChatTokens | None = None
        self.predict_ttl = predict_ttl
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.reasons: dict[str, int] = {}
        self._ctx = zmq.asyncio.Context()
        self._turn = 0
        self._roots: dict[tuple[int, str], bytes] = {}
        # NOTE: one tokenizer thread: tokenizing is CPU work off the event
        # loop, and ChatTokens' piece cache is used by one thread at a time.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.tasks: list[asyncio.Task[None]] = []
        self.route_ms: list[float] = []

    # ------------------------------------------------------------ events

    async def start(self) -> None:
        """Read every replica's hashing facts, then start one subscriber task per replica."""
        for r in self.replicas:
            info = (await self.client.get(f"{r.url}/server_info", timeout=10)).json()
            ev = info.get("kv_events")
            if not isinstance(ev, dict):
                raise RuntimeError(f"{r.url} publishes no KV events (start it with --kv-events)")
            r.model_fingerprint = str(ev["model_fingerprint"])
            r.kv_scheme = str(ev["kv_scheme"])
            r.block_size = int(ev["block_size"])
        self.tasks = [asyncio.create_task(self._subscribe(i)) for i in range(len(self.replicas))]

    async def _replay(self, sock: zmq.asyncio.Socket, r: ReplicaLink, start: int) -> None:
        """Ask ``r`` for its buffered batches from ``start`` on and apply them."""
        r.replays += 1
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        try:
            async with asyncio.timeout(_REPLAY_DEADLINE_S):
                while True:
                    _, seq_raw, payload = await sock.recv_multipart()
                    seq = int.from_bytes(seq_raw, "big", signed=True)
                    if seq == -1:
                        return
                    r.apply(seq, payload)
        except TimeoutError:
            # NOTE: the index stays as it was (routing still works, by load);
            # counted in the stats, and the next gap asks again.
            r.replay_failures += 1
            _log.warning("replay from %s timed out", r.replay)

    async def _subscribe(self, i: int) -> None:
        r = self.replicas[i]
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(r.pub)
        replay = self._ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(r.replay)
        try:
            # NOTE: subscribe first, then replay: a batch published in between
            # arrives on both and is applied once (apply skips seen seqs).
            await self._replay(replay, r, 0)
            while True:
                _, seq_raw, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_raw, "big")
                if seq == 0 and r.last_seq >= 0:
                    r.index.reset()  # NOTE: the replica restarted.
                    r.last_seq = -1
                elif seq > r.last_seq + 1:
                    await self._replay(replay, r, r.last_seq + 1)
                r.apply(seq, payload)
        finally:
            sub.close(0)
            replay.close(0)

    # ------------------------------------------------------------ routing

    def _tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids kvtier would prefill for ``body``, or None when not predictable here."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                return None
            tools = body.get("tools") if isinstance(body.get("tools"), list) else None
            if self._chat is None:
                self._chat = ChatTokens(self.tokenizer)
            return self._chat.chat(messages, tools=tools)
        prompt = body.get("prompt")
        if _token_ids(prompt):
            return list(prompt)
        if isinstance(prompt, list) and prompt:
            # NOTE: a batch of prompts goes to one replica, routed by its first
            # prompt (a batch's prompts often share it: few-shot examples).
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if _token_ids(prompt):
            return list(prompt)
        return None

    def _hashes(self, r: ReplicaLink, tokens: list[int], salt: str | None) -> list[int]:
        ns = cache_namespace(salt)
        key = (id(r), ns)
        root = self._roots.get(key)
        if root is None:
            root = namespace_root(model=r.model_fingerprint, kv_scheme=r.kv_scheme, namespace=ns)
            self._roots[key] = root
        return [external_hash(d) for d in block_digests(root, tokens, block_size=r.block_size)]

    async def pick(self, path: str, body: dict[str, Any] | None) -> tuple[int, list[int], int]:
        """(replica index, the request's chain there, its uncached blocks there) for one request."""
        tokens: list[int] | None = None
        if body is not None:
            tokens = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._tokens, path, body)
        n = len(self.replicas)
        cached = [0] * n
        chain_of: list[list[int]] = [[] for _ in range(n)]
        if tokens:
            salt = body.get("cache_salt") if body is not None else None
            salt = salt if isinstance(salt, str) else None
            chains: dict[tuple[str, str, int], list[int]] = {}
            now = time.monotonic()
            for i, r in enumerate(self.replicas):
                key = (r.model_fingerprint, r.kv_scheme, r.block_size)
                if key not in chains:
                    chains[key] = self._hashes(r, tokens, salt)
                chain_of[i] = chains[key]
                r.predicted.expire(now)
                # NOTE: both sets are prefix-closed, so the longest prefix of
                # their union is the longer of the two.
                cached[i] = max(r.index.cached_blocks(chain_of[i]),
                                r.predicted.cached_blocks(chain_of[i], now))
        self._turn += 1
        blocks = max((len(c) for c in chain_of), default=0)
        choice = choose(blocks, cached, [r.queued_blocks for r in self.replicas],
                        [r.in_flight for r in self.replicas], self._turn,
                        abs_threshold=self.balance_abs, rel_threshold=self.balance_rel,
                        rule=self.rule)
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        i = choice.replica
        return i, chain_of[i], len(chain_of[i]) - choice.cached_blocks

    def admit(self, i: int, chain: list[int], uncached: int) -> Callable[[], None]:
        """Count a request sent to replica ``i``; the callable to call once when it ends.

        While in flight the request's chain counts as held on ``i`` and its
        uncached blocks as queued there; when it ends its chain stays
        predicted ``predict_ttl`` seconds more (the replica's events announce
        it meanwhile).
        """
        r = self.replicas[i]
        r.in_flight += 1
        r.routed += 1
        r.queued_blocks += uncached
        r.predicted.add(chain)

        def ended() -> None:
            r.in_flight -= 1
            r.queued_blocks -= uncached
            r.predicted.settle(chain, time.monotonic() + self.predict_ttl)

        return ended

    # ------------------------------------------------------------ HTTP

    async def forward(self, request: Request) -> Response:
        """Route one request and stream the replica's answer back."""
        started = time.perf_counter()
        raw = await request.body()
        body: dict[str, Any] | None = None
        path = request.url.path
        if request.method == "POST" and path.endswith("completions"):
            with contextlib.suppress(ValueError):
                parsed = json.loads(raw)
                body = parsed if isinstance(parsed, dict) else None
        i, chain, uncached = await self.pick(path, body)
        r = self.replicas[i]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        url = f"{r.url}{path}" + (f"?{request.url.query}" if request.url.query else "")
        upstream = self.client.build_request(request.method, url, headers=headers, content=raw)
        ended = self.admit(i, chain, uncached)
        # NOTE: the routing decision's own time (parse, tokenize, hash, choose).
        self.route_ms.append((time.perf_counter() - started) * 1000)
        del self.route_ms[:-10_000]
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            ended()
            return JSONResponse({"error": {"message": f"replica {i} unreachable: {exc}",
                                           "type": "bad_gateway", "code": 502}}, status_code=502)

        async def done() -> None:
            ended()
            await resp.aclose()

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        out_headers["x-kvtier-replica"] = str(i)
        return StreamingResponse(_body(resp), status_code=resp.status_code, headers=out_headers,
                                 background=BackgroundTask(done))

    def stats(self) -> dict[str, Any]:
        """Per replica: blocks indexed, last seq, routed and in-flight requests, replays."""
        ms = sorted(self.route_ms)
        return {
            "replicas": [{"url": r.url, "blocks": len(r.index.held), "last_seq": r.last_seq,
                          "batches": r.index.batches, "routed": r.routed,
                          "in_flight": r.in_flight, "queued_blocks": r.queued_blocks,
                          "predicted_blocks": len(r.predicted.until), "replays": r.replays,
                          "replay_failures": r.replay_failures} for r in self.replicas],
            "rule": self.rule,
            "reasons": dict(self.reasons),
            "tokenizer_pieces": None if self._chat is None else {
                "encoded": self._chat.encoded, "reused": self._chat.reused,
                "fallbacks": self._chat.fallbacks},
            "route_ms_p50": ms[len(ms) // 2] if ms else None,
            "route_ms_p90": ms[int(len(ms) * 0.9)] if ms else None,
        }

    async def aclose(self) -> None:
        """Stop the subscribers and close the client and sockets."""
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.client.aclose()
        self._pool.shutdown(wait=False)
        self._ctx.term()


async def _body(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        yield chunk


def build_app(router: EventRouter) -> Starlette:
    """The proxy's ASGI app: ``/event_router/stats`` and everything else forwarded."""

    async def stats(_: Request) -> Response:
        return JSONResponse(router.stats())

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/event_router/stats", stats),
                             Route("/{path:path}", router.forward, methods=methods)],
                     lifespan=lifespan)


def _load_tokenizer(model: str | None) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kernels import default_model_dir, resolve_model_path

    path = default_model_dir() if model is None else resolve_model_path(model)
    return load_tokenizer(path)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse replicas, load the tokenizer, serve until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", action="append", required=True, metavar="URL,PUB,REPLAY",
                   help="a replica's base URL, --kv-events and --kv-events-replay endpoints")
    p.add_argument("--model", default=None,
                   help="the replicas' model (for its tokenizer); default: kvtier's default model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--predict-ttl", type=float, default=30.0,
                   help="seconds a routed request's blocks count as held on its replica after the "
                        "request ends, until the replica's events announce them (default 30; "
                        "0: only while in flight)")
    p.add_argument("--balance-abs-threshold", type=float, default=64.0,
                   help="sglang-router's rule, same meaning: balance by load when the requests in "
                        "flight differ by more than this (default 64, sglang-router's)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and the most loaded replica has more than this times the least "
                        "(default 1.5, sglang-router's)")
    p.add_argument("--rule", choices=RULES, default="prefix",
                   help="prefix: the longest cached prefix wins, load only by the balance rule "
                        "(as cache_aware); prefill: the least prefill before the first token, "
                        "queued work included (replicas with a device each) (default prefix)")
    args = p.parse_args(argv)
    links = []
    for spec in args.replica:
        parts = spec.split(",")
        if len(parts) != 3:
            p.error(f"--replica wants URL,PUB,REPLAY, got {spec!r}")
        links.append(ReplicaLink(parts[0].rstrip("/"), parts[1], parts[2]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    router = EventRouter(links, _load_tokenizer(args.model), predict_ttl=args.predict_ttl,
                         balance_abs=args.balance_abs_threshold,
                         balance_rel=args.balance_rel_threshold, rule=args.rule)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
