"""``/metrics`` and the flush answer carry the generation checkpoints' figures (tiny Llama, real SSD directory).

A first Engine checkpoints an answer every 8 tokens and is cancelled after
18 (two checkpoints written); a second Engine on the same directory
resumes the identical request. Each app's ``/metrics`` is parsed with
prometheus_client's parser and must hold what the run did: files written
and their bytes, the resume and the tokens it saved; the flush answer
reports the checkpoint writes lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from actors.checkpoints import CHECKPOINT_DIR
from actors.engine import Engine
from actors.http import HttpSettings, create_app
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import tokens
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = [3 + (i * 7) % 80 for i in range(30)]
PARAMS = GenerationParams(max_tokens=40)


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


def _engine(model: Any, root: Path, every: int = 8) -> Engine:
    # NOTE: a stream of 2 events keeps the engine within 3 tokens of its
    # reader, so a cancel after 18 tokens lands before the boundary at 24
    # however loaded the machine (with the default 64 the engine ran ahead
    # of a slow reader and took a third checkpoint).
    return Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=1,
                              ssd_writebehind=False, generation_checkpoint=every,
                              stream_buffer=2)


async def _tokens(engine: Engine, cancel_after: int | None = None) -> list[int]:
    return await tokens(engine, PARAMS, cancel_after=cancel_after, prompt=PROMPT)


async def _until_written(engine: Engine, n: int) -> None:
    with anyio.fail_after(60):
        while True:
            if (await engine.stats(timeout=5))["generation_checkpoints"]["written"] >= n:
                return
            await anyio.sleep(0.05)


def _newest(root: Path) -> list[str]:
    """The sample-index suffixes of the checkpoint files under ``root``."""
    return sorted(p.name.rsplit("-", 1)[1] for p in root.glob(f"*/{CHECKPOINT_DIR}/*.kvc"))


def _value(text: str, name: str, **labels: str) -> float:
    samples: list[Sample] = [s for f in text_string_to_metric_families(text) for s in f.samples]
    found = [s.value for s in samples if s.name == name and all(
        s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, [s for s in samples if "checkpoint" in s.name])
    return found[0]


async def _scrape(engine: Engine) -> tuple[str, dict[str, Any]]:
    """The app's /metrics page and its flush answer's body."""
    app = create_app(engine, HttpSettings(admin_loopback=True))
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
        flushed = await client.post("/admin/cache/flush",
                                    headers={"content-type": "application/json"})
        # NOTE: past the one-second snapshot reuse of an earlier scrape (none here).
        text = (await client.get("/metrics")).text
    body: dict[str, Any] = flushed.json()
    return text, body


async def test_metrics_count_checkpoints_written_and_a_resume_with_its_saved_tokens(
    model: Any, tmp_path: Path
) -> None:
    """First engine: 2 written with their bytes, 0 resumed; second: 1 resumed, 16 generated
    tokens saved, prompt tokens saved as /stats says; both flushes report 0 checkpoints lost."""
    async with _engine(model, tmp_path) as first:
        await _tokens(first, cancel_after=18)
        await _until_written(first, 2)
        text, flush = await _scrape(first)
        section = (await first.stats(timeout=5))["generation_checkpoints"]
    assert flush["checkpoints_lost"] == 0
    assert _value(text, "kvtier_checkpoint_interval_tokens") == 8
    assert _value(text, "kvtier_checkpoints_taken_total") == 2
    assert _value(text, "kvtier_checkpoints_written_total") == 2
    assert section["bytes"] > 0
    assert _value(text, "kvtier_checkpoint_bytes_total") == section["bytes"]
    assert _value(text, "kvtier_checkpoints_resumed_total") == 0
    assert _value(text, "kvtier_checkpoints_pending") == 0
    for kind in ("unsent", "write", "resume"):
        assert _value(text, "kvtier_checkpoint_failures_total", kind=kind) == 0
    assert _newest(tmp_path) == ["16.kvc"]

    async with _engine(model, tmp_path) as second:
        assert len(await _tokens(second)) == 40
        text, flush = await _scrape(second)
        section = (await second.stats(timeout=5))["generation_checkpoints"]
    assert flush["checkpoints_lost"] == 0
    assert _value(text, "kvtier_checkpoints_resumed_total") == 1
    assert _value(text, "kvtier_checkpoint_tokens_saved_total", kind="generated") == 16
    assert _value(text, "kvtier_checkpoint_tokens_saved_total", kind="prompt") \
        == section["prompt_tokens_saved"]
    assert section["prompt_tokens_saved"] > 0


async def test_no_checkpoint_families_while_checkpoints_are_off(model: Any, tmp_path: Path) -> None:
    """With --generation-checkpoint 0 the page has no kvtier_checkpoint* family."""
    async with _engine(model, tmp_path, every=0) as engine:
        await _tokens(engine, cancel_after=3)
        text, _ = await _scrape(engine)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "kvtier_engine_up" in names
    assert not any("checkpoint" in n for n in names)
