"""Write-behind completes while the engine is busy, and a flush after load is durable.

Real Engine (tiny fp32 Llama, SSD tier in a temp directory, serial lane,
64-step bursts). One request finishes (its prefix becomes dirty), then a
second request decodes without end, so the engine never has an idle turn.
Before the background share (``actors.gateway.core``) write-behind waited
for an idle turn that never came; now the prefix reaches disk while the
long request is still decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import GenerationParams, TokenEvent
from tests.actors.persistence_faults import DEADLINE, PARAMS, ids, serving
from tests.actors.ssd_writer.support import ForwardingPort
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tok))


async def test_write_behind_reaches_disk_while_a_request_keeps_the_engine_busy(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """A finished request's prefix is stored by write-behind while another request is still
    decoding (background turns granted under load), and the long request keeps streaming."""
    async with serving(model, tok, tmp_path, ForwardingPort(), release=lambda: None,
                       max_burst=64) as engine:
        first = ids(tok, "Write-behind keeps up with a busy engine. " * 4)
        await engine.complete_prompt(first, PARAMS)
        endless = GenerationParams(
            max_tokens=1_000_000, logit_bias={int(tok.eos_token_id): -1e9}
        )
        tokens = 0
        stored_while_busy: dict[str, Any] | None = None
        with anyio.fail_after(DEADLINE):
            async with engine.generate(ids(tok, "A request that never ends."), endless) as stream:
                async for event in stream:
                    assert isinstance(event, TokenEvent), event  # NOTE: it never ends by itself.
                    tokens += 1
                    if tokens % 64:
                        continue
                    stats = await engine.stats(timeout=5.0)
                    if stats["ssd_cache"]["writebehind_stored"] >= 1:
                        stored_while_busy = stats
                        break
        assert stored_while_busy is not None
        under_load = stored_while_busy["gateway"]["token"]["background_under_load"]
        assert under_load["turns"] >= 1
        assert stored_while_busy["ssd_cache"]["entries"] >= 1
        flushed = await engine.flush()
    assert flushed is not None
    assert flushed.durable, flushed
