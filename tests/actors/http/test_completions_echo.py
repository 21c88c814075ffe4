"""``/v1/completions`` with ``echo``: the prompt's text and scores, through the app over a REAL Engine.

The scores come from the engine's prefill of a tiny random llama; the
reference is one forward of the whole prompt and its float32 log-softmax.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from kernels.engine import MAX_PROMPT_LOGPROB_ENTRIES, TokenBytes
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

URL = "/v1/completions"
PROMPT = "The cat sat on the mat. The dog sat on the log."


@pytest.fixture(scope="module")
def tok() -> Any:
    """A byte-level tokenizer covering every byte (multi-byte characters split across tokens)."""
    return tiny_tokenizer(all_bytes=True)


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny random llama over ``tok``'s vocabulary."""
    return lively_llama(len(tok._tokenizer))


@pytest.fixture
async def client(model: Any, tok: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app over an Engine on the tiny llama, prompt cache on, prefill chunks of 8 tokens."""
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=64 << 20,
                                  prefill_step_size=8) as engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            yield c


def _reference(model: Any, ids: list[int]) -> mx.array:
    logits = model(mx.array(ids)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _sse(text: str) -> list[Any]:
    return [json.loads(b.removeprefix("data: ")) for b in text.split("\n\n")
            if b.strip() and b.strip() != "data: [DONE]"]


def _joined(chunks: list[Any]) -> tuple[str, dict[str, list[Any]]]:
    """The streamed choice's text and logprob columns, concatenated."""
    text = ""
    cols: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            lp = choice.get("logprobs")
            if lp:
                for key in cols:
                    cols[key].extend(lp[key])
    return text, cols


async def test_echo_scores_without_generating(client: httpx.AsyncClient, model: Any, tok: Any) -> None:
    """echo + logprobs + max_tokens 0 (lm-eval's loglikelihood): the prompt's tokens and scores, nothing generated."""
    ids = [int(t) for t in tok.encode(PROMPT)]
    r = await client.post(URL, json={"prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": 0,
                                     "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    lp = choice["logprobs"]
    spell = TokenBytes(tok)
    # NOTE: a prompt of ids echoes what they spell (the tokenizer's BOS included).
    spelled = b"".join(spell(ids)).decode()
    assert spelled == "<s>" + PROMPT
    assert choice["text"] == spelled
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert lp["tokens"] == [b.decode() for b in spell(ids)]
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    ref = _reference(model, ids)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        assert len(top) == 2
        best = int(mx.argmax(ref[i]).item())  # type: ignore[arg-type]
        assert max(top.values()) == pytest.approx(ref[i, best].item(), abs=1e-4)
    assert lp["text_offset"] == [spelled.index(t, o) for t, o in zip(lp["tokens"], lp["text_offset"],
                                                                      strict=True)]
    assert lp["text_offset"][:2] == [0, 3]
    assert len(lp["text_offset"]) == len(ids)


async def test_streamed_echo_joins_to_the_whole_answer(client: httpx.AsyncClient, tok: Any) -> None:
    """The streamed echo (prompt first, then generated tokens) joins to the non-streamed answer."""
    req = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = (await client.post(URL, json=req)).json()["choices"][0]
    r = await client.post(URL, json={**req, "stream": True})
    text, cols = _joined(_sse(r.text))
    assert text == whole["text"]
    assert cols == {k: whole["logprobs"][k] for k in cols}
    assert whole["text"].startswith(PROMPT)
    assert len(whole["text"]) > len(PROMPT)
    n = len(tok.encode(PROMPT))
    offsets = whole["logprobs"]["text_offset"]
    # NOTE: a string prompt echoes as sent: the BOS the tokenizer added sits at 0,
    # every prompt token at its place in the prompt, the generated ones after it.
    assert whole["logprobs"]["tokens"][:2] == ["<s>", "T"]
    assert offsets[:3] == [0, 0, 1]
    assert offsets[n - 1] == len(PROMPT) - 1
    assert offsets[n] == len(PROMPT)
    assert len(whole["logprobs"]["tokens"]) == n + 4


async def test_echo_without_logprobs_puts_the_prompt_first(client: httpx.AsyncClient, tok: Any) -> None:
    """echo alone: the text is the prompt (a token-id prompt spelled) and the completion."""
    plain = (await client.post(URL, json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})).json()
    echoed = (await client.post(URL, json={"prompt": PROMPT, "echo": True, "max_tokens": 3,
                                           "temperature": 0})).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None
    ids = [int(t) for t in tok.encode("héllo wörld")]
    by_ids = (await client.post(URL, json={"prompt": ids, "echo": True, "max_tokens": 0})).json()
    assert by_ids["choices"][0]["text"] == "<s>héllo wörld"
    assert by_ids["usage"]["completion_tokens"] == 0


async def test_scoring_takes_no_cached_prefix(client: httpx.AsyncClient) -> None:
    """A cached prefix has no logits: a scoring request prefills the whole prompt, with equal scores each time."""
    req = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    plain = {"prompt": PROMPT, "max_tokens": 2}
    await client.post(URL, json=plain)
    again = (await client.post(URL, json=plain)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    first = (await client.post(URL, json=req)).json()
    second = (await client.post(URL, json=req)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]


async def test_max_tokens_zero_needs_echo(client: httpx.AsyncClient) -> None:
    """max_tokens 0 without echo has nothing to answer: a 400 naming the rule."""
    r = await client.post(URL, json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert "echo" in r.json()["error"]["message"]


async def test_prompt_scores_are_capped(client: httpx.AsyncClient) -> None:
    """Prompt length x (1 + alternatives) past the cap is a 400 before admission."""
    n = MAX_PROMPT_LOGPROB_ENTRIES // 6 + 1
    r = await client.post(URL, json={"prompt": [[65] * n], "echo": True, "logprobs": 5,
                                     "max_tokens": 0})
    assert r.status_code == 400
    assert str(MAX_PROMPT_LOGPROB_ENTRIES) in r.json()["error"]["message"]
    ok = await client.post(URL, json={"prompt": [[65] * 8], "echo": True, "logprobs": 5,
                                      "max_tokens": 0})
    assert ok.status_code == 200


async def test_offsets_of_split_characters(client: httpx.AsyncClient) -> None:
    """A character split over two tokens: both tokens report the character's offset."""
    text = "héllo"
    r = await client.post(URL, json={"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0})
    lp = r.json()["choices"][0]["logprobs"]
    # NOTE: <s>, h, the two bytes of é, l, l, o.
    assert lp["tokens"][2:4] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert lp["text_offset"] == [0, 0, 1, 1, 2, 3, 4]


async def test_echo_reports_the_stop_token(client: httpx.AsyncClient, tok: Any) -> None:
    """lm-eval's request (max_tokens 1) that the model answers with EOS: the prompt's entries plus the EOS one."""
    eos = next(iter(tok.eos_token_ids))
    ids = [int(t) for t in tok.encode(PROMPT)]
    req = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
           "logit_bias": {str(eos): 100}}
    body = (await client.post(URL, json=req)).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == "<s>" + PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["tokens"][-1] == "</s>"
    # NOTE: without echo the stop token stays out of the answer, as before.
    plain = (await client.post(URL, json={**req, "echo": False})).json()["choices"][0]
    assert plain["logprobs"]["tokens"] == []
