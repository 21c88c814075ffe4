"""The MLX backend's side of the prompt cache: what it registers and snapshots."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from actors.backend import MlxBackend
from kernels import CacheRegistry, Generation, SamplingParams, cache_arrays, run_generation
from kernels.engine import SnapshotBoundary
from messages.gateway import Generate, GenerationParams
from tests.tiny_models import kv_llama, tiny_tokenizer


def test_a_cache_that_disagrees_with_its_token_record_is_never_registered() -> None:
    """register/snapshot refuse (None, nothing kept) when the live cache holds more tokens
    than the generation's token record, instead of indexing KV under the wrong tokens."""
    tok = tiny_tokenizer()
    model = kv_llama(vocab_size=len(tok))
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
    model = kv_llama(vocab_size=len(tok))
    registry = CacheRegistry()
    backend = MlxBackend(model, tok, prefill_step_size=64, registry=registry)
    gen = Generation(model, tok, [int(t) for t in tok.encode("hello")], SamplingParams(max_tokens=4))
    run_generation(gen)
    kept = backend.register(gen)
    assert kept is not None
    assert kept.tokens == gen.cache_tokens
    assert kept.meta.offset == len(gen.cache_tokens)



def _chat_snapshot(prefill_step_size: int, tail: int) -> tuple[list[int], list[Any], Any, list[str]]:
    """A chat request through the serial lane with a snapshot point ``tail`` tokens before its end.

    Returns the prompt, the registered snapshot's tokens and caches, the model and the steps' phases.
    """
    tok = tiny_tokenizer()
    model = kv_llama(vocab_size=len(tok))
    prompt = [int(t) for t in tok.encode("a chat prompt whose generation tail is re-rendered")]
    registry = CacheRegistry()
    backend = MlxBackend(
        model,
        tok,
        prefill_step_size=prefill_step_size,
        registry=registry,
        snapshot_boundary=SnapshotBoundary((tuple(prompt[-tail:]),)),
    )
    request = Generate(
        request_id="r", prompt_tokens=tuple(prompt), params=GenerationParams(max_tokens=2), chat=True
    )
    gen = backend.open(request, None, 0)
    phases: list[str] = []
    snaps = []
    while not phases or phases[-1] != "decode":
        result = backend.step(gen)
        phases.append(result.phase)
        if result.snapshot_point:
            snaps.append(backend.snapshot(gen))
    assert len(snaps) == 1, "one snapshot point"
    snap = snaps[0]
    assert snap is not None
    assert snap.meta.offset == len(snap.tokens)
    return prompt, [snap.tokens, list(registry.get(snap.handle))], model, phases


def _prefix_kv(model: Any, prompt: list[int], point: int) -> list[Any]:
    """The serial prefill's cache of ``prompt[:point]`` alone."""
    alone = Generation(model, tiny_tokenizer(), prompt[: point + 1], SamplingParams(max_tokens=1))
    while not alone.prefill_step():
        pass
    return list(alone.cache)


@pytest.mark.parametrize(("step", "phases"), [(64, ["prefill", "decode"]), (8, None)])
def test_a_chat_snapshot_point_is_cut_from_the_chunk_that_reaches_it(
    step: int, phases: list[str] | None
) -> None:
    """A snapshot point 5 tokens before a plain-KV prompt's end does not end a prefill chunk (one
    chunk for the whole suffix when it fits); the snapshot holds exactly the point's tokens, with
    the KV a prefill that stopped there computes."""
    prompt, (tokens, caches), model, seen = _chat_snapshot(prefill_step_size=step, tail=5)
    point = len(prompt) - 5
    if phases is not None:
        assert seen == phases
    else:
        # NOTE: chunks of 8 from 0, never shortened to end at the point.
        assert seen.count("prefill") == -(-(len(prompt) - 1) // step)
    assert tokens == tuple(prompt[:point])
    for ours, theirs in zip(caches, _prefix_kv(model, prompt, point), strict=True):
        assert ours.offset == point
        assert mx.allclose(ours.keys[..., :point, :], theirs.keys[..., :point, :], atol=1e-5).item()
        assert mx.allclose(
            ours.values[..., :point, :], theirs.values[..., :point, :], atol=1e-5
        ).item()
