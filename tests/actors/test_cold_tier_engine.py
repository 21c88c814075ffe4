"""The SSD cold tier inside a running Engine (production wiring, tiny fp32 Llama).

A restored entry continues exactly like a RAM hit and a cold prefill; files
written by one engine serve the next one (restart survival); idle entries
move to disk; hostile files are counted, removed and served as misses; the
byte cap holds on disk after every write.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams, TokenEvent
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
GREEDY = GenerationParams(max_tokens=12, logprobs=True)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama shared by every engine of this module (same weights in each run)."""
    return kv_llama(vocab_size=len(tok))


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


def _engine(model: Any, tok: Any, root: Path | None, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prompt_cache_bytes": 1 << 26, "ssd_cache": root, **options}
    return Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **settings)


def _shared(entry: list[int], prompt: list[int]) -> int:
    """Tokens an entry covering ``entry`` serves for ``prompt`` (one prompt token always left)."""
    n = 0
    while n < min(len(entry), len(prompt) - 1) and entry[n] == prompt[n]:
        n += 1
    return n


async def _wait_for(predicate: Any, engine: Engine, *, seconds: float = 20.0) -> dict[str, Any]:
    """Poll ``engine.stats()`` until ``predicate(stats)`` holds (fails after ``seconds``)."""
    with anyio.fail_after(seconds):
        while True:
            stats = await engine.stats(timeout=5.0)
            if predicate(stats):
                return stats
            await anyio.sleep(0.02)


