"""``GET /metrics`` over a REAL Engine (tiny Llama, temp SSD dir), read back with prometheus_client's parser.

Every family the issue names is checked against what the test did: requests
by outcome, time to first token, inter-token latency and decode speed at
the HTTP edge; cache hits and cached tokens per tier, restores, spills,
drops, failures, bytes against caps, durability, mailboxes, engine turns,
the memory guard and the HTTP responses from the engine's statistics.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from actors.engine import Engine
from actors.http import HttpSettings, HttpState, create_app
from actors.http._metrics import HttpMetrics
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

CAP = 1 << 26
PROMPT = [5 + i % 80 for i in range(40)]
OTHER = [9 + i % 70 for i in range(30)]


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


@pytest.fixture
async def served(tmp_path: Path, model: Any) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """The app over an Engine with both tiers (write-behind off: the flush writes)."""
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=CAP, ssd_cache=tmp_path,
                                ssd_writebehind=False)
    async with engine:
        app = create_app(engine, HttpSettings(admin_loopback=True))
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            yield engine, client


def _families(text: str) -> dict[str, list[Sample]]:
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and all(
        s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples)
    return found[0]


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
    """Stream a completion; the number of completion tokens its usage reports."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        usage: dict[str, Any] = {}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
    return int(usage["completion_tokens"])


async def test_metrics_expose_every_family_with_the_figures_of_the_run(
    served: tuple[Engine, httpx.AsyncClient],
) -> None:
    """After three completions (one a RAM hit, one streamed), a flush and a 404, /metrics parses
    and each family holds the run's figures."""
    engine, client = served
    first = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6})
    hit = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6})
    streamed = await _stream(client, OTHER, 8)
    flushed = await client.post("/admin/cache/flush", headers={"content-type": "application/json"})
    assert flushed.status_code == 200
    assert (await client.get("/nowhere")).status_code == 404
    text = (await client.get("/metrics")).text
    f = _families(text)

    completions = [first.json()["usage"]["completion_tokens"],
                   hit.json()["usage"]["completion_tokens"], streamed]
    cached = hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(PROMPT) - 1
    outcomes = [s for s in f["kvtier_requests"] if s.name == "kvtier_requests_total"]
    assert sum(s.value for s in outcomes) == 3
    assert {s.labels["outcome"] for s in outcomes} <= {"stop", "length"}
    assert _value(f["kvtier_time_to_first_token_seconds"],
                  "kvtier_time_to_first_token_seconds_count", kind="completion") == 3
    assert _value(f["kvtier_inter_token_latency_seconds"],
                  "kvtier_inter_token_latency_seconds_count",
                  kind="completion") == sum(n - 1 for n in completions)
    assert _value(f["kvtier_decode_tokens_per_second"],
                  "kvtier_decode_tokens_per_second_count", kind="completion") == 3
    assert _value(f["kvtier_generated_tokens"], "kvtier_generated_tokens_total",
                  kind="completion") == sum(completions)
    assert _value(f["kvtier_request_cached_tokens"], "kvtier_request_cached_tokens_total",
                  kind="completion") == cached

    assert _value(f["kvtier_cache_hits"], "kvtier_cache_hits_total", tier="ram") == 1
    assert _value(f["kvtier_cache_hits"], "kvtier_cache_hits_total", tier="ssd") == 0
    assert _value(f["kvtier_cache_misses"], "kvtier_cache_misses_total") == 2
    assert _value(f["kvtier_cached_tokens"], "kvtier_cached_tokens_total", tier="ram") == cached
    assert _value(f["kvtier_ssd_restores"], "kvtier_ssd_restores_total") == 0
    stats = await engine.stats(timeout=5)
    ram, ssd = stats["prompt_cache"], stats["ssd_cache"]
    for tier, held, cap in (("ram", ram["retained_bytes"], CAP),
                            ("ssd", ssd["bytes"], ssd["max_bytes"])):
        assert _value(f["kvtier_tier_bytes"], "kvtier_tier_bytes", tier=tier) == held
        assert _value(f["kvtier_tier_cap_bytes"], "kvtier_tier_cap_bytes", tier=tier) == cap
    assert ssd["bytes"] > 0
    assert _value(f["kvtier_tier_entries"], "kvtier_tier_entries", tier="ssd") == ssd["entries"]
    assert _value(f["kvtier_ssd_files_written"], "kvtier_ssd_files_written_total") == ssd["spills"]
    assert {s.labels["source"] for s in f["kvtier_spills"]} == {"evict", "demote", "writebehind"}
    assert _value(f["kvtier_spill_drops"], "kvtier_spill_drops_total") == 0
    assert {s.labels["kind"] for s in f["kvtier_failures"]} >= {"store", "spill", "restore"}
    assert all(s.value == 0 for s in f["kvtier_failures"])

    assert _value(f["kvtier_durability_last_flush_durable"],
                  "kvtier_durability_last_flush_durable") == 1
    assert _value(f["kvtier_durability_flushes"], "kvtier_durability_flushes_total") == 1
    assert _value(f["kvtier_durability_dirty"], "kvtier_durability_dirty") == 0
    assert _value(f["kvtier_durability_pending_snapshots"],
                  "kvtier_durability_pending_snapshots") == 0
    assert _value(f["kvtier_longest_durable_prefix_tokens"],
                  "kvtier_longest_durable_prefix_tokens") >= len(PROMPT)

    actors = {s.labels["actor"] for s in f["kvtier_mailbox_depth"]}
    assert {"gateway", "gateway.runner", "prompt_cache", "durability", "spill_queue"} <= actors
    waits = {(s.labels["actor"], s.labels["quantile"]) for s in f["kvtier_mailbox_time_seconds"]}
    assert ("gateway", "0.99") in waits
    assert _value(f["kvtier_mailbox_handled"], "kvtier_mailbox_handled_total",
                  actor="gateway") > 0
    grants = {s.labels["kind"]: s.value for s in f["kvtier_engine_turn_grants"]}
    assert grants["prefill"] >= 2
    assert grants["decode"] >= 1
    assert grants["background"] >= 1
    held = {s.labels["owner"]: s.value for s in f["kvtier_engine_turn_held_seconds"]}
    assert held["request"] > 0
    assert _value(f["kvtier_queue_depth"], "kvtier_queue_depth") == 0
    assert _value(f["kvtier_memory_budget_bytes"], "kvtier_memory_budget_bytes") > 0
    assert _value(f["kvtier_http_responses"], "kvtier_http_responses_total", status="404") == 1
    assert _value(f["kvtier_http_responses"], "kvtier_http_responses_total", status="200") >= 4


