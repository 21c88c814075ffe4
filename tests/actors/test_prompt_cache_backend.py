"""The MLX backend's side of the prompt cache: what it registers and snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from actors.backend import MlxBackend
from kernels import CacheRegistry, Generation, SamplingParams, run_generation
from tests.tiny_models import tiny_llama, tiny_tokenizer


@dataclass
class _Recorded:
    """A generation's cache with a token record that may disagree with it."""

    cache: list[Any]
    cache_tokens: tuple[int, ...]


@pytest.fixture(scope="module")
def finished() -> Generation:
    """A tiny Llama generation run to completion."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    prompt = [int(t) for t in tok.encode("a prompt for the registry")]
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=4))
    run_generation(gen)
    return gen


def _backend(registry: CacheRegistry) -> MlxBackend:
    tok = tiny_tokenizer()
    return MlxBackend(tiny_llama(vocab_size=len(tok)), tok, prefill_step_size=64, registry=registry)


def test_a_token_record_that_disagrees_with_the_cache_is_never_registered(
    finished: Generation,
) -> None:
    """register/snapshot refuse (None, nothing kept) when the cache holds a different number
    of tokens than the token record says, instead of indexing KV under the wrong tokens."""
    registry = CacheRegistry()
    backend = _backend(registry)
    tokens = finished.cache_tokens
    short = _Recorded(finished.cache, tokens[:-1])
    assert backend.snapshot(short) is None
    assert backend.register(short) is None
    assert len(registry) == 0
    kept = backend.register(_Recorded(finished.cache, tokens))
    assert kept is not None
    assert kept.tokens == tokens
    assert kept.meta.offset == len(tokens)
