"""The MLX readings behind the memory-pressure guard (every function here runs ON the engine thread).

The decision itself is pure (``actors/gateway/memory_guard.py``); this
module reads what it needs from MLX and the loaded model: the active memory,
the default budget, and the request footprint's model shape (the KV
geometry of one populated prototype cache).
"""

from __future__ import annotations

import functools
from typing import Any

from actors.gateway.memory_guard import Footprint

__all__ = ["active_memory_bytes", "default_budget_bytes", "model_footprint"]


def active_memory_bytes() -> int:
    """MLX's active memory: bytes held by live arrays (engine thread)."""
    import mlx.core as mx

    return int(mx.get_active_memory())


def default_budget_bytes() -> int:
    """The smaller of usable RAM and the device's recommended working set (engine thread, at start).

    Usable RAM: what the system still has available plus what MLX already
    holds (the weights, read before this is called) and keeps in its buffer
    cache. The working set is the device's ``max_recommended_working_set_size``
    where MLX reports one (Metal); the CPU reports none.
    """
    import mlx.core as mx

    from kernels import available_memory_bytes

    usable = available_memory_bytes() + int(mx.get_active_memory()) + int(mx.get_cache_memory())
    info = mx.device_info()
    working = info.get("max_recommended_working_set_size") if isinstance(info, dict) else None
    if isinstance(working, int) and working > 0:
        return min(usable, working)
    return usable


def model_footprint(model: Any, scheme: Any, chunk: int) -> Footprint:
    """The request footprint of ``model`` under KV ``scheme`` with prefill chunks of ``chunk`` tokens.

    Runs one token through a fresh cache to read the KV geometry (engine
    thread; a few milliseconds), then drops it.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kernels import KvGeometry

    args = getattr(model, "args", None)
    if args is None:
        # NOTE: not an mlx-lm model (a wrapper): its shape is unknown, and
        # a probing forward could change what it does next.
        raise ValueError("the model has no ModelArgs; its footprint is unknown")
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    geometry = KvGeometry.from_caches(caches)
    del caches
    kv_scheme = scheme if scheme is not None and getattr(scheme, "quantized", False) else None
    hidden = _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    intermediate = _int(args, "intermediate_size") or 4 * hidden
    dtype_bytes = _compute_dtype_bytes(model)
    return Footprint(
        kv_bytes_at=functools.partial(geometry.bytes_at, scheme=kv_scheme),
        chunk=chunk,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        dtype_bytes=dtype_bytes,
    )


def _int(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return value if isinstance(value, int) and value > 0 else 0


def _compute_dtype_bytes(model: Any) -> int:
    """Bytes per element of the model's first floating-point parameter (its compute dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # NOTE: quantized weights are integers; their scales and the norms keep
    # the compute dtype, so the first float parameter tells it.
    flat: Any = tree_flatten(model.parameters())
    for _, value in flat:
        if mx.issubdtype(value.dtype, mx.floating):
            return int(value.dtype.size)
    return 2
