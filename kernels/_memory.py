"""MLX memory limits and the default prompt-cache byte cap.

The prompt cache's cap counts what its entries retain; MLX's own buffer cache
(freed buffers kept for reuse) is bounded separately here, so a long workload
stays within model + cap + MLX cache limit + working set.

NOTE: no environment variable is read here: ``KVTIER_PROMPT_CACHE_GB`` and
``KVTIER_MLX_CACHE_LIMIT_MB`` are ``EngineConfig`` settings
(``actors/engine/config.py``), which also owns the GB (GiB) conversion; these
functions give the defaults used when the setting is unset.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

__all__ = [
    "DEFAULT_MLX_CACHE_LIMIT_BYTES",
    "GPU_MLX_CACHE_LIMIT_BYTES",
    "MAX_DEFAULT_PROMPT_CACHE_BYTES",
    "MemorySettings",
    "available_memory_bytes",
    "configure_mlx_memory",
    "default_mlx_cache_limit_bytes",
    "default_prompt_cache_bytes",
    "device_memory_bytes",
    "device_used_bytes",
    "on_cuda",
    "prompt_cache_room_bytes",
    "weights_bytes",
]

GIB = 1024**3
MAX_DEFAULT_PROMPT_CACHE_BYTES = 8 * GIB
"""The default cap never exceeds 8 GiB (the reference design's default)."""
_MIN_DEFAULT_PROMPT_CACHE_BYTES = 256 * 1024**2
DEFAULT_MLX_CACHE_LIMIT_BYTES = 16 * 1024**2
"""MLX buffer-cache bound: enough to recycle per-step decode buffers, small
against the prompt cache's cap (freed KV buffers go back to the OS).
Measured: 64 MiB let peak RSS grow 1.29 x a 0.1 GB cap over 40 requests,
16 MiB 1.03 x (docs/benchmarks/prompt_cache.md)."""


@dataclass(frozen=True)
class MemorySettings:
    """The MLX limits in force before :func:`configure_mlx_memory` changed them."""

    cache_limit_bytes: int
    memory_limit_bytes: int


def available_memory_bytes() -> int:
    """Memory available to new allocations (Linux ``MemAvailable``; else physical size)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 8 * GIB


def default_prompt_cache_bytes(available: int | None = None) -> int:
    """The default RAM-tier cap: a quarter of available memory, in [256 MiB, 8 GiB].

    Used when ``EngineConfig.prompt_cache_bytes`` is unset.
    """
    avail = available_memory_bytes() if available is None else available
    return max(_MIN_DEFAULT_PROMPT_CACHE_BYTES, min(MAX_DEFAULT_PROMPT_CACHE_BYTES, avail // 4))


GPU_MLX_CACHE_LIMIT_BYTES = 2 * GIB
"""MLX buffer-cache bound on a GPU (CUDA or Metal). Each decode step there
allocates and frees buffers at a rate the CPU bound cannot recycle: on an
H200 a 16 MiB bound cost the stock ``mlx_lm.stream_generate`` loop up to a
quarter of its decode rate at 1B, while 2 GiB matched MLX's own default
(docs/benchmarks/gpu.md). It is part of the stated memory margin. Under
CUDA it is the floor: the bound grows with the model
(:func:`default_mlx_cache_limit_bytes`)."""


def default_mlx_cache_limit_bytes(
    *, gpu: bool = False, cuda: bool = False, weights_bytes: int = 0, device_bytes: int = 0
) -> int:
    """The default bound (used when ``EngineConfig.mlx_cache_limit_bytes`` is unset).

    CPU: 16 MiB. Metal: 2 GiB. CUDA: the model's weight bytes rounded up to
    a GiB, at least 2 GiB, at most half of ``device_bytes`` (when known).
    NOTE: measured on an H200 (8B shape, bf16, 13.8 GiB of weights; 530-token
    prompt, 32 new tokens, 3 interleaved rounds per bound, docs/benchmarks/gpu.md):
    the in-process Engine decoded 136 / 147 / 177 / 179 tok/s under a 2 / 8
    / 16 / 128 GiB bound (``stream_generate`` 135 / 143 / 201 / 204), its
    time to first token 40 ms at 2 GiB against 35 ms at 16 GiB: the step
    lies between the bound below and the bound above the weights' size; the
    1B shape (2.0 GiB of weights) already matched MLX's default at 2 GiB.
    """
    if cuda:
        limit = max(GPU_MLX_CACHE_LIMIT_BYTES, -(-weights_bytes // GIB) * GIB)
        if device_bytes > 0:
            limit = max(GPU_MLX_CACHE_LIMIT_BYTES, min(limit, device_bytes // 2))
        return limit
    return GPU_MLX_CACHE_LIMIT_BYTES if gpu else DEFAULT_MLX_CACHE_LIMIT_BYTES


def weights_bytes(model: object) -> int:
    """Bytes of every parameter of ``model`` (engine thread; metadata only, nothing evaluated)."""
    from mlx.utils import tree_flatten

    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return 0
    flat: Any = tree_flatten(parameters())
    return sum(int(a.nbytes) for _, a in flat)


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here (a CUDA build with the GPU as its default device)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available()) and mx.default_device().type == mx.DeviceType.gpu


def _device_bytes() -> int:
    """The device's total memory as MLX reports it (0: not reported).

    NOTE: MLX's CUDA backend names it ``total_memory`` (beside a fresh
    ``free_memory``) where Metal says ``memory_size``; either is taken.
    """
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return 0
    for key in ("total_memory", "memory_size"):
        size = info.get(key)
        if isinstance(size, int | float) and size > 0:
            return int(size)
    return 0


def device_memory_bytes() -> int:
    """The memory of the device MLX computes on, where that is not the host's (engine thread).

    CUDA: the GPU's total memory (0 if MLX does not report it). CPU and
    Metal: 0 (their arrays live in the host's memory, which
    :func:`available_memory_bytes` reads).
    """
    return _device_bytes() if on_cuda() else 0


def device_used_bytes() -> int | None:
    """The device memory in use by every process on it, where that is not the host's (engine thread).

    CUDA: the GPU's total less its free memory (``cudaMemGetInfo`` through
    ``mx.device_info()``, read afresh on every call): MLX's arrays and
    buffer cache, this process's CUDA context and libraries' workspaces, and
    whatever other processes hold on the same card. ``None`` on the CPU and
    Metal, and where MLX reports no free figure.
    NOTE: MLX's own counters see only this process's buffers; a second
    process on the card (a benchmark's in-process engine beside a server)
    made a batch step fail ``cudaMallocAsync ... out of memory`` while the
    guard read plenty of room (docs/operations.md, "Memory-pressure guard").
    """
    if not on_cuda():
        return None
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return None
    total, free = info.get("total_memory"), info.get("free_memory")
    if not isinstance(total, int | float) or not isinstance(free, int | float) or total <= 0:
        return None
    return max(0, int(total) - int(free))


def prompt_cache_room_bytes() -> int:
    """The memory the RAM tier's default cap is a quarter of (engine thread, after the model loaded).

    The host's available memory; under CUDA, where the tier's entries live
    in device memory, at most the device memory MLX has not taken (weights,
    buffer cache): a quarter of the host's 125 GiB on an H200 (141 GiB of
    device memory, 15 GiB of weights) is the same cap, but a 24 GiB card
    holding 14 GiB of weights has 10 GiB left, not the host's quarter.
    """
    room = available_memory_bytes()
    device = device_memory_bytes()
    if device > 0:
        taken = int(mx.get_active_memory()) + int(mx.get_cache_memory())
        room = min(room, max(0, device - taken))
    return room


def configure_mlx_memory(
    *,
    cache_limit_bytes: int | Literal["default"] | None = "default",
    memory_limit_bytes: int | None = None,
    weights_bytes: int = 0,
) -> MemorySettings:
    """Bound MLX's buffer cache (and optionally its memory limit); returns the previous values.

    Call once on the engine thread at start. ``"default"`` takes
    :func:`default_mlx_cache_limit_bytes` (``weights_bytes``: the loaded
    model's parameter bytes, which size the CUDA bound); ``None`` leaves a
    limit as it is.
    """
    if cache_limit_bytes == "default":
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        cuda = on_cuda()
        cache_limit_bytes = default_mlx_cache_limit_bytes(
            gpu=on_gpu, cuda=cuda, weights_bytes=weights_bytes,
            device_bytes=_device_bytes() if cuda else 0,
        )
    previous_cache = int(mx.set_cache_limit(cache_limit_bytes)) if cache_limit_bytes is not None else -1
    if memory_limit_bytes is not None:
        previous_memory = int(mx.set_memory_limit(memory_limit_bytes))
    else:
        previous_memory = int(mx.get_memory_limit())
    if previous_cache < 0:
        # NOTE: set_cache_limit returns the old value; read it back without changing it.
        previous_cache = int(mx.set_cache_limit(0))
        mx.set_cache_limit(previous_cache)
    return MemorySettings(cache_limit_bytes=previous_cache, memory_limit_bytes=previous_memory)


def release_mlx_memory() -> None:
    """Collect dropped arrays, wait for queued work, empty MLX's buffer cache.

    Call on the engine thread after dropping references to arrays, so they
    are freed there and nothing is left in flight when the thread ends.
    """
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
