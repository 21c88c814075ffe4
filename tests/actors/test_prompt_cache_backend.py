"""The MLX backend's side of the prompt cache: what it registers and snapshots."""

from __future__ import annotations

import mlx.core as mx

from actors.backend import MlxBackend
from kernels import CacheRegistry, Generation, SamplingParams, cache_arrays, run_generation
from tests.tiny_models import tiny_llama, tiny_tokenizer


def test_a_cache_that_disagrees_with_its_token_record_is_never_registered() -> None:
    """register/snapshot refuse (None, nothing kept) when the live cache holds more tokens
    than the generation's token record, instead of indexing KV under the wrong tokens."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    registry = CacheRegistry()
    backend = MlxBackend(model, tok, prefill_step_size=64, registry=registry)
    prompt = [int(t) for t in tok.encode("a prompt for the registry")]
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=4))
    run_generation(gen)
    recorded = len(gen.cache_tokens)
    # NOTE: one token forwarded behind the generation's back: its record is now short by one.
    mx.eval(model(mx.array([[5]]), cache=gen.cache), *cache_arrays(gen.cache))
    assert gen.cache[0].offset == recorded + 1
    assert backend.snapshot(gen) is None
    assert backend.register(gen) is None
    assert len(registry) == 0


def test_an_agreeing_cache_is_registered_under_its_tokens() -> None:
    """A finished generation's cache is registered under exactly its token record."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    registry = CacheRegistry()
    backend = MlxBackend(model, tok, prefill_step_size=64, registry=registry)
    gen = Generation(model, tok, [int(t) for t in tok.encode("hello")], SamplingParams(max_tokens=4))
    run_generation(gen)
    kept = backend.register(gen)
    assert kept is not None
    assert kept.tokens == gen.cache_tokens
    assert kept.meta.offset == len(gen.cache_tokens)
