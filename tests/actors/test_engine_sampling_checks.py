"""The Engine checks sampling fields against the model before admission, and sampled requests never break each other."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine import Engine, GenerationParams, InvalidRequest
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny Llama over its vocabulary."""
    return lively_llama(len(tok))


async def test_top_k_over_the_vocabulary_is_refused_before_admission(model: Any, tok: Any) -> None:
    """top_k above vocab_size is InvalidRequest naming top_k; nothing is admitted."""
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as eng:
        assert eng.vocab_size == model.args.vocab_size
        with pytest.raises(InvalidRequest, match="top_k"):
            await eng.generate([3, 4], GenerationParams(max_tokens=2, temperature=0.8,
                                                        top_k=10**6)).start()
        assert (await eng.stats())["gateway"]["token"]["requests"]["admitted"] == 0


async def test_sampled_requests_keep_working_around_a_full_vocabulary_top_k(model: Any,
                                                                           tok: Any) -> None:
    """Unseeded sampled requests before and after a top_k == vocab_size request all complete."""
    vocab = model.args.vocab_size
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as eng:
        for params in (GenerationParams(max_tokens=3, temperature=0.7),
                       GenerationParams(max_tokens=3, temperature=0.8, top_k=vocab),
                       GenerationParams(max_tokens=3, temperature=0.7),
                       GenerationParams(max_tokens=3, temperature=0.7, top_k=5)):
            done = await eng.complete_prompt([3, 4, 5], params)
            # NOTE: unseeded sampling may draw an end-of-sequence token early;
            # what matters is that every request completes instead of failing.
            assert done.finish_reason in ("length", "stop")
            assert 1 <= done.usage.completion_tokens <= 3
            assert done.finish_reason == "stop" or done.usage.completion_tokens == 3