async def test_each_app_has_its_own_registry(served: tuple[Engine, httpx.AsyncClient]) -> None:
    """Two apps over one engine count their own requests (no global registry to collide in)."""
    engine, client = served
    assert (await client.post("/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 2})).status_code == 200
    other = create_app(engine, HttpSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=other),
                                 base_url="http://t") as second:
        text = (await second.get("/metrics")).text
    requests = _families(text)["kvtier_requests"]
    assert [s for s in requests if s.name == "kvtier_requests_total"] == []
    first = _families((await client.get("/metrics")).text)["kvtier_requests"]
    assert sum(s.value for s in first if s.name == "kvtier_requests_total") == 1


async def test_metrics_need_the_api_key_like_stats(model: Any) -> None:
    """With an API key, /metrics answers 401 without it and 200 with it (the /stats protection)."""
    async with Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny",
                                  prompt_cache_bytes=CAP) as engine:
        app = create_app(engine, HttpSettings(api_key="k"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            assert (await client.get("/metrics")).status_code == 401
            keyed = await client.get("/metrics", headers={"Authorization": "Bearer k"})
    assert keyed.status_code == 200
    assert keyed.headers["content-type"].startswith("text/plain")


async def test_an_engine_snapshot_is_reused_for_at_most_a_second() -> None:
    """Scrapes within one second share one engine snapshot; a later scrape asks again."""
    now = [100.0]
    asked: list[float] = []

    async def stats() -> dict[str, Any]:
        asked.append(now[0])
        return {"state": "running", "prompt_cache": {"hits": len(asked)}}

    metrics = HttpMetrics(stats, HttpState(), clock=lambda: now[0])
    first = _families((await metrics.render()).decode())
    now[0] += 0.9
    await metrics.render()
    now[0] += 0.2
    last = _families((await metrics.render()).decode())
    assert asked == [100.0, pytest.approx(101.1)]
    assert _value(first["kvtier_cache_hits"], "kvtier_cache_hits_total", tier="ram") == 1
    assert _value(last["kvtier_cache_hits"], "kvtier_cache_hits_total", tier="ram") == 2


async def test_memory_refusals_in_turn_count_failures_and_refusals_before_prefill_apart() -> None:
    """Of 7 in-turn refusals, 5 came before a prefill (the requests waited or went back to
    admission): kvtier_memory_refused counts 2 in turn beside 4 at admission (3 refused, 1 that
    stayed busy after waiting), and the 5 go to kvtier_memory_refused_before_prefill."""

    async def stats() -> dict[str, Any]:
        return {"state": "running", "memory": {
            "budget_bytes": 1 << 30, "refused_at_admission": 3, "refused_in_turn": 7,
            "refused_before_prefill": 5, "busy_at_admission": 9, "admission_busy_failed": 1}}

    f = _families((await HttpMetrics(stats, HttpState()).render()).decode())
    refused = f["kvtier_memory_refused"]
    assert _value(refused, "kvtier_memory_refused_total", where="admission") == 4
    assert _value(refused, "kvtier_memory_refused_total", where="turn") == 2
    before = f["kvtier_memory_refused_before_prefill"]
    assert _value(before, "kvtier_memory_refused_before_prefill_total") == 5
