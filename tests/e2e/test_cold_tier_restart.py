"""End to end: a conversation survives a restart of ``kvtier serve`` through the SSD tier.

A real server answers the first turn and is stopped with SIGTERM (its
shutdown flushes the cache to disk); a second server on the same directory
answers the next turn with at least 90 % of the prompt served from disk and
the same greedy answer as a full prefill of that turn (the same server under
another ``cache_salt``, which shares no cached tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SYSTEM = (
    "You are a careful assistant for a lighthouse keeper on a rocky northern island. "
    "The keeper writes a log every evening: the weather, the ships that passed, the "
    "state of the lamp, the oil left in the tanks, the birds that nested on the cliffs, "
    "and anything unusual seen on the water. You help by answering questions about "
    "the log in plain, short sentences. "
) * 4
FIRST = {"role": "user", "content": "Summarise what a keeper writes in the evening log."}
SECOND = {"role": "user", "content": "Which of those entries matters most in a storm?"}
TOKENS = 12


def _chat(server: ServerProcess, messages: list[dict[str, str]], salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "messages": messages, "max_tokens": TOKENS,
                            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_the_next_turn_after_a_restart_is_served_from_disk(tmp_path: Path) -> None:
    """After SIGTERM and a restart on the same SSD directory, the next turn reports
    cached_tokens >= 90 % of its prompt (served by the SSD tier, per /stats) and its greedy
    answer equals that of the same turn with nothing cached (another cache_salt: 0 cached
    tokens, no SSD or RAM hit)."""
    kv = tmp_path / "kv"
    history = [{"role": "system", "content": SYSTEM}, FIRST]

    first = ServerProcess(_dir(tmp_path, "first"), "--ssd-cache", str(kv))
    try:
        reply = _chat(first, history)["choices"][0]["message"]["content"]
    finally:
        assert first.stop(timeout=120) == 0, first.logs()
    turn = [*history, {"role": "assistant", "content": reply}, SECOND]

    # NOTE: one restarted server gives both answers (a third server start
    # cost more than the rest of the test): the salted request shares no
    # cached tokens, so it is a full prefill of the same turn.
    second = ServerProcess(_dir(tmp_path, "second"), "--ssd-cache", str(kv))
    try:
        served = _chat(second, turn)
        reference = _chat(second, turn, salt="no-cached-prefix")
        stats = httpx.get(f"{second.url}/stats", timeout=30).json()["engine"]
    finally:
        assert second.stop(timeout=120) == 0, second.logs()
    usage = served["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * usage["prompt_tokens"]
    assert stats["ssd_cache"]["hits"] == 1
    assert stats["prompt_cache"]["hits"] == 0
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert served["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]


def _dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    return path
