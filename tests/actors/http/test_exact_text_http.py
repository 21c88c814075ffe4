"""Through the app over the default model: the answer's text is exactly the decoded tokens, on both endpoints.

``prompt + text`` of ``/v1/completions`` (and the rendered chat prompt +
``content`` of ``/v1/chat/completions``) decodes as the prompt + the
generated tokens, streamed or not; the tokens are the same greedy run done
in-process with the kernel.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from mlx_lm import load as mlx_load

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from kernels import Generation, SamplingParams, encode_prompt, render_chat, run_generation
from tests.kernels.test_exact_text import _STEMS

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

_N = 6
"""Tokens generated per prompt."""


@pytest.fixture(scope="module")
def loaded(default_model_path: Any) -> tuple[Any, Any]:
    """The default model and its tokenizer."""
    loaded = mlx_load(str(default_model_path))
    return loaded[0], loaded[1]


@pytest.fixture
async def client(loaded: tuple[Any, Any]) -> AsyncIterator[httpx.AsyncClient]:
    """The app over an Engine on the default model (no prompt cache: every run is a cold prefill)."""
    model, tok = loaded
    async with Engine.from_loaded(model, tok, model_id="default") as engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            yield c


def _expected(loaded: tuple[Any, Any], prompt: list[int]) -> str:
    """decode(prompt + greedy tokens) minus decode(prompt), from an in-process kernel run."""
    model, tok = loaded
    steps = run_generation(Generation(model, tok, prompt, SamplingParams(max_tokens=_N)))
    ids = [s.token_id for s in steps if s.token_id not in tok.eos_token_ids]
    full = tok.decode(prompt + ids)
    head = tok.decode(prompt)
    assert full.startswith(head)
    return str(full[len(head):])


def _streamed(text: str, key: str) -> str:
    out = ""
    for block in text.split("\n\n"):
        block = block.strip()
        if not block or block == "data: [DONE]":
            continue
        for choice in json.loads(block.removeprefix("data: "))["choices"]:
            part = choice["text"] if key == "text" else choice["delta"].get("content")
            out += part or ""
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_text_is_the_decoded_tokens(client: httpx.AsyncClient,
                                                      loaded: tuple[Any, Any], stream: bool) -> None:
    """/v1/completions: prompt + text == decode(prompt + tokens), leading space kept."""
    _, tok = loaded
    spaced = 0
    for stem in _STEMS[:8]:
        want = _expected(loaded, encode_prompt(tok, stem))
        r = await client.post("/v1/completions", json={"prompt": stem, "max_tokens": _N,
                                                       "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        text = _streamed(r.text, "text") if stream else r.json()["choices"][0]["text"]
        assert text == want, stem
        spaced += text.startswith(" ")
    # NOTE: the case mlx-lm's detokenizer trims must actually occur here.
    assert spaced > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_content_is_the_decoded_tokens(client: httpx.AsyncClient,
                                                  loaded: tuple[Any, Any], stream: bool) -> None:
    """/v1/chat/completions: rendered prompt + content == decode(rendered prompt + tokens)."""
    _, tok = loaded
    for stem in _STEMS[8:12]:
        messages = [{"role": "user", "content": f"Complete: {stem}"}]
        want = _expected(loaded, render_chat(tok, messages))
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": _N,
                                                            "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        text = (_streamed(r.text, "content") if stream
                else r.json()["choices"][0]["message"]["content"])
        assert text == want, stem
