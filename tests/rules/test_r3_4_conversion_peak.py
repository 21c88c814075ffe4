"""R3-4: KV conversion evaluates one layer at a time, so the plain buffers go before the next.

The older peak test measured ``convert_caches`` alone: without the per-layer
``mx.eval`` the call only builds a lazy graph, allocates nothing, and passed.
Here the peak covers the conversion AND the evaluation the next forward
would force (every converted array evaluated): with the per-layer eval the
growth stays near one layer's output; without it every layer's quantized
output is allocated while every plain buffer is still referenced by the
graph (mutation: delete ``mx.eval`` in ``kernels.cache._kv_scheme.convert_caches``).
"""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from kernels import KvScheme, LayerQuant, cache_arrays, caches_nbytes, convert_caches
from tests.tiny_models import tiny_llama

KV8 = KvScheme(kind="affine-uniform", uniform=LayerQuant(bits=8, group_size=32))
LAYERS = 8


def _prefill(model: Any, n: int) -> list[Any]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[i % 90 + 1 for i in range(n)]]), cache=cache), *cache_arrays(cache))
    return cache


def test_conversion_peak_including_evaluation_stays_near_one_layer() -> None:
    """Converting 8 layers and evaluating the result grows peak memory by at most ~3 layers'
    quantized output (all at once would be ~8 plus the transients)."""
    model = tiny_llama(head_dim=32, layers=LAYERS)
    cache = _prefill(model, 1024)
    probe = cache[0].to_quantized(group_size=32, bits=8)
    mx.eval(*probe.keys, *probe.values)
    one_layer_q = caches_nbytes([probe])
    del probe
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    assert convert_caches(cache, KV8) == LAYERS
    mx.eval(*cache_arrays(cache))
    peak_growth = mx.get_peak_memory() - before
    assert all(type(c) is QuantizedKVCache for c in cache)
    assert peak_growth <= 3 * one_layer_q, (peak_growth, one_layer_q)
