"""KV schemes: flag resolution, cache keys, conversion after prefill, byte accounting."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kernels import (
    Generation,
    InvalidKvScheme,
    KvGeometry,
    KvScheme,
    LayerQuant,
    SamplingParams,
    UnsupportedCacheKind,
    cache_arrays,
    cache_signature,
    caches_nbytes,
    convert_caches,
    resolve_kv_scheme,
    run_generation,
)
from kernels.cache import (
    CacheRegistry,
    caches_min_reusable_offset,
    check_kv_scheme,
    declare_min_reusable_offset,
)
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_mamba, tiny_tokenizer

KV8 = KvScheme(kind="affine-uniform", uniform=LayerQuant(bits=8, group_size=32))


def _prefill(model: Any, n: int) -> list[Any]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[i % 90 + 1 for i in range(n)]]), cache=cache), *cache_arrays(cache))
    return cache


def test_resolve_flag_values(tmp_path: Path) -> None:
    """off/4/8 resolve to bf16 and uniform affine; anything else is a typed error."""
    assert resolve_kv_scheme(None) == KvScheme()
    assert resolve_kv_scheme("off").kind == "bf16"
    four = resolve_kv_scheme("4")
    assert (four.kind, four.uniform) == ("affine-uniform", LayerQuant(4, 64))
    assert resolve_kv_scheme(8, group_size=32).uniform == LayerQuant(8, 32)
    for bad in ("3", "16", "fast"):
        with pytest.raises(InvalidKvScheme):
            resolve_kv_scheme(bad)
    with pytest.raises(InvalidKvScheme):
        resolve_kv_scheme("config", tmp_path)
    assert resolve_kv_scheme("config", tmp_path, missing_config="bf16").kind == "bf16"


def test_config_scheme_per_layer(tmp_path: Path) -> None:
    """kv_config.json maps layers to bits/group (null = plain) over a default."""
    (tmp_path / "kv_config.json").write_text(
        json.dumps({"default": {"bits": 8, "group_size": 32}, "layers": {"1": None, "2": {"bits": 4}}})
    )
    scheme = resolve_kv_scheme("config", tmp_path)
    assert scheme.kind == "affine-config"
    assert scheme.layer_quant(0) == LayerQuant(8, 32)
    assert scheme.layer_quant(1) is None
    assert scheme.layer_quant(2) == LayerQuant(4, 64)
    (tmp_path / "kv_config.json").write_text(json.dumps({"layers": {"0": {"bits": 7}}}))
    with pytest.raises(InvalidKvScheme):
        resolve_kv_scheme("config", tmp_path)


def test_cache_keys_tell_schemes_apart(tmp_path: Path) -> None:
    """bf16, kv4, kv8 (and off-default groups) and distinct configs have distinct keys."""
    assert KvScheme().cache_key == "bf16"
    assert resolve_kv_scheme("4").cache_key == "kv4"
    assert resolve_kv_scheme("8").cache_key == "kv8"
    assert resolve_kv_scheme("8", group_size=32).cache_key == "kv8g32"
    a = KvScheme(kind="affine-config", layers=((0, LayerQuant(8)),))
    b = KvScheme(kind="affine-config", layers=((0, LayerQuant(4)),))
    assert a.cache_key.startswith("config-")
    assert a.cache_key != b.cache_key


def test_convert_matches_mlx_lm_and_skips_other_kinds() -> None:
    """Populated KVCache layers become QuantizedKVCache equal to mlx-lm's; rings, state, empties stay."""
    model = tiny_llama(head_dim=32)
    cache = _prefill(model, 20)
    expected = [c.to_quantized(group_size=32, bits=8) for c in cache]
    assert convert_caches(cache, KV8) == 2
    assert all(type(c) is QuantizedKVCache for c in cache)
    assert cache_signature(cache[0]) == "kv:quant:8:32"
    for got, want in zip(cache, expected, strict=True):
        for a, b in zip(cache_arrays([got]), cache_arrays([want]), strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    assert convert_caches(cache, KV8) == 0  # idempotent
    empty = make_prompt_cache(model)
    assert convert_caches(empty, KV8) == 0
    assert all(type(c) is KVCache for c in empty)

    gemma = _prefill(tiny_gemma3(sliding_window=8), 12)
    assert convert_caches(gemma, KV8) == 1  # the full-attention layer only
    assert [type(c) for c in gemma] == [RotatingKVCache, RotatingKVCache, QuantizedKVCache]
    state = _prefill(tiny_mamba(), 6)
    assert convert_caches(state, KV8) == 0
    grouped = [CacheList(*_prefill(model, 4))]  # type: ignore[no-untyped-call]
    assert convert_caches(grouped, KV8) == 0  # mlx-lm leaves CacheList alone too
    assert type(grouped[0]) is CacheList
    with pytest.raises(UnsupportedCacheKind):
        convert_caches([ChunkedKVCache(16)], KV8)  # type: ignore[no-untyped-call]


def test_conversion_frees_each_layer_before_the_next() -> None:
    """Peak memory while converting stays near one layer's output, not every layer's."""
    model = tiny_llama(head_dim=32, layers=8)
    cache = _prefill(model, 512)
    one_layer_q = caches_nbytes([cache[0].to_quantized(group_size=32, bits=8)])
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    convert_caches(cache, KV8)
    peak_growth = mx.get_peak_memory() - before
    # NOTE: quantize needs a transient about one output in size; converting all
    # eight layers before freeing any would peak near 14x one layer's output.
    assert peak_growth <= 3 * one_layer_q


def test_generation_with_kv8_is_bit_exact_with_mlx_lm() -> None:
    """Greedy tokens with the scheme as the generation's cache hook equal mlx-lm's kv_bits path."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), head_dim=32)
    prompt = [int(t) for t in tok.encode("quantized keys and values, please")]

    def quantize(caches: list[Any]) -> None:
        convert_caches(caches, KV8)

    gen = Generation(
        model, tok, prompt, SamplingParams(max_tokens=12, temperature=0.0), cache_hook=quantize
    )
    ours = [s.token_id for s in run_generation(gen)]
    assert all(type(c) is QuantizedKVCache for c in gen.cache)
    theirs = []
    for token, _ in generate_step(
        mx.array(prompt), model, max_tokens=len(ours), kv_bits=8, kv_group_size=32, quantized_kv_start=0
    ):
        theirs.append(int(token))
    assert ours == theirs


@pytest.mark.parametrize("bits", [None, 8])
def test_geometry_bytes_match_real_caches(bits: int | None) -> None:
    """bytes_at equals the real nbytes: full layers grow, rings cap at the window, state is fixed."""
    scheme = KvScheme() if bits is None else KV8
    llama = _prefill(tiny_llama(head_dim=32), 256)
    geometry = KvGeometry.from_caches(llama)
    convert_caches(llama, scheme)
    assert geometry.bytes_at(256, scheme) == caches_nbytes(llama)

    gemma_model = tiny_gemma3(sliding_window=8)
    gemma = _prefill(gemma_model, 255)
    mx.eval(gemma_model(mx.array([[5]]), cache=gemma), *cache_arrays(gemma))  # ring settles at 8
    assert KvGeometry.from_caches(gemma).bytes_at(256) == caches_nbytes(gemma)

    state = _prefill(tiny_mamba(), 4)
    g = KvGeometry.from_caches(state)
    assert g.bytes_at(1) == g.bytes_at(10_000) == caches_nbytes(state)


def test_conversion_happens_after_the_first_prefill_chunk() -> None:
    """With the scheme as the cache hook, the first prefill chunk leaves every layer quantized."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), head_dim=32)
    prompt = [int(t) for t in tok.encode("a prompt of more than one chunk")]

    def quantize(caches: list[Any]) -> None:
        convert_caches(caches, KV8)

    gen = Generation(
        model, tok, prompt, SamplingParams(max_tokens=2), prefill_step_size=5, cache_hook=quantize
    )
    assert all(type(c) is KVCache for c in gen.cache)
    gen.prefill_step()
    assert [type(c) for c in gen.cache] == [QuantizedKVCache, QuantizedKVCache]
    assert [c.offset for c in gen.cache] == [5, 5]
    run_generation(gen)
    assert [cache_signature(c) for c in gen.cache] == ["kv:quant:8:32"] * 2
    assert gen.cache[0].offset == len(gen.cache_tokens)


def test_conversion_keeps_the_declared_minimum_reusable_offset() -> None:
    """A layer that declared a minimum reusable offset keeps it after quantizing, and the
    registry's entry still refuses trims below it."""
    model = tiny_llama(head_dim=32)
    cache = _prefill(model, 12)
    declare_min_reusable_offset(cache[0], 7)
    assert convert_caches(cache, KV8) == 2
    assert type(cache[0]) is QuantizedKVCache
    assert caches_min_reusable_offset(cache) == 7
    meta = CacheRegistry().register(cache, offset=12).meta
    assert meta.min_reusable_offset == 7


def test_a_delayed_conversion_sets_the_minimum_reusable_offset() -> None:
    """Converting only once ``start`` tokens are held is irreversible: the layer may not be
    trimmed below the offset at which it converted (a shorter prefix would have stayed plain)."""
    model = tiny_llama(head_dim=32)
    delayed = dataclasses.replace(KV8, start=8)
    cache = _prefill(model, 5)
    assert convert_caches(cache, delayed) == 0  # below start: stays plain, no bound
    assert caches_min_reusable_offset(cache) == 0
    mx.eval(model(mx.array([[7] * 6]), cache=cache), *cache_arrays(cache))
    assert convert_caches(cache, delayed) == 2
    assert caches_min_reusable_offset(cache) == 11
    undelayed = _prefill(model, 11)
    assert convert_caches(undelayed, KV8) == 2  # start 0: no bound (docs/prompt-cache.md)
    assert caches_min_reusable_offset(undelayed) == 0


def test_check_kv_scheme_refuses_what_conversion_would_fail() -> None:
    """A head dimension the group size does not divide, or a cache class without an adapter,
    is refused up front with a message naming the layer; a fitting model passes."""
    kv8_64 = resolve_kv_scheme(8)
    with pytest.raises(InvalidKvScheme, match=r"head dimension \(16\) is not divisible by the group size 64"):
        check_kv_scheme(tiny_llama(), kv8_64)  # head_dim 16
    check_kv_scheme(tiny_llama(head_dim=64), kv8_64)
    check_kv_scheme(tiny_llama(), KvScheme())  # off: nothing to check
    check_kv_scheme(tiny_gemma3(sliding_window=8), KV8)  # rings stay plain, the full layer fits
    check_kv_scheme(tiny_mamba(), KV8)  # recurrent state is never converted

    class ChunkedModel:
        """A model whose cache class kvtier has no adapter for."""

        def make_cache(self) -> list[Any]:
            return [ChunkedKVCache(16)]  # type: ignore[no-untyped-call]

    with pytest.raises(InvalidKvScheme, match="ChunkedKVCache"):
        check_kv_scheme(ChunkedModel(), KV8)