async def _continue(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities and usage.cached_tokens of one request."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with engine.generate(prompt, GREEDY) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                assert event.logprob is not None
                logprobs.append(event.logprob)
            else:
                return tokens, logprobs, event.usage.cached_tokens
    raise AssertionError("the stream ended without a DoneEvent")


async def test_a_restored_entry_continues_like_a_ram_hit_and_a_cold_prefill(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """Greedy tokens after a prefix restored from disk (after a restart, trimmed to the shared
    prefix) equal those after the same prefix from RAM (log-probabilities bit for bit: the same
    KV) and after a cold prefill (log-probabilities within fp32 rounding); the restore is
    counted as an SSD hit and usage.cached_tokens counts its tokens."""
    first = _ids(tok, "The cold tier keeps prefixes on disk across restarts. " * 3)
    second = [*first, *_ids(tok, " Then a new question follows.")]

    async with _engine(model, tok, tmp_path) as writer:
        done = await writer.complete_prompt(first, GREEDY)
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable
        assert (await writer.stats())["ssd_cache"]["entries"] >= 1

    async with _engine(model, tok, tmp_path) as restarted:
        restored, restored_lp, restored_cached = await _continue(restarted, second)
        stats = await restarted.stats()
    shared = _shared([*first, *done.token_ids], second)
    assert restored_cached == shared >= len(first)
    assert (stats["ssd_cache"]["hits"], stats["ssd_cache"]["restores"]) == (1, 1)
    assert stats["prompt_cache"]["hits"] == 0

    async with _engine(model, tok, None) as plain:
        await plain.complete_prompt(first, GREEDY)
        ram, ram_lp, ram_cached = await _continue(plain, second)
    async with _engine(model, tok, None, prompt_cache_bytes=0) as uncached:
        cold, cold_lp, cold_cached = await _continue(uncached, second)
    assert (ram_cached, cold_cached) == (shared, 0)
    assert restored == ram == cold
    assert restored_lp == ram_lp
    assert restored_lp == pytest.approx(cold_lp, abs=1e-4)


async def test_closing_the_engine_writes_what_is_not_on_disk_yet(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """With write-behind off, closing the engine (what SIGTERM does) still flushes the RAM
    entries to disk, and the next engine serves the conversation's next turn from them."""
    first = _ids(tok, "A conversation that must survive a restart of the server. " * 2)
    second = [*first, *_ids(tok, " And the next turn.")]
    async with _engine(model, tok, tmp_path, ssd_writebehind=False) as writer:
        done = await writer.complete_prompt(first, GREEDY)
        assert (await writer.stats())["ssd_cache"]["entries"] == 0
    async with _engine(model, tok, tmp_path) as restarted:
        _, _, cached = await _continue(restarted, second)
        stats = await restarted.stats()
    assert cached == _shared([*first, *done.token_ids], second) >= len(first)
    assert stats["ssd_cache"]["hits"] == 1


async def test_idle_entries_move_to_disk_and_serve_the_next_request(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """An entry unused for ssd_demote_idle seconds leaves RAM for the SSD tier (counted as a
    demotion), and the next turn of its conversation is restored from the file."""
    first = _ids(tok, "An idle conversation goes to disk. " * 3)
    second = [*first, *_ids(tok, " Later, it continues.")]
    async with _engine(
        model, tok, tmp_path, ssd_demote_idle=0.2, ssd_writebehind=False
    ) as engine:
        done = await engine.complete_prompt(first, GREEDY)
        stats = await _wait_for(
            lambda s: s["prompt_cache"]["entries"] == 0
            and s["ssd_cache"]["entries"] == 1
            and s["ssd_cache"]["pending_spills"] == 0,
            engine,
        )
        assert stats["ssd_cache"]["demotions"] == 1
        _, _, cached = await _continue(engine, second)
        stats = await engine.stats()
    assert cached == _shared([*first, *done.token_ids], second) >= len(first)
    assert (stats["ssd_cache"]["hits"], stats["prompt_cache"]["hits"]) == (1, 0)


def _hostile_variants(valid: bytes, scratch: Path, fingerprint: str) -> list[bytes]:
    """Malformed copies of ``valid`` made with the codec's hostile corpus; each one checked
    to be refused by the header reader (a mutation that does not apply to this file's
    shape is left out)."""
    from kernels.cache import CacheFileCorrupt, CacheFileIncompatible, read_header
    from kernels.cache._file_port import OsFilePort
    from kernels.cache._kv_format import PREAMBLE_SIZE
    from tests.kernels.cache import test_kv_file_hostile as corpus

    header_len = struct.unpack("<I", valid[12:16])[0]
    edits: list[Any] = [
        lambda p: p.write_bytes(valid[: len(valid) // 2]),  # truncated in the data
        lambda p: p.write_bytes(valid[: PREAMBLE_SIZE + header_len // 2]),  # in the header
        lambda p: p.write_bytes(valid[:20]),  # inside the preamble
        lambda p: p.write_bytes(valid + b"\x00"),  # appended bytes
        lambda p: corpus._flip(p, 3),  # wrong magic
        lambda p: p.write_bytes(valid[:8] + struct.pack("<I", 2) + valid[12:]),  # version 2
        lambda p: p.write_bytes(valid[:12] + struct.pack("<I", 1 << 31) + valid[16:]),  # len past end
        lambda p: p.write_bytes(valid[:12] + struct.pack("<I", 0xFFFFFFFF) + valid[16:]),  # huge
        lambda p: corpus._flip(p, PREAMBLE_SIZE + 40, 2),  # a flipped header bit
        lambda p: corpus._edit_text(p, lambda s: '{"model_id":"x",' + s[1:]),  # duplicate key
        lambda p: corpus._edit_json(p, lambda o: o.update(fingerprint="someone-else")),  # foreign
    ]
    for param in corpus.MUTATIONS:
        mutate = param.values[0]
        edits.append(lambda p, mutate=mutate: corpus._edit_json(p, mutate))
    port = OsFilePort()
    variants: list[bytes] = []
    for i, edit in enumerate(edits):
        path = scratch / f"variant-{i}.kvt"
        path.write_bytes(valid)
        try:
            edit(path)
        except (IndexError, KeyError, TypeError):
            continue  # NOTE: the mutation names a layer kind this model's file does not have.
        try:
            read_header(port, str(path), expected_fingerprint=fingerprint)
        except (CacheFileCorrupt, CacheFileIncompatible):
            variants.append(path.read_bytes())
    return variants


async def test_hostile_files_are_counted_removed_and_served_as_misses(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """Malformed files placed in the tier's directory (truncations, bad magic, version, header
    lengths, flipped header bits, duplicate keys, foreign fingerprint, every semantic mutation
    of the codec's corpus) are removed and counted at start; a file whose header is valid but
    one tensor has a flipped bit is removed and counted when a request finds it, and that
    request is served as a miss with the same answer as a cold prefill."""
    prompt = _ids(tok, "Hostile files never reach the model. " * 3)
    source = tmp_path / "source"
    async with _engine(model, tok, source) as writer:
        await writer.complete_prompt(prompt[:-6], GREEDY)
        await writer.flush()
    (valid,) = sorted(source.rglob("*.kvt"))
    relative = valid.relative_to(source)
    fingerprint = relative.parts[0]
    async with _engine(model, tok, None, prompt_cache_bytes=0) as uncached:
        reference = await uncached.complete_prompt(prompt, GREEDY)

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    variants = _hostile_variants(valid.read_bytes(), scratch, fingerprint)
    assert len(variants) >= 40
    tier = tmp_path / "hostile"
    namespace_dir = tier / relative.parent
    namespace_dir.mkdir(parents=True)
    for i, data in enumerate(variants):
        (namespace_dir / f"hostile-{i}.kvt").write_bytes(data)
    async with _engine(model, tok, tier) as engine:
        stats = await engine.stats()
        assert (stats["ssd_cache"]["corrupt_removed"], stats["ssd_cache"]["entries"]) == (
            len(variants),
            0,
        )
        assert not any(namespace_dir.iterdir())
        served = await engine.complete_prompt(prompt, GREEDY)
    assert (served.token_ids, served.usage.cached_tokens) == (reference.token_ids, 0)

    from kernels.cache import read_header
    from kernels.cache._file_port import OsFilePort

    header = read_header(OsFilePort(), str(valid))
    for i, tensor in enumerate(header.tensors):
        flipped = tmp_path / f"flipped-{i}"
        target = flipped / relative
        target.parent.mkdir(parents=True)
        raw = bytearray(valid.read_bytes())
        raw[tensor.offset + tensor.nbytes // 2] ^= 1 << (i % 8)
        target.write_bytes(bytes(raw))
        async with _engine(model, tok, flipped) as engine:
            assert (await engine.stats())["ssd_cache"]["entries"] == 1
            served = await engine.complete_prompt(prompt, GREEDY)
            # NOTE: the reader's pass reports the bad file after its answer.
            for _ in range(500):
                stats = await engine.stats()
                if stats["ssd_cache"]["corrupt_removed"]:
                    break
                await anyio.sleep(0.01)
        assert (served.token_ids, served.usage.cached_tokens) == (reference.token_ids, 0)
        cold = stats["ssd_cache"]
        assert (cold["restore_failures"], cold["corrupt_removed"]) == (1, 1)
        assert not target.exists()


async def test_fifty_prompts_never_put_more_than_the_cap_on_disk(
    tmp_path: Path, model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a small ssd_cache_max_bytes, 50 distinct prompts written to the tier never put
    more bytes on disk (temp files included) than the cap: measured by the file port before
    every write, fsync and rename and after every temp file's truncate, and after each request."""
    from actors.ssd_writer import actor as ssd_actor
    from tests.actors.ssd_writer.support import ForwardingPort, disk_bytes

    tier = tmp_path / "tier"

    class Measuring(ForwardingPort):
        max_seen = 0

        def _before(self, method: str, *args: Any) -> None:
            if method in ("pwrite_all", "fsync", "replace"):
                Measuring.max_seen = max(Measuring.max_seen, disk_bytes(tier))

        def truncate(self, fd: int, size: int) -> None:
            super().truncate(fd, size)
            Measuring.max_seen = max(Measuring.max_seen, disk_bytes(tier))

    monkeypatch.setattr(ssd_actor, "OsFilePort", Measuring)
    params = GenerationParams(max_tokens=2)
    prompts = [_ids(tok, f"prompt number {i:02d} asks something else. ") for i in range(50)]
    cap = 5 * 80 * 1024  # NOTE: about five of these files (16 KiB header + 4 aligned tensors)
    async with _engine(model, tok, tier, ssd_cache_max_bytes=cap) as engine:
        for prompt in prompts:
            await engine.complete_prompt(prompt, params)
            flushed = await engine.flush()
            assert flushed is not None
            assert disk_bytes(tier) <= cap
        stats = (await engine.stats())["ssd_cache"]
    assert 0 < Measuring.max_seen <= cap
    assert stats["spills"] >= 50
    assert stats["evicted"] >= 40
    assert stats["bytes"] <= cap
