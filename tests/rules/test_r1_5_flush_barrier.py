"""R1-5: an explicit flush waits for all queued work, including a Put still queued in the RAM tier.

``Engine.flush`` sends the durability coordinator one ``FlushAll``; the
coordinator first asks the prompt cache for its statistics (a barrier): the
answer comes only after every message queued before it, so a finished
request's ``Put`` (and the ``Schedule`` it tells the coordinator) is ahead of
the flush. Here the prompt cache is scripted to be slow on each ``Put`` (it
sleeps before handling it), so the request's answer reaches the caller while
its ``Put`` still waits: without the barrier the flush's scope misses that
entry (mutation: queue the FlushAll at once in ``actors/durability/core.py``
instead of asking the barrier: fails).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams
from actors.prompt_cache import PromptCache
from actors.runtime import Context
from messages import Envelope
from messages.prompt_cache import Put
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PUT_DELAY_S = 0.3


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tok))


async def test_flush_right_after_an_answer_covers_a_put_the_ram_tier_has_not_handled(
    tmp_path: Path, model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's Put is still queued in a slow prompt cache when its answer arrives; the
    flush called at once still has it in scope, writes it, and is durable with one file."""
    original = PromptCache.receive
    seen: list[float] = []

    async def slow_receive(self: PromptCache, envelope: Envelope, ctx: Context) -> None:
        if isinstance(envelope.body, Put):
            seen.append(anyio.current_time())
            await anyio.sleep(PUT_DELAY_S)
        await original(self, envelope, ctx)

    monkeypatch.setattr(PromptCache, "receive", slow_receive)
    engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=1 << 26, ssd_cache=tmp_path,
                                ssd_writebehind=False, ssd_demote_idle=0.0)
    async with engine:
        prompt = [int(t) for t in tok.encode("A flush waits for the Put still queued. " * 2)]
        await engine.complete_prompt(prompt, GenerationParams(max_tokens=3))
        answered = anyio.current_time()
        result = await engine.flush(timeout=30.0)
    assert seen, "the request's Put never reached the prompt cache"
    assert answered < seen[0] + PUT_DELAY_S  # NOTE: the answer came while the Put waited.
    assert result is not None
    assert (result.durable, result.scope, result.written) == (True, 1, 1), result
    assert result.entries == 1
