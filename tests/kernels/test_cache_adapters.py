"""Cache adapters and the registry over real mlx-lm caches of tiny random models."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from kernels import (
    CacheNotTrimmable,
    CacheRegistry,
    UnknownCacheHandle,
    UnsupportedCacheKind,
    cache_arrays,
    cache_signature,
    caches_min_reusable_offset,
    caches_nbytes,
    caches_offset,
    caches_trimmable,
    clone_caches,
    trim_caches,
)
from kernels.cache import CacheOffsetMismatch
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_mamba

WINDOW = 8


def _forward(model: Any, tokens: list[int], cache: list[Any]) -> mx.array:
    logits: mx.array = model(mx.array([tokens]), cache=cache)
    mx.eval(logits, *cache_arrays(cache))
    return logits


def _filled(model: Any, n: int, *, start: int = 1) -> list[Any]:
    cache = make_prompt_cache(model)
    _forward(model, list(range(start, start + n)), cache)
    return cache


def _quantized(model: Any, n: int) -> list[Any]:
    """``n`` tokens prefilled, then every layer converted to 8-bit (groups of 32)."""
    cache = _filled(model, n)
    out: list[Any] = [c.to_quantized(group_size=32, bits=8) for c in cache]
    mx.eval(*cache_arrays(out))
    return out


@pytest.fixture
def no_buffer_cache() -> Iterator[None]:
    """MLX's buffer cache off for the test, so every array gets a buffer of its own size.

    NOTE: with the cache on, an allocation may reuse a larger freed buffer
    (and active memory counts the larger size), which makes memory deltas
    depend on what earlier tests left in the cache.
    """
    mx.clear_cache()
    previous = mx.set_cache_limit(0)
    yield
    mx.set_cache_limit(previous)


def _settled_active_memory() -> int:
    """MLX's active bytes once garbage is collected and queued work has released its inputs."""
    gc.collect()
    mx.synchronize()
    gc.collect()
    return int(mx.get_active_memory())


def _host(caches: list[Any]) -> list[np.ndarray]:
    return [np.array(a) for a in cache_arrays(caches)]


@pytest.fixture(scope="module")
def llama() -> Any:
    """A tiny fp32 Llama (plain KVCache layers)."""
    return tiny_llama()


@pytest.fixture(scope="module")
def llama32() -> Any:
    """A tiny fp32 Llama with head_dim 32, so its K/V quantize in groups of 32."""
    return tiny_llama(head_dim=32)


