"""``POST /admin/cache/flush`` and ``/admin/cache/drain`` over a REAL Engine (tiny Llama, temp SSD dir).

The flush route answers 200 with ``durable: true`` only at a durable
boundary (with the index's evidence), 503 otherwise; an ``fsync`` that
fails once (fsyncgate) keeps it at 503 until the entry is rewritten and
synced. The drain route moves every RAM entry to disk. Admin routes need
the admin key, else the API key; with neither they are closed (403) unless
loopback clients are let in (``admin_loopback``). Every POST says it is JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.engine import Engine, GenerationParams
from actors.http import HttpSettings, create_app
from tests.actors.ssd_writer.support import FaultPort
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

FLUSH = "/admin/cache/flush"
DRAIN = "/admin/cache/drain"
PARAMS = GenerationParams(max_tokens=6)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tok))


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


@asynccontextmanager
async def _served(
    model: Any, tok: Any, root: Path | None, *, settings: HttpSettings | None = None,
    client: tuple[str, int] = ("127.0.0.1", 40000), file_port: Any = None, **options: Any,
) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=1 << 26, ssd_cache=root,
                                file_port=file_port, **options)
    async with engine:
        app = create_app(engine, settings or HttpSettings(admin_loopback=True))
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120,
                                     headers={"content-type": "application/json"}) as c:
            yield engine, c


async def _put(engine: Engine, tok: Any, texts: list[str]) -> list[list[int]]:
    prompts = [_ids(tok, t) for t in texts]
    for prompt in prompts:
        await engine.complete_prompt(prompt, PARAMS)
    return prompts


PROMPTS = ["A flush answers whether the cache is on disk now. " * 2,
           "Two conversations of equal length are two records. " * 2]


async def test_flush_after_puts_is_200_durable_with_the_index_evidence(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """After puts (write-behind off, so only the flush writes), the flush answers 200 with
    durable true, nothing pending/dropped/failed, the files in the index, and the longest
    durable prefix at least as long as the longest prompt; a restarted engine finds the files."""
    async with _served(model, tok, tmp_path, ssd_writebehind=False) as (engine, client):
        prompts = await _put(engine, tok, PROMPTS)
        r = await client.post(FLUSH)
        body = r.json()
        stats = (await client.get("/stats")).json()["engine"]["ssd_cache"]
    assert r.status_code == 200, body
    assert body["durable"] is True
    assert body["reason"] is None
    assert (body["pending"], body["dropped"], body["failed"], body["uncovered"]) == (0, 0, 0, 0)
    assert body["entries"] == stats["entries"] >= len(prompts)
    assert body["longest_durable_prefix_tokens"] >= max(len(p) for p in prompts)
    assert stats["longest_durable_prefix_tokens"] == body["longest_durable_prefix_tokens"]
    assert stats["pending_snapshots"] == 0
    async with _served(model, tok, tmp_path) as (restarted, _):
        again = await restarted.complete_prompt(prompts[0], PARAMS)
    assert again.usage.cached_tokens >= len(prompts[0]) - 1


async def test_flush_is_503_while_puts_are_dirty_and_writes_fail_then_200_once_rewritten(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """fsyncgate: the entry's fsync fails once with EIO, so the flush that wrote it answers 503
    (durable false, the write counted as failed, the record still pending) and nothing is in
    the index; the next flush rewrites and syncs it and answers 200 durable true."""
    port = FaultPort("fsync", "eio")
    async with _served(model, tok, tmp_path, ssd_writebehind=False, file_port=port) as (
        engine, client
    ):
        await _put(engine, tok, PROMPTS[:1])
        first = await client.post(FLUSH)
        second = await client.post(FLUSH)
    assert port.fired
    assert first.status_code == 503, first.text
    failed = first.json()
    assert failed["durable"] is False
    assert failed["failed"] >= 1
    assert failed["pending"] >= 1
    assert failed["entries"] == 0
    assert "failed" in failed["reason"]
    assert second.status_code == 200, second.text
    assert second.json()["durable"] is True
    assert second.json()["entries"] >= 1


async def test_flush_without_an_ssd_tier_is_503_with_the_reason(model: Any, tok: Any) -> None:
    """No SSD tier: nothing can be durable, so the flush answers 503 and says why; drain is 409."""
    async with _served(model, tok, None) as (engine, client):
        await _put(engine, tok, PROMPTS[:1])
        flush = await client.post(FLUSH)
        drain = await client.post(DRAIN)
    assert flush.status_code == 503
    assert flush.json()["durable"] is False
    assert flush.json()["reason"] == "no SSD tier is configured"
    assert drain.status_code == 409
    assert drain.json()["error"]["code"] == "no_ssd_tier"


async def test_drain_moves_every_ram_entry_to_disk(tmp_path: Path, model: Any, tok: Any) -> None:
    """The drain route empties the RAM tier into the SSD tier and answers once they are written;
    the next request for a drained prompt is served from disk."""
    async with _served(model, tok, tmp_path, ssd_writebehind=False) as (engine, client):
        prompts = await _put(engine, tok, PROMPTS)
        before = (await client.get("/stats")).json()["engine"]
        r = await client.post(DRAIN)
        after = (await client.get("/stats")).json()["engine"]
        again = await engine.complete_prompt(prompts[1], PARAMS)
        served = (await client.get("/stats")).json()["engine"]
    assert r.status_code == 200, r.text
    body = r.json()
    moved = before["prompt_cache"]["entries"]
    assert moved >= len(prompts)
    assert (body["demoted"], body["left"], body["leased"]) == (moved, 0, 0)
    assert body["stored"] == moved
    assert body["dropped"] == body["failed"] == 0
    assert after["prompt_cache"]["entries"] == 0
    assert after["ssd_cache"]["entries"] == before["ssd_cache"]["entries"] + moved
    assert again.usage.cached_tokens >= len(prompts[1]) - 1
    assert served["ssd_cache"]["hits"] == 1


@pytest.mark.parametrize("route", [FLUSH, DRAIN])
async def test_admin_routes_are_closed_without_a_key_unless_loopback_is_let_in(
    tmp_path: Path, model: Any, tok: Any, route: str
) -> None:
    """Without any key, admin routes answer 403 (OpenAI-shaped) even to loopback; with
    admin_loopback a loopback client gets through and a remote one still gets 403."""
    async with _served(model, tok, tmp_path, settings=HttpSettings(),
                       client=("::1", 5000)) as (_, closed):
        shut = await closed.post(route)
    assert shut.status_code == 403
    assert shut.json()["error"]["code"] == "admin_forbidden"
    async with _served(model, tok, tmp_path, client=("10.1.2.3", 5000)) as (_, remote):
        refused = await remote.post(route)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "admin_forbidden"
    async with _served(model, tok, tmp_path, client=("::1", 5000)) as (_, local):
        assert (await local.post(route)).status_code == 200


async def test_admin_routes_need_the_api_key_when_one_is_set(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """With an API key, a remote client without it gets 401 and one with it may flush."""
    settings = HttpSettings(api_key="sesame")
    async with _served(model, tok, tmp_path, settings=settings, client=("10.1.2.3", 5000)) as (
        _, remote
    ):
        missing = await remote.post(FLUSH)
        keyed = await remote.post(FLUSH, headers={"Authorization": "Bearer sesame"})
    assert missing.status_code == 401
    assert keyed.status_code == 200, keyed.text



async def test_a_flush_sent_right_after_an_answer_covers_that_request(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """Each flush sent as soon as a completion answered has that request's entry in its scope
    and ends durable with one more file (the put is never left behind the flush)."""
    async with _served(model, tok, tmp_path, ssd_writebehind=False) as (_, client):
        for i in range(8):
            prompt = [3 + (i * 11 + j) % 90 for j in range(40)]
            done = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
            assert done.status_code == 200
            body = (await client.post(FLUSH)).json()
            assert body["durable"] is True
            assert body["scope"] == 1
            assert body["entries"] == i + 1
