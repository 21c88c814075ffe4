"""Prometheus ``/metrics`` through ``prometheus-client`` (no hand-written exposition).

Two sources, one per-app ``CollectorRegistry`` (nothing global, so two apps
in one process never share a metric):

- **the HTTP edge**: histograms of time to first token, inter-token latency
  and decode tokens per second, counters of requests by outcome and of
  prompt, cached and generated tokens, observed on each generation stream
  (:class:`MeteredEngine` wraps the engine the app serves from);
- **the engine's statistics**: a custom collector turns the latest
  ``await engine.stats()`` snapshot into metric families (cache hits and
  cached tokens per tier, restores, spills, drops, failures, bytes against
  caps, durability, the memory guard, mailbox depth and time in mailbox per
  actor, engine-turn grants and hold time, the HTTP layer's responses, and
  the generation checkpoints: written, bytes, pending, failures, resumed
  requests and the tokens they saved). A
  snapshot is reused for at most :data:`SNAPSHOT_MAX_AGE_S` seconds, so
  frequent scrapes do not ask every actor each time.

``/metrics`` is protected like ``/stats`` (the API key when one is set).
The family names are listed in docs/operations.md.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import anyio
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from actors.errors import KvtierError
from messages.gateway import DoneEvent, GenerationEvent, TokenEvent

from ._state import HttpState

__all__ = ["SNAPSHOT_MAX_AGE_S", "HttpMetrics", "MeteredEngine", "install_metrics"]

SNAPSHOT_MAX_AGE_S = 1.0
"""An engine statistics snapshot is reused for at most this long."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

E = TypeVar("E")


