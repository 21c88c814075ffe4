"""Through the real ``openai`` client, a resumed answer is indistinguishable from a fresh one.

A first Engine is cancelled mid-answer (its checkpoints stay), a second one
on the same SSD directory serves the identical request over the HTTP app:
streamed and not, the client sees the same chunks, text, finish reason and
usage as from a server that never had a checkpoint, and ids of the same form.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import PROMPT
from tests.actors.checkpoints.restart_support import section as _section
from tests.actors.checkpoints.restart_support import tiny_engine as _engine
from tests.actors.checkpoints.restart_support import tokens as _tokens
from tests.actors.checkpoints.restart_support import until_written as _until_written
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

MAX = 40


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return kv_llama(vocab_size=len(tiny_tokenizer()))


@asynccontextmanager
async def _client(engine: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(engine, HttpSettings())
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t",
                                 timeout=120) as http:
        yield openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                                 max_retries=0)


async def _answers(client: openai.AsyncOpenAI) -> tuple[Any, list[str], Any]:
    """The non-streamed completion, then the streamed chunks' texts and the last chunk."""
    full = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX,
                                           temperature=0.8, seed=3)
    texts: list[str] = []
    last: Any = None
    stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX,
                                             temperature=0.8, seed=3, stream=True)
    async for chunk in stream:
        texts.extend(c.text for c in chunk.choices)
        last = chunk
    return full, texts, last


async def test_resumed_answer_looks_like_a_fresh_one_to_the_openai_client(
    model: Any, tmp_path: Path
) -> None:
    """Same text, chunks, finish reason and usage as a fresh server; ids of the same form."""
    params = GenerationParams(max_tokens=MAX, temperature=0.8, seed=3)
    async with _engine(model, None, every=0) as plain, _client(plain) as client:
        fresh_full, fresh_texts, fresh_last = await _answers(client)
    roots = (tmp_path / "a", tmp_path / "b")
    for root in roots:
        async with _engine(model, root) as first:
            await _tokens(first, params, cancel_after=21)
            await _until_written(first, 2)
    async with _engine(model, roots[0]) as second, _client(second) as client:
        full = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX,
                                               temperature=0.8, seed=3)
        assert (await _section(second))["resumed"] == 1
    async with _engine(model, roots[1]) as third, _client(third) as client:
        texts: list[str] = []
        last: Any = None
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX,
                                                 temperature=0.8, seed=3, stream=True)
        async for chunk in stream:
            texts.extend(c.text for c in chunk.choices)
            last = chunk
        assert (await _section(third))["resumed"] == 1
    assert full.choices[0].text == fresh_full.choices[0].text
    assert full.choices[0].finish_reason == fresh_full.choices[0].finish_reason == "length"
    assert full.usage is not None
    assert fresh_full.usage is not None
    assert full.usage.completion_tokens == fresh_full.usage.completion_tokens == MAX
    assert full.usage.prompt_tokens == fresh_full.usage.prompt_tokens
    assert full.id.split("-")[0] == fresh_full.id.split("-")[0]
    assert texts == fresh_texts
    assert last.choices[0].finish_reason == fresh_last.choices[0].finish_reason
