"""Cache isolation inside a running Engine: ``cache_salt`` and ``cache_scope`` select namespaces.

Requests share cached KV (``usage.cached_tokens``) only when the prompt
prefix and the namespace both match: in the RAM tier, and in the SSD tier
for entries written by write-behind (read back after a restart) or moved
there by a demotion (read back after leaving RAM). Tiny fp32 Llama, the
production wiring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams, InvalidRequest
from kernels import ModelIdentity
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)
GREEDY = GenerationParams(max_tokens=4)
SECRET = "The vault code is 4 8 1 5. Never tell it to anyone who asks for it. " * 2


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama shared by every engine of this module."""
    return kv_llama(vocab_size=len(tok))


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


def _engine(model: Any, tok: Any, root: Path | None = None, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prompt_cache_bytes": 1 << 26, "ssd_cache": root, **options}
    return Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **settings)


async def _cached(engine: Engine, prompt: list[int], salt: str | None = None,
                  scope: str | None = None) -> int:
    """usage.cached_tokens of one greedy raw completion of ``prompt``."""
    params = GREEDY.model_copy(update={"cache_scope": scope})
    done = await engine.complete_prompt(prompt, params, cache_salt=salt)
    return done.usage.cached_tokens


async def _until_on_disk(engine: Engine, entries: int) -> None:
    """Wait until the SSD index holds ``entries`` files (fails after 20 s)."""
    with anyio.fail_after(20):
        while True:
            if (await engine.stats())["ssd_cache"]["entries"] >= entries:
                return
            await anyio.sleep(0.02)


async def test_ram_tier_shares_a_prefix_only_under_the_same_salt(model: Any, tok: Any) -> None:
    """After a salted request, the same prompt under another salt, under no salt, and under
    the same salt with another scope reuses nothing (cached_tokens 0); under the same salt
    it reuses all but the last token; the RAM tier counts exactly that one hit."""
    prompt = _ids(tok, SECRET)
    async with _engine(model, tok) as engine:
        assert await _cached(engine, prompt, "tenant-a") == 0
        assert await _cached(engine, prompt, "tenant-b") == 0
        assert await _cached(engine, prompt, None) == 0
        assert await _cached(engine, prompt, "tenant-a", scope="api-key:other") == 0
        assert await _cached(engine, prompt, "tenant-a") == len(prompt) - 1
        stats = await engine.stats()
    assert stats["prompt_cache"]["hits"] == 1


async def test_no_salt_shares_with_no_salt_but_not_with_a_salt(model: Any, tok: Any) -> None:
    """An unsalted entry serves the next unsalted request (the shared namespace), and never a
    salted one: a guess at another client's prompt under a salt learns nothing."""
    prompt = _ids(tok, SECRET)
    guess = [*prompt[:-6], *_ids(tok, "9 9 9.")]
    async with _engine(model, tok) as engine:
        await _cached(engine, prompt, None)
        assert await _cached(engine, guess, "attacker") == 0
        assert await _cached(engine, guess, None) == len(prompt) - 6


async def test_chat_requests_are_isolated_by_salt(model: Any, tok: Any) -> None:
    """Chat requests (prompt-boundary snapshot and completion entries) follow the same rule:
    another salt reuses nothing of the same conversation, the same salt reuses its prefix."""
    messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": "Hi?"}]
    async with _engine(model, tok, snapshot_min_new_tokens=8) as engine:
        first = await engine.complete(messages, GREEDY, cache_salt="s1")
        other = await engine.complete(messages, GREEDY, cache_salt="s2")
        same = await engine.complete(messages, GREEDY, cache_salt="s1")
    assert first.usage.cached_tokens == other.usage.cached_tokens == 0
    assert same.usage.cached_tokens == same.usage.prompt_tokens - 1


async def test_a_bad_salt_is_refused_before_admission(model: Any, tok: Any) -> None:
    """An empty salt or one over 256 characters is InvalidRequest from chat/generate."""
    async with _engine(model, tok) as engine:
        with pytest.raises(InvalidRequest, match="cache_salt"):
            engine.generate([1, 2, 3], GREEDY, cache_salt="")
        with pytest.raises(InvalidRequest, match="cache_salt"):
            engine.chat([{"role": "user", "content": "x"}], GREEDY, cache_salt="x" * 257)


async def test_ssd_tier_after_a_restart_restores_only_for_the_same_salt(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """A salted entry written by write-behind and read back by a restarted engine serves
    nothing to another salt or to no salt (no SSD hit), and serves the same salt from disk."""
    prompt = _ids(tok, SECRET)
    async with _engine(model, tok, tmp_path) as writer:
        await _cached(writer, prompt, "tenant-a")
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable
    async with _engine(model, tok, tmp_path, ssd_restore="always") as restarted:
        assert await _cached(restarted, prompt, "tenant-b") == 0
        assert await _cached(restarted, prompt, None) == 0
        assert (await restarted.stats())["ssd_cache"]["hits"] == 0
        assert await _cached(restarted, prompt, "tenant-a") == len(prompt) - 1
        stats = await restarted.stats()
    assert stats["ssd_cache"]["hits"] == 1
    assert stats["prompt_cache"]["ssd_hits"] == 1


async def test_a_demoted_entry_keeps_its_namespace_on_disk(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """With write-behind off, an entry demoted out of RAM reaches disk only through the
    demotion; read back, it serves its own salt and no other."""
    prompt = _ids(tok, SECRET)
    async with _engine(model, tok, tmp_path, ssd_writebehind=False,
                       ssd_restore="always") as engine:
        await _cached(engine, prompt, "tenant-a")
        demoted = await engine.demote_cache()
        assert demoted is not None
        assert demoted.result.spilled >= 1
        assert demoted.stored == 1
        assert (await engine.stats())["prompt_cache"]["entries"] == 0
        assert await _cached(engine, prompt, "tenant-b") == 0
        assert (await engine.stats())["ssd_cache"]["hits"] == 0
        # NOTE: tenant-b's own entry is in RAM now; tenant-a's is only on disk.
        assert await _cached(engine, prompt, "tenant-a") == len(prompt) - 1
        stats = await engine.stats()
    assert stats["ssd_cache"]["hits"] == 1


async def test_an_entry_evicted_from_ram_keeps_its_namespace_on_disk(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """With a RAM cap that holds one entry and write-behind off, a salted entry reaches disk
    only by being evicted (spilled) for another client's; read back, it serves its own salt
    and no other."""
    prompt = _ids(tok, SECRET)
    other = _ids(tok, "Quarterly report: shipping volumes rose in every region. " * 3)
    async with _engine(model, tok, tmp_path, prompt_cache_bytes=100_000,
                       ssd_writebehind=False, ssd_restore="always") as engine:
        await _cached(engine, prompt, "tenant-a")
        await _cached(engine, other, "tenant-b")
        stats = await engine.stats()
        assert (stats["prompt_cache"]["evicted"], stats["prompt_cache"]["entries"]) == (1, 1)
        await _until_on_disk(engine, 1)
        assert await _cached(engine, prompt, "tenant-b") == 0
        assert (await engine.stats())["ssd_cache"]["hits"] == 0
        assert await _cached(engine, prompt, "tenant-a") == len(prompt) - 1
        stats = await engine.stats()
    assert stats["ssd_cache"]["hits"] == 1
