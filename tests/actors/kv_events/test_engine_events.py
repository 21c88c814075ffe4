"""KV events from a running Engine (tiny fp32 Llama, RAM + SSD tiers) rebuilt by a plain ZMQ subscriber.

Through evictions, write-behind stores, SSD demotions and a restart on the
same SSD directory, the subscriber's block index equals the server's: the
RAM tier's as the publisher holds it, and the SSD tier's as the files on
disk say (each file's header names its namespace and tokens).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from actors.engine import Engine, GenerationParams
from actors.kv_events import block_digests, external_hash, namespace_root
from actors.ssd_writer import io
from kernels import resolve_kv_scheme
from kernels.cache import OsFilePort
from messages.kv_events import BlockIndex, BlockIndexRequest
from tests.actors.kv_events.subscriber import Subscriber
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant; answer briefly. "


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _disk_blocks(root: Path, scheme: str) -> set[int]:
    """The block hashes the SSD files on disk hold (read from their headers)."""
    (fp_dir,) = [p for p in root.iterdir() if p.is_dir()]
    scan = io.scan(OsFilePort(), str(root), fp_dir.name, tokenizer_hash=None, max_header_bytes=None)
    out: set[int] = set()
    for f in scan.files:
        assert f.entry is not None
        rt = namespace_root(model=IDENTITY.fingerprint, kv_scheme=scheme, namespace=f.entry.namespace)
        out |= {external_hash(d) for d in block_digests(rt, f.entry.tokens)}
    return out


async def _index(engine: Engine) -> BlockIndex:
    system = engine.system
    assert system is not None
    return await system.ref("kv_events").ask(BlockIndexRequest(), timeout=5, expect=BlockIndex)


async def _run(engine: Engine, tok: Any, text: str) -> None:
    ids = [int(t) for t in tok.encode(text)]
    async with engine.generate(ids, GenerationParams(max_tokens=6)) as stream:
        async for _ in stream:
            pass


async def test_subscriber_rebuilds_block_index_through_evictions_demotion_restart(
    tmp_path: Path,
) -> None:
    """The ZMQ subscriber's block index equals the server's after evictions, a demotion and a restart."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    pub, rep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    options: dict[str, Any] = {
        # NOTE: about two ~90-token entries fit: later requests evict earlier ones.
        "prompt_cache_bytes": 110_000, "ssd_cache": tmp_path, "ssd_demote_idle": 0.0,
        # NOTE: about four files fit: stores evict older files on disk too.
        "ssd_cache_max_bytes": 220_000,
        "kv_events": pub, "kv_events_replay": rep,
    }
    sub = Subscriber(pub, rep)
    try:
        engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **options)
        async with engine:
            await sub.resync()
            for i in range(6):
                first = f"{SYSTEM}conversation {i}: tell me about item {i * 7}."
                await _run(engine, tok, first)
                if i % 2 == 0:
                    # NOTE: a growing conversation: its longer entry supersedes the first.
                    await _run(engine, tok, f"{first} And then? Say more about {i}.")
            assert (await engine.flush()) is not None
            stats = await engine.stats(timeout=5)
            assert stats["prompt_cache"]["evicted"] > 0
            assert stats["ssd_cache"]["evicted"] + stats["ssd_cache"]["superseded"] > 0
            await sub.pump()
            index = await _index(engine)
            disk = sub.mirror.blocks["DISK"]
            assert disk, "write-behind stored files, so the disk tier holds blocks"
            assert sub.mirror.blocks["CPU"] == set(index.cpu)
            assert len(index.cpu) > 0
            assert disk == set(index.disk)
            # NOTE: the engine resolves its KV scheme the same way (no model dir here).
            scheme = resolve_kv_scheme(engine.config.kv_quant, None).cache_key
            assert disk == _disk_blocks(tmp_path, scheme)
            demoted = await engine.demote_cache()
            assert demoted is not None
            assert demoted.result.spilled > 0
            await sub.pump()
            assert sub.mirror.blocks["CPU"] == set()
            assert sub.mirror.blocks["DISK"] == _disk_blocks(tmp_path, scheme)
            before_restart = set(sub.mirror.blocks["DISK"])
        # NOTE: a clean stop removes the RAM tier's entries (already none) and keeps the files.
        engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **options)
        async with engine:
            # NOTE: the SSD index answers its first ask after the startup scan, whose
            # report it told the publisher before; the replay ask queues behind that.
            assert (await engine.stats(timeout=20))["ssd_cache"]["ready"] is True
            await sub.resync()
            await sub.pump()
            assert sub.mirror.blocks["DISK"] == _disk_blocks(tmp_path, scheme) == before_restart
            assert sub.mirror.blocks["CPU"] == set()
            await _run(engine, tok, f"{SYSTEM}conversation 9: a new question.")
            await sub.pump()
            index = await _index(engine)
            assert sub.mirror.blocks["CPU"] == set(index.cpu)
            assert len(index.cpu) > 0
            assert sub.mirror.blocks["DISK"] == set(index.disk)
    finally:
        sub.close()