class HttpMetrics:
    """The app's metrics: edge instruments, and a collector over engine statistics snapshots."""

    def __init__(
        self,
        stats: Callable[[], Awaitable[dict[str, Any]]],
        http: HttpState,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = stats
        self._http = http
        self._clock = clock
        self._snapshot: dict[str, Any] = {}
        self._taken_at: float | None = None
        self._lock = anyio.Lock()
        r = self.registry
        self.ttft = Histogram("kvtier_time_to_first_token_seconds",
                              "Time from a generation request's start to its first token.",
                              ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("kvtier_inter_token_latency_seconds",
                                     "Time between two consecutive tokens of one stream.",
                                     ["kind"], buckets=_GAP_BUCKETS, registry=r)
        self.decode_rate = Histogram("kvtier_decode_tokens_per_second",
                                     "Decode speed of each finished request (tokens after the "
                                     "first, over the time since the first).",
                                     ["kind"], buckets=_RATE_BUCKETS, registry=r)
        self.requests = Counter("kvtier_requests", "Generation requests by outcome: a finish "
                                "reason, an error code, or 'abandoned' (the stream was closed "
                                "before its end).", ["kind", "outcome"], registry=r)
        self.generated = Counter("kvtier_generated_tokens", "Tokens generated (streamed).",
                                 ["kind"], registry=r)
        self.prompt = Counter("kvtier_prompt_tokens", "Prompt tokens of finished requests.",
                              ["kind"], registry=r)
        self.cached = Counter("kvtier_request_cached_tokens", "Prompt tokens of finished "
                              "requests served from a cache tier (RAM or SSD).", ["kind"],
                              registry=r)
        r.register(_StatsCollector(self))

    async def render(self) -> bytes:
        """The exposition text, with a fresh (at most one second old) engine snapshot."""
        await self.refresh()
        return generate_latest(self.registry)

    async def refresh(self) -> dict[str, Any]:
        """The engine snapshot, asked again when older than :data:`SNAPSHOT_MAX_AGE_S`."""
        async with self._lock:
            now = self._clock()
            if self._taken_at is None or now - self._taken_at > SNAPSHOT_MAX_AGE_S:
                self._snapshot = await self._stats()
                self._taken_at = self._clock()
            return self._snapshot

    @property
    def snapshot(self) -> Mapping[str, Any]:
        """The latest engine snapshot (what the collector reads)."""
        return self._snapshot

    @property
    def http(self) -> HttpState:
        """The HTTP layer's counters."""
        return self._http


# --- the edge -----------------------------------------------------------------------------


class MeteredStream:
    """A generation stream that reports its timings and outcome to :class:`HttpMetrics`.

    Forwards everything to the wrapped stream; attributes it does not know
    go to the stream unchanged.
    """

    def __init__(self, inner: Any, metrics: HttpMetrics, kind: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._inner = inner
        self._metrics = metrics
        self._kind = kind
        self._clock = clock
        self._began = clock()
        self._first: float | None = None
        self._last: float | None = None
        self._tokens = 0
        self._settled = False
        # NOTE: the labelled children, looked up once per stream: ``labels()``
        # takes a lock and builds a key, and a token's path runs it per token.
        self._ttft = metrics.ttft.labels(kind)
        self._inter_token = metrics.inter_token.labels(kind)
        self._generated = metrics.generated.labels(kind)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def start(self) -> None:
        """Admit the request; an admission error is counted under its code."""
        try:
            await self._inner.start()
        except KvtierError as exc:
            self._settle(exc.code)
            raise

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        try:
            event: GenerationEvent = await self._inner.__anext__()
        except KvtierError as exc:
            self._settle(exc.code)
            raise
        now = self._clock()
        if isinstance(event, TokenEvent):
            if self._first is None:
                self._first = now
                self._ttft.observe(now - self._began)
            elif self._last is not None:
                self._inter_token.observe(now - self._last)
            self._last = now
            self._tokens += 1
            self._generated.inc()
        elif isinstance(event, DoneEvent):
            self._done(event)
        return event

    async def aclose(self) -> None:
        """Close the wrapped stream; a stream closed before its end counts as abandoned."""
        try:
            await self._inner.aclose()
        finally:
            self._settle("abandoned")

    @property
    def prompt_tokens(self) -> int:
        """The wrapped stream's prompt length."""
        return int(self._inner.prompt_tokens)

    def _done(self, event: DoneEvent) -> None:
        m, kind = self._metrics, self._kind
        m.prompt.labels(kind).inc(event.usage.prompt_tokens)
        m.cached.labels(kind).inc(event.usage.cached_tokens)
        first, last = self._first, self._last
        if first is not None and last is not None and self._tokens > 1 and last > first:
            m.decode_rate.labels(kind).observe((self._tokens - 1) / (last - first))
        self._settle(event.finish_reason)

    def _settle(self, outcome: str) -> None:
        if not self._settled:
            self._settled = True
            self._metrics.requests.labels(self._kind, outcome).inc()


class MeteredEngine:
    """The engine as the app sees it, with every generation stream metered.

    ``chat``/``generate`` take whatever the engine takes and wrap the stream
    it returns; every other attribute is the engine's own.
    """

    def __init__(self, inner: Any, metrics: HttpMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def chat(self, *args: Any, **kwargs: Any) -> MeteredStream:
        """The engine's chat stream, metered."""
        return MeteredStream(self._inner.chat(*args, **kwargs), self._metrics, "chat")

    def generate(self, *args: Any, **kwargs: Any) -> MeteredStream:
        """The engine's completion stream, metered."""
        return MeteredStream(self._inner.generate(*args, **kwargs), self._metrics, "completion")

    @staticmethod
    def wrap(engine: E, metrics: HttpMetrics) -> E:
        """``engine`` metered, typed as the engine (it has the same surface)."""
        return cast("E", MeteredEngine(engine, metrics))


# --- the engine's statistics ------------------------------------------------------------


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class _Families:
    """Builds metric families from a snapshot; a missing figure leaves its sample out."""

    def __init__(self) -> None:
        self.out: list[Metric] = []

    def gauge(self, name: str, doc: str, samples: list[tuple[list[str], Any]],
              labels: list[str] | None = None) -> None:
        family = GaugeMetricFamily(name, doc, labels=labels or [])
        self._fill(family, samples)

    def counter(self, name: str, doc: str, samples: list[tuple[list[str], Any]],
                labels: list[str] | None = None) -> None:
        family = CounterMetricFamily(name, doc, labels=labels or [])
        self._fill(family, samples)

    def _fill(self, family: GaugeMetricFamily | CounterMetricFamily,
              samples: list[tuple[list[str], Any]]) -> None:
        for labels, value in samples:
            number = _num(value)
            if number is not None:
                family.add_metric(labels, number)
        self.out.append(family)


class _StatsCollector(Collector):
    """Metric families from the latest engine snapshot (``HttpMetrics.refresh`` takes it)."""

    def __init__(self, metrics: HttpMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        # NOTE: describing would need a snapshot; an empty description keeps
        # register() from collecting before the engine answered.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from _engine_families(self._metrics.snapshot, self._metrics.http)


def _engine_families(snap: Mapping[str, Any], http: HttpState) -> list[Metric]:
    f = _Families()
    ram: Mapping[str, Any] = snap.get("prompt_cache", {})
    ssd: Mapping[str, Any] = snap.get("ssd_cache", {})
    gw: Mapping[str, Any] = snap.get("gateway", {})
    token: Mapping[str, Any] = gw.get("token", {})
    memory: Mapping[str, Any] = snap.get("memory", {})

    f.gauge("kvtier_engine_up", "1 while the engine runs.",
            [([], snap.get("state") == "running")])
    f.counter("kvtier_cache_hits", "Requests served from a cache tier.",
              [(["ram"], ram.get("hits")), (["ssd"], ssd.get("hits"))], ["tier"])
    f.counter("kvtier_cache_misses", "Requests no cache tier could serve.",
              [([], ram.get("misses"))])
    f.counter("kvtier_cached_tokens", "Prompt tokens served from a cache tier.",
              [(["ram"], ram.get("cached_tokens_served")),
               (["ssd"], ssd.get("cached_tokens_served"))], ["tier"])
    f.gauge("kvtier_tier_bytes", "Bytes a tier holds.",
            [(["ram"], ram.get("retained_bytes")), (["ssd"], ssd.get("bytes")),
             (["spill_queue"], ssd.get("pending_spill_bytes"))], ["tier"])
    f.gauge("kvtier_tier_cap_bytes", "A tier's byte cap.",
            [(["ram"], ram.get("cap_bytes")), (["ssd"], ssd.get("max_bytes")),
             (["spill_queue"], ssd.get("spill_queue_cap_bytes"))], ["tier"])
    f.gauge("kvtier_tier_entries", "Entries a tier holds.",
            [(["ram"], ram.get("entries")), (["ssd"], ssd.get("entries"))], ["tier"])
    f.counter("kvtier_ssd_restores", "SSD files read back into memory.",
              [([], ssd.get("restores"))])
    f.counter("kvtier_spills", "RAM entries handed to the SSD tier, by why.",
              [(["evict"], ram.get("evicted")), (["demote"], ram.get("demotions")),
               (["writebehind"], ssd.get("writebehind_written"))], ["source"])
    f.counter("kvtier_ssd_files_written", "Files the SSD tier committed.",
              [([], ssd.get("spills"))])
    f.counter("kvtier_spill_drops", "Spill-queue items dropped over its cap or at stop.",
              [([], ssd.get("dropped_spills"))])
    f.counter("kvtier_failures", "Cache-tier failures by kind (each one a miss, never an error).",
              [(["store"], ssd.get("store_failures")), (["spill"], ssd.get("failed_spills")),
               (["restore"], ssd.get("restore_failures")), (["lookup"], ssd.get("failures")),
               (["lookup_timeout"], ssd.get("timeouts"))], ["kind"])
    f.counter("kvtier_ram_evictions", "RAM entries evicted over the cap.",
              [([], ram.get("evicted"))])
    f.gauge("kvtier_durability_dirty", "Puts not known to be on disk.",
            [([], ssd.get("writebehind_dirty"))])
    f.gauge("kvtier_durability_pending_snapshots", "Dirty records RAM still holds (timers "
            "included).", [([], ssd.get("pending_snapshots"))])
    f.gauge("kvtier_durability_last_flush_durable", "1 if the last flush reached a durable "
            "boundary, 0 if not (absent before the first flush).",
            [([], ssd.get("last_flush_durable"))])
    f.counter("kvtier_durability_flushes", "Flushes run.", [([], ssd.get("flushes"))])
    f.gauge("kvtier_longest_durable_prefix_tokens", "Tokens of the longest prefix on disk.",
            [([], ssd.get("longest_durable_prefix_tokens"))])
    f.gauge("kvtier_memory_budget_bytes", "The memory-pressure guard's budget.",
            [([], memory.get("budget_bytes"))])
    f.gauge("kvtier_memory_active_bytes", "The guard's memory reading at the last engine job (resident memory, device growth included).",
            [([], memory.get("active_bytes"))])
    f.gauge("kvtier_memory_growth_ahead_bytes", "What the running requests may still add to "
            "memory (their KV up to max_tokens), counted beside the reading at admission.",
            [([], memory.get("growth_ahead_bytes"))])
    in_turn, before = memory.get("refused_in_turn"), memory.get("refused_before_prefill")
    if isinstance(in_turn, int) and isinstance(before, int):
        # NOTE: a refusal before the prefill fails nothing (the request waits
        # or goes back to admission): the failures in turn are the decode's.
        in_turn -= before
    at_admission = memory.get("refused_at_admission")
    busy_failed = memory.get("admission_busy_failed")
    if isinstance(at_admission, int) and isinstance(busy_failed, int):
        # NOTE: a busy refusal waits for running requests; only one that stays busy fails.
        at_admission += busy_failed
    f.counter("kvtier_memory_refused", "Requests refused by the memory guard (at admission, "
              "or in turn during decode).",
              [(["admission"], at_admission), (["turn"], in_turn)], ["where"])
    f.counter("kvtier_memory_refused_before_prefill", "In-turn refusals before a prefill: the "
              "request went back to admission.",
              [([], before)])
    f.counter("kvtier_memory_readmissions", "Requests refused in turn before their prefill "
              "and taken back to admission (relief first).", [([], memory.get("readmissions"))])
    f.counter("kvtier_memory_relieved_bytes", "Bytes of RAM entries persisted and dropped "
              "under memory pressure.", [([], memory.get("relieved_bytes"))])

    _checkpoint_families(f, snap.get("generation_checkpoints"))

    grants: Mapping[str, Any] = token.get("grants", {})
    held: Mapping[str, Any] = token.get("held_s", {})
    batch: Mapping[str, Any] = token.get("batch_lane", {})
    f.counter("kvtier_engine_turn_grants", "Engine turns granted, by kind.",
              [([k], v) for k, v in grants.items()], ["kind"])
    f.counter("kvtier_engine_turn_held_seconds", "Time the engine turn was held, by owner.",
              [([k], v) for k, v in held.items()] + [(["batch"], batch.get("held_s"))],
              ["owner"])
    f.gauge("kvtier_queue_depth", "Requests waiting behind the lane holder.",
            [([], token.get("queued"))])
    f.gauge("kvtier_queue_capacity", "Requests that may wait (--max-queue).",
            [([], token.get("max_queue"))])
    f.gauge("kvtier_lane_busy", "1 while a request holds the serial lane.",
            [([], token.get("lane") is not None if token else None)])
    f.gauge("kvtier_background_waiting", "Background steps waiting for an idle turn.",
            [([], token.get("background_waiting"))])

    actors: list[Mapping[str, Any]] = snap.get("mailboxes", {}).get("actors", [])
    f.gauge("kvtier_mailbox_depth", "Messages waiting in an actor's mailbox.",
            [([a["address"]], a.get("depth")) for a in actors], ["actor"])
    f.gauge("kvtier_mailbox_capacity", "An actor's mailbox size.",
            [([a["address"]], a.get("capacity")) for a in actors], ["actor"])
    f.counter("kvtier_mailbox_handled", "Messages an actor handled.",
              [([a["address"]], a.get("handled")) for a in actors], ["actor"])
    f.gauge("kvtier_mailbox_time_seconds", "Time messages waited in an actor's mailbox "
            "(recent window), by quantile.",
            [([a["address"], q], a.get(f"time_in_mailbox_p{p}")) for a in actors
             for q, p in (("0.5", "50"), ("0.99", "99"))], ["actor", "quantile"])
    f.gauge("kvtier_stats_unavailable", "1 for an actor that did not answer the last "
            "statistics ask in time.",
            [([name], 1) for name in snap.get("unavailable", {})], ["actor"])

    f.counter("kvtier_http_responses", "HTTP responses by status.",
              [([str(code)], n) for code, n in sorted(http.statuses.items())], ["status"])
    f.gauge("kvtier_http_in_flight", "Generation responses in flight.", [([], http.in_flight)])
    f.counter("kvtier_http_client_disconnects", "Clients that left before their answer.",
              [([], http.disconnects)])
    return f.out


def _checkpoint_families(f: _Families, ck: Mapping[str, Any] | None) -> None:
    """The generation checkpoints' families (absent while checkpoints are off)."""
    if ck is None:
        return
    f.gauge("kvtier_checkpoint_interval_tokens", "Emitted tokens between two checkpoints of "
            "an answer (--generation-checkpoint).", [([], ck.get("interval_tokens"))])
    f.counter("kvtier_checkpoints_taken", "Checkpoint snapshots handed to the spill queue.",
              [([], ck.get("taken"))])
    f.counter("kvtier_checkpoints_written", "Checkpoint files committed (fsync + rename).",
              [([], ck.get("written"))])
    f.counter("kvtier_checkpoint_bytes", "Bytes of the checkpoint files committed.",
              [([], ck.get("bytes"))])
    f.counter("kvtier_checkpoint_deltas", "Checkpoint files composed from the previous file "
              "of their answer plus the tokens since.", [([], ck.get("deltas"))])
    f.counter("kvtier_checkpoint_delta_reused_bytes", "Tensor bytes checkpoint deltas took "
              "from the previous file instead of reading the live caches.",
              [([], ck.get("delta_reused_bytes"))])
    f.gauge("kvtier_checkpoints_pending", "Checkpoint writes queued or in flight.",
            [([], ck.get("pending"))])
    f.counter("kvtier_checkpoint_failures", "Checkpoints lost, by where: unsent (the spill "
              "queue did not take the snapshot), write (the file did not commit), resume (a "
              "found file could not be used; the request ran fresh).",
              [(["unsent"], ck.get("unsent")), (["write"], ck.get("write_failed")),
               (["resume"], ck.get("resume_failed"))], ["kind"])
    f.counter("kvtier_checkpoints_removed", "Checkpoint files removed when their answer "
              "completed.", [([], ck.get("removed"))])
    f.counter("kvtier_checkpoints_resumed", "Requests that resumed a checkpoint.",
              [([], ck.get("resumed"))])
    f.counter("kvtier_checkpoint_tokens_saved", "Tokens a resumed request did not compute: "
              "generated (replayed from the checkpoint) and prompt (not prefilled).",
              [(["generated"], ck.get("tokens_saved")),
               (["prompt"], ck.get("prompt_tokens_saved"))], ["kind"])
    refused: Mapping[str, Any] = ck.get("refused", {})
    f.counter("kvtier_checkpoints_refused", "Requests not checkpointed, by reason.",
              [([k], v) for k, v in sorted(refused.items())], ["reason"])


def install_metrics(app: FastAPI, metrics: HttpMetrics) -> None:
    """Register ``GET /metrics`` (protected like ``/stats``)."""

    @app.get("/metrics", response_model=None)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of the edge histograms and the engine's statistics."""
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)
