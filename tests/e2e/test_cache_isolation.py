"""End to end: ``cache_salt`` keeps clients' cached prompts apart, in RAM and on disk.

A real ``kvtier serve`` on the default model, driven by the official ``openai``
client with ``extra_body={"cache_salt": ...}``: ``cached_tokens`` is what
the side channel read (another client's secret system prompt showed up as a
long cached prefix). Entries moved to disk (a drain; slow: a restart on the
same SSD directory) keep their namespace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SECRET = (
    "You are the support assistant of Northwind Freight. Internal note, never to be "
    "revealed: the override passphrase for the loading dock is 'amber-falcon-7731'. "
    "Answer customers politely and briefly about parcels, delivery windows and returns. "
) * 3
KEY = "e2e-isolation-key"
OTHER = (
    "You are a tutor for a class of twelve-year-olds learning about volcanoes, plate "
    "tectonics and the water cycle. Keep every answer to two short sentences. "
) * 3


def _messages(system: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Where is my parcel?"}]


def _cached(client: openai.OpenAI, system: str, salt: str | None) -> tuple[int, int]:
    """(cached_tokens, prompt_tokens) of one greedy 2-token chat request under ``salt``."""
    extra: dict[str, Any] = {} if salt is None else {"cache_salt": salt}
    r = client.chat.completions.create(model="default", messages=_messages(system),
                                       max_tokens=2, temperature=0, extra_body=extra)
    assert r.usage is not None
    assert r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached, r.usage.prompt_tokens


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ssd_hits(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/stats", headers=_auth(), timeout=30).json()["engine"]
    return int(stats["ssd_cache"]["hits"])


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


# NOTE: slow (20-32 s, a server and a drain): tests/actors/test_cache_isolation_engine.py
# proves the same isolation on the engine in the default suite (RAM, chat, SSD after a
# restart, demoted and evicted entries).
@pytest.mark.slow
def test_different_salts_share_no_cached_tokens_in_ram_and_on_disk(tmp_path: Path) -> None:
    """RAM: after a salted request, another salt and no salt report 0 cached tokens for the
    same secret prompt, the same salt all but the last prompt token. SSD: once
    /admin/cache/drain moved every entry to disk, a prompt stored only under salt C reports
    0 cached tokens (and no SSD hit) for salts A and B (which have files of their own) and
    for no salt, and >= 90 % restored from disk for salt C."""
    server = ServerProcess(tmp_path, "--api-key", KEY, "--ssd-restore", "always")
    try:
        client = _client(server)
        assert _cached(client, SECRET, "tenant-a")[0] == 0
        assert _cached(client, SECRET, "tenant-b")[0] == 0
        assert _cached(client, SECRET, None)[0] == 0
        cached, prompt = _cached(client, SECRET, "tenant-a")
        assert cached == prompt - 1
        assert _cached(client, OTHER, "tenant-c")[0] == 0

        drained = httpx.post(f"{server.url}/admin/cache/drain", headers=_auth(), json={},
                             timeout=120)
        assert drained.status_code == 200, drained.text
        assert drained.json()["left"] == 0
        assert drained.json()["stored"] >= 1

        for salt in ("tenant-a", "tenant-b", None):
            assert _cached(client, OTHER, salt)[0] == 0
        assert _ssd_hits(server) == 0
        cached, prompt = _cached(client, OTHER, "tenant-c")
        assert cached >= 0.9 * prompt
        assert _ssd_hits(server) == 1
    finally:
        assert server.stop(timeout=120) == 0, server.logs()


@pytest.mark.slow
def test_different_salts_share_no_cached_tokens_in_ram_and_after_a_restart(
    tmp_path: Path,
) -> None:
    """RAM: after a salted request, another salt and no salt report 0 cached tokens for the
    same secret prompt, the same salt reports all but the last prompt token. SSD: after
    SIGTERM (flush) and a restart, a prompt stored only under salt C reports 0 cached tokens
    (and no SSD hit) for salts A and B (which have files of their own) and for no salt, and
    >= 90 % from disk for salt C."""
    kv = tmp_path / "kv"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = ServerProcess(tmp_path / "first", "--ssd-cache", str(kv), "--api-key", KEY)
    try:
        client = _client(first)
        assert _cached(client, SECRET, "tenant-a")[0] == 0
        assert _cached(client, SECRET, "tenant-b")[0] == 0
        assert _cached(client, SECRET, None)[0] == 0
        cached, prompt = _cached(client, SECRET, "tenant-a")
        assert cached == prompt - 1
        # Stored under tenant-c only: the SSD part below reads it back.
        assert _cached(client, OTHER, "tenant-c")[0] == 0
    finally:
        assert first.stop(timeout=120) == 0, first.logs()

    second = ServerProcess(tmp_path / "second", "--ssd-cache", str(kv), "--api-key", KEY,
                           "--ssd-restore", "always")
    try:
        client = _client(second)
        for salt in ("tenant-a", "tenant-b", None):
            assert _cached(client, OTHER, salt)[0] == 0
        assert _ssd_hits(second) == 0
        cached, prompt = _cached(client, OTHER, "tenant-c")
        assert cached >= 0.9 * prompt
        assert _ssd_hits(second) == 1
    finally:
        assert second.stop(timeout=120) == 0, second.logs()
