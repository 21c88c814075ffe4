"""A greedy continuation served from a prompt-cache hit equals a cold prefill (fp32)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from actors.prompt_cache import core as core
from kernels import CacheRegistry, Generation, SamplingParams, run_generation
from messages import Put, Release, Take, TakeResult
from tests.tiny_models import kv_llama, tiny_gemma3, tiny_mamba, tiny_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


def _cold(model: Any, tok: Any, prompt: Sequence[int]) -> list[int]:
    return [s.token_id for s in run_generation(Generation(model, tok, prompt, GREEDY))]


class _Tier:
    """The core + a real registry, driven the way the gateway does (docs/prompt-cache.md)."""

    def __init__(self) -> None:
        self.state = core.CoreState(cap_bytes=10**9)
        self.registry = CacheRegistry()
        self.last_entry: tuple[int, ...] = ()

    def serve(self, model: Any, tok: Any, prompt: Sequence[int]) -> tuple[list[int], int]:
        """Take, materialize, generate greedily, register and put; returns (ids, cached)."""
        (reply,) = core.take(self.state, Take(tokens=tuple(prompt)))
        assert isinstance(reply, core.Reply)
        res = reply.body
        assert isinstance(res, TakeResult)
        cache = None
        if res.handle is not None:
            cache = self.registry.materialize(res.handle, res.cached_tokens)
            core.release(self.state, Release(lease_id=res.lease_id or ""))
        gen = Generation(
            model, tok, prompt, GREEDY, cache=cache, cached_tokens=res.cached_tokens
        )
        steps = run_generation(gen)
        done = self.registry.register(gen.cache, offset=len(gen.cache_tokens))
        for effect in core.put(
            self.state, Put(tokens=gen.cache_tokens, handle=done.handle, meta=done.meta)
        ):
            if isinstance(effect, core.Dispose):
                self.registry.dispose(effect.handle)
        self.last_entry = gen.cache_tokens
        return [s.token_id for s in steps], res.cached_tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mamba"])
def test_hit_continuation_equals_cold_prefill(arch: str, tok: Any) -> None:
    """Turn 2 served from turn 1's entry (trimmed where the rules allow) decodes like a cold run."""
    vocab = len(tok)
    model = {
        "llama": lambda: kv_llama(vocab_size=vocab),
        "gemma3": lambda: tiny_gemma3(vocab_size=vocab, sliding_window=64),
        "mamba": lambda: tiny_mamba(vocab_size=vocab),
    }[arch]()
    first = _ids(tok, "the cat sat on the mat")
    tier = _Tier()
    out1, cached1 = tier.serve(model, tok, first)
    assert cached1 == 0
    assert out1 == _cold(model, tok, first)
    entry = tier.last_entry  # what turn 1's cache covers (prompt + forwarded reply)

    # an exact extension of turn 1 (prompt + reply + more): every kind can serve it
    extended = first + out1 + _ids(tok, " and then")
    assert extended[: len(entry)] == list(entry)
    out2, cached2 = tier.serve(model, tok, extended)
    assert cached2 == len(entry)
    assert out2 == _cold(model, tok, extended)

    # a prompt diverging inside turn 1's prompt: needs a trim (not for recurrent state)
    diverged = first[:10] + _ids(tok, " dog ran")
    out3, cached3 = tier.serve(model, tok, diverged)
    assert cached3 == (0 if arch == "mamba" else 10)
    assert out3 == _cold(model, tok, diverged)


def test_wrapped_ring_serves_only_exact_prefixes(tok: Any) -> None:
    """A sliding-window entry past its window is reused for an extension but not trimmed."""
    model = tiny_gemma3(vocab_size=len(tok), sliding_window=8)
    tier = _Tier()
    first = _ids(tok, "a long enough prompt")
    out1, _ = tier.serve(model, tok, first)
    entry = tier.last_entry
    assert len(entry) > 8  # the ring wrapped
    extended = first + out1 + _ids(tok, " more")
    out2, cached2 = tier.serve(model, tok, extended)
    assert cached2 == len(entry)
    assert out2 == _cold(model, tok, extended)
    _, cached3 = tier.serve(model, tok, first[:5] + _ids(tok, "zz"))
    assert cached3 == 0