@pytest.fixture(scope="module")
def gemma() -> Any:
    """A tiny fp32 Gemma 3: two rotating (window 8) layers and one full layer."""
    return tiny_gemma3(sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mamba() -> Any:
    """A tiny fp32 Mamba (recurrent ArraysCache state only)."""
    return tiny_mamba()


def test_signatures_of_every_kind(llama: Any, gemma: Any, mamba: Any) -> None:
    """Each cache class reports its stable signature; a quantized KVCache names bits and group."""
    assert [cache_signature(c) for c in _filled(llama, 4)] == ["kv:plain", "kv:plain"]
    assert [cache_signature(c) for c in _filled(gemma, 4)] == [
        "kv:rotating-plain",
        "kv:rotating-plain",
        "kv:plain",
    ]
    assert [cache_signature(c) for c in _filled(mamba, 4)] == ["ssm", "ssm"]
    plain = _filled(tiny_llama(head_dim=32), 4)[0]
    assert cache_signature(plain.to_quantized(group_size=32, bits=8)) == "kv:quant:8:32"


def test_unknown_cache_class_is_an_error_not_a_route() -> None:
    """A class without an adapter (or an undeclared subclass) raises UnsupportedCacheKind."""

    class MyKV(KVCache):
        pass

    for cache in (ChunkedKVCache(16), MyKV(), object()):  # type: ignore[no-untyped-call]
        with pytest.raises(UnsupportedCacheKind):
            cache_signature(cache)
        with pytest.raises(UnsupportedCacheKind):
            clone_caches([cache])


def test_trim_rules_per_kind(llama: Any, gemma: Any, mamba: Any) -> None:
    """Plain and quantized KV always trim; a ring trims only before it wraps; recurrent state never trims."""
    kv = _filled(llama, 5)
    assert caches_trimmable(kv)
    assert trim_caches(kv, 2) == 2
    assert caches_offset(kv) == 3

    quant = _quantized(tiny_llama(head_dim=32), 5)
    assert caches_trimmable(quant)
    assert trim_caches(quant, 2) == 2
    assert caches_offset(quant) == 3

    ring = _filled(gemma, WINDOW - 2)
    assert caches_trimmable(ring)
    assert trim_caches(ring, 1) == 1
    assert caches_offset(ring) == WINDOW - 3

    wrapped = _filled(gemma, WINDOW + 3)
    assert not caches_trimmable(wrapped)
    assert caches_min_reusable_offset(wrapped) == WINDOW + 3
    with pytest.raises(CacheNotTrimmable):
        trim_caches(wrapped, 1)

    ssm = _filled(mamba, 5)
    assert not caches_trimmable(ssm)
    with pytest.raises(CacheNotTrimmable):
        trim_caches(ssm, 1)
    assert trim_caches(ssm, 0) == 0


_CLONE_CASES = [
    *((kind, False) for kind in ("llama", "llama_kv8", "gemma_prewrap", "gemma_wrapped", "mamba")),
    # only trimmable kinds may be cloned shorter than they are
    *((kind, True) for kind in ("llama", "llama_kv8", "gemma_prewrap")),
]


@pytest.mark.parametrize(("kind", "shorten"), _CLONE_CASES)
def test_clone_writes_never_reach_the_donor(
    kind: str, shorten: bool, llama: Any, llama32: Any, gemma: Any, mamba: Any
) -> None:
    """Decoding on a clone (zero-copy views, whole or shortened) leaves the donor bit-identical."""
    model = {
        "llama": llama,
        "llama_kv8": llama32,
        "gemma_prewrap": gemma,
        "gemma_wrapped": gemma,
        "mamba": mamba,
    }[kind]
    n = WINDOW + 4 if kind == "gemma_wrapped" else 6
    donor = _quantized(model, n) if kind == "llama_kv8" else _filled(model, n)
    before = _host(donor)
    clone = clone_caches(donor, n - 2) if shorten else clone_caches(donor)
    if kind == "llama_kv8":
        assert all(type(c) is QuantizedKVCache for c in clone)
    for tok in (7, 9, 11):
        _forward(model, [tok], clone)
    _forward(model, [3, 4, 5], clone)
    after = _host(donor)
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    if kind != "mamba":
        assert caches_offset(donor) == n
        assert caches_offset(clone) == (n - 2 if shorten else n) + 6


def test_clone_is_zero_copy(llama: Any) -> None:
    """Cloning (and evaluating the views) allocates no new array memory."""
    donor = _filled(llama, 40)
    gc.collect()
    before = mx.get_active_memory()
    clone = clone_caches(donor, 30)
    mx.eval(*cache_arrays(clone))
    assert mx.get_active_memory() == before
    assert caches_offset(clone) == 30


def test_trimmed_clone_continues_like_a_fresh_prefill(llama: Any) -> None:
    """A clone trimmed to k tokens gives the same next logits as prefilling those k tokens."""
    tokens = [5, 17, 3, 99, 42, 8, 61]
    donor = _filled_tokens(llama, tokens)
    clone = clone_caches(donor, 4)
    from_clone = _forward(llama, tokens[4:6], clone)
    fresh = make_prompt_cache(llama)
    _forward(llama, tokens[:4], fresh)
    from_fresh = _forward(llama, tokens[4:6], fresh)
    np.testing.assert_allclose(np.array(from_clone), np.array(from_fresh), rtol=1e-5, atol=1e-5)


def _filled_tokens(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    _forward(model, tokens, cache)
    return cache


def test_clone_refuses_to_shorten_untrimmable_or_below_minimum(gemma: Any, llama: Any) -> None:
    """Shortening a wrapped ring, or below a declared minimum reusable offset, is refused."""
    wrapped = _filled(gemma, WINDOW + 2)
    with pytest.raises(CacheNotTrimmable):
        clone_caches(wrapped, WINDOW)
    kv = _filled(llama, 10)
    for layer in kv:
        layer._kvtier_min_reusable_offset = 6
    assert caches_min_reusable_offset(kv) == 6
    assert caches_min_reusable_offset(clone_caches(kv, 8)) == 6
    with pytest.raises(CacheNotTrimmable):
        clone_caches(kv, 5)


@pytest.mark.parametrize("kind", ["llama", "llama_kv8", "gemma", "mamba"])
@pytest.mark.usefixtures("no_buffer_cache")
def test_registry_bytes_equal_memory_released(
    kind: str, llama: Any, llama32: Any, gemma: Any, mamba: Any
) -> None:
    """An entry's meta.nbytes equals the active memory released when it is disposed and drained."""
    model = {"llama": llama, "llama_kv8": llama32, "gemma": gemma, "mamba": mamba}[kind]
    registry = CacheRegistry()
    # NOTE: Mamba slices its conv state out of the whole padded input, so a long
    # prompt makes an uncompacted state pin ~100x its size.
    n = 1024 if kind == "mamba" else 16
    cache = make_prompt_cache(model)
    _forward(model, [i % 200 + 1 for i in range(n)], cache)
    if kind == "llama_kv8":
        cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
        mx.eval(*cache_arrays(cache))
        assert [cache_signature(c) for c in cache] == ["kv:quant:8:32"] * 2
    reg = registry.register(cache, offset=n)
    assert reg.meta.nbytes == caches_nbytes(cache) > 0
    n_arrays = len(cache_arrays(cache))
    del cache
    before = _settled_active_memory()
    registry.dispose(reg.handle)
    assert registry.drain() == 1
    freed = before - _settled_active_memory()
    # NOTE: exact with MLX's buffer cache off; counting views instead of whole
    # buffers would be off by >= 100 KiB here (a 256-token slab, a Mamba input buffer).
    assert freed == reg.meta.nbytes
    assert n_arrays > 0
    with pytest.raises(UnknownCacheHandle):
        registry.materialize(reg.handle, 4)


def _token_bytes(caches: list[Any]) -> int:
    """Bytes of the tokens a KV cache list really holds (its slabs sliced to ``offset``)."""
    return sum(
        a[..., : c.offset, :].nbytes for c in caches for a in (c.keys, c.values) if c.keys is not None
    )


@pytest.mark.usefixtures("no_buffer_cache")
def test_snapshot_is_a_compact_copy_and_the_live_cache_writes_in_place(llama: Any) -> None:
    """A snapshot keeps exactly its tokens' bytes (not the live 256-token slab), frees
    exactly that, and leaves the live slab unshared so its next write needs no copy."""
    registry = CacheRegistry()
    live = _filled(llama, 10)
    slab = sum(a.nbytes for a in cache_arrays(live))
    snap = registry.snapshot(live, offset=10)
    assert snap.meta.offset == 10
    assert snap.meta.nbytes == _token_bytes(live) == caches_nbytes(registry.get(snap.handle))
    assert snap.meta.nbytes * 20 < slab
    before_write = _settled_active_memory()
    _forward(llama, [1], live)
    # NOTE: a shared slab would be copied whole here (+slab bytes); unshared, the
    # write lands in place and only the step's small activations come and go.
    assert _settled_active_memory() - before_write < slab // 4
    del live
    before = _settled_active_memory()
    registry.dispose(snap.handle)
    registry.drain()
    assert before - _settled_active_memory() == snap.meta.nbytes


@pytest.mark.usefixtures("no_buffer_cache")
def test_short_entries_are_stored_compactly_and_billed_at_what_they_retain(llama: Any) -> None:
    """A 9-token entry keeps 9 tokens of KV, not mlx-lm's 256-token slab, and disposing it
    releases exactly its billed bytes."""
    registry = CacheRegistry()
    cache = _filled(llama, 9)
    slab = sum(a.nbytes for a in cache_arrays(cache))
    reg = registry.register(cache, offset=9)
    stored = list(registry.get(reg.handle))
    assert reg.meta.nbytes == _token_bytes(stored) == caches_nbytes(stored)
    assert reg.meta.nbytes * 20 < slab  # 9 of 256 slots
    del cache, stored
    before = _settled_active_memory()
    registry.dispose(reg.handle)
    registry.drain()
    assert before - _settled_active_memory() == reg.meta.nbytes


def test_long_entries_with_little_slack_are_not_copied(llama: Any) -> None:
    """An entry whose slab is nearly full keeps its own buffers (no copy) and is billed at them."""
    registry = CacheRegistry()
    cache = _filled(llama, 250)
    arrays = cache_arrays(cache)
    reg = registry.register(cache, offset=250)
    stored = cache_arrays(list(registry.get(reg.handle)))
    assert all(a is b for a, b in zip(arrays, stored, strict=True))
    assert reg.meta.nbytes == sum(a.nbytes for a in arrays)


def test_untouched_materialized_views_are_copied_out_of_a_larger_donor(llama: Any) -> None:
    """Registering a lease's untouched 5-token views of a 20-token donor keeps 5 tokens of
    its own instead of pinning the donor (billed at the donor's size before compaction)."""
    registry = CacheRegistry()
    donor = registry.register(_filled(llama, 20), offset=20)
    views = registry.materialize(donor.handle, 5)
    again = registry.register(views, offset=5)
    assert again.meta.offset == 5
    assert again.meta.nbytes == donor.meta.nbytes * 5 // 20
    stored = cache_arrays(list(registry.get(again.handle)))
    assert all(a.shape[-2] == 5 for a in stored)


def test_a_long_view_of_a_donor_is_billed_at_the_donor_buffer(llama: Any) -> None:
    """Views that use most of their donor are kept as views and billed at the whole donor."""
    registry = CacheRegistry()
    donor = registry.register(_filled(llama, 250), offset=250)
    again = registry.register(registry.materialize(donor.handle, 240), offset=240)
    assert again.meta.nbytes == donor.meta.nbytes


def test_register_and_snapshot_refuse_a_wrong_offset(llama: Any, mamba: Any) -> None:
    """A cache whose layers hold a different token count than the caller claims is never
    registered (indexing it would serve KV of other tokens)."""
    registry = CacheRegistry()
    with pytest.raises(CacheOffsetMismatch):
        registry.register(_filled(llama, 6), offset=5)
    with pytest.raises(CacheOffsetMismatch):
        registry.snapshot(_filled(llama, 6), offset=7)
    assert len(registry) == 0
    # recurrent layers have no token axis: the caller's offset is the only record
    assert registry.register(_filled(mamba, 6), offset=6).meta.offset == 6


def test_registry_meta_for_each_kind(llama: Any, gemma: Any, mamba: Any) -> None:
    """EntryMeta records offset, trimmability, minimum reusable offset and signatures."""
    registry = CacheRegistry()
    kv = registry.register(_filled(llama, 6)).meta
    assert (kv.offset, kv.trimmable, kv.min_reusable_offset) == (6, True, 0)
    ring = registry.register(_filled(gemma, WINDOW + 1)).meta
    assert (ring.offset, ring.trimmable, ring.min_reusable_offset) == (WINDOW + 1, False, WINDOW + 1)
    ssm = registry.register(_filled(mamba, 6), offset=6).meta
    assert (ssm.offset, ssm.trimmable, ssm.min_reusable_offset) == (6, False, 6)
    assert ssm.signatures == ("ssm", "ssm")
    views = registry.materialize(registry.register(_filled(mamba, 3), offset=3).handle, 3)
    assert len(views) == 2
    stats = registry.statistics()
    assert stats.entries == 4
    assert stats.registered == 4
    assert stats.materialized == 1


def test_only_plain_and_quantized_kv_without_a_declared_minimum_are_cuttable() -> None:
    """snapshot_cuttable: plain and quantized KV yes; rotating rings, recurrent state and a layer
    with a declared minimum reusable offset (converted during the prefill) no."""
    from kernels.cache import declare_min_reusable_offset, snapshot_cuttable

    assert snapshot_cuttable(make_prompt_cache(tiny_llama(vocab_size=64)))
    assert snapshot_cuttable([KVCache(), QuantizedKVCache()])
    assert not snapshot_cuttable(make_prompt_cache(tiny_gemma3(vocab_size=64)))
    assert not snapshot_cuttable(make_prompt_cache(tiny_mamba(vocab_size=64)))
    converted = KVCache()
    declare_min_reusable_offset(converted, 4)
    assert not snapshot_cuttable([KVCache(), converted])


def test_a_registry_snapshot_cut_to_fewer_tokens_holds_only_those() -> None:
    """CacheRegistry.snapshot(tokens=n) registers the live cache's first n tokens, compact, and
    leaves the live cache whole; n outside (0, offset] is refused."""
    model = tiny_llama(vocab_size=64)
    live = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 21))]), cache=live))
    registry = CacheRegistry()
    reg = registry.snapshot(live, offset=20, tokens=12)
    assert reg.meta.offset == 12
    for cut, whole in zip(registry.get(reg.handle), live, strict=True):
        assert cut.offset == 12
        assert cut.keys.shape[-2] == 12
        assert mx.array_equal(cut.keys, whole.keys[..., :12, :]).item()
        assert whole.offset == 20
    for bad in (0, 21):
        with pytest.raises(ValueError, match="cannot snapshot"):
            registry.snapshot(live, offset=20, tokens=bad)
