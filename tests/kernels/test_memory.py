"""MLX memory limits and the default prompt-cache cap (kernels._memory)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels import (
    DEFAULT_MLX_CACHE_LIMIT_BYTES,
    GPU_MLX_CACHE_LIMIT_BYTES,
    configure_mlx_memory,
    default_mlx_cache_limit_bytes,
    default_prompt_cache_bytes,
    weights_bytes,
)

GIB = 1024**3


def test_default_cap_is_a_clamped_quarter_of_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cap is available/4 within [256 MiB, 8 GiB], whatever KVTIER_PROMPT_CACHE_GB says."""
    monkeypatch.setenv("KVTIER_PROMPT_CACHE_GB", "0")  # NOTE: an EngineConfig setting, not read here
    assert default_prompt_cache_bytes(available=16 * GIB) == 4 * GIB
    assert default_prompt_cache_bytes(available=100 * GIB) == 8 * GIB
    assert default_prompt_cache_bytes(available=GIB // 2) == 256 * 1024**2


def test_configure_sets_and_reports_the_cache_limit() -> None:
    """configure_mlx_memory sets MLX's cache limit (the device default by default) and returns the old one."""
    original = configure_mlx_memory(cache_limit_bytes=12345678)
    try:
        again = configure_mlx_memory()
        assert again.cache_limit_bytes == 12345678
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        assert mx.set_cache_limit(8 * 1024**2) == default_mlx_cache_limit_bytes(gpu=on_gpu)
        kept = configure_mlx_memory(cache_limit_bytes=None)
        assert kept.cache_limit_bytes == 8 * 1024**2
    finally:
        mx.set_cache_limit(original.cache_limit_bytes)


def test_default_cache_limit_is_larger_on_a_gpu() -> None:
    """The default bound is 16 MiB on the CPU and 2 GiB on a GPU (KVTIER_MLX_CACHE_LIMIT_MB is EngineConfig's)."""
    assert default_mlx_cache_limit_bytes() == DEFAULT_MLX_CACHE_LIMIT_BYTES == 16 * 1024**2
    assert default_mlx_cache_limit_bytes(gpu=True) == GPU_MLX_CACHE_LIMIT_BYTES == 2 * GIB


def test_cuda_default_grows_with_the_weights_within_half_the_device() -> None:
    """Under CUDA the default bound is the weights' bytes rounded up to a GiB, 2 GiB at least, half the device at most."""
    # NOTE: the H200 measurement behind it: an 8B shape's 13.8 GiB of weights
    # decoded ~30 % faster under a 16 GiB bound than under 2 or 8 GiB.
    weights_8b = int(13.8 * GIB)
    assert default_mlx_cache_limit_bytes(gpu=True, cuda=True, weights_bytes=weights_8b) == 14 * GIB
    assert default_mlx_cache_limit_bytes(gpu=True, cuda=True, weights_bytes=GIB // 2) == 2 * GIB
    assert default_mlx_cache_limit_bytes(
        gpu=True, cuda=True, weights_bytes=weights_8b, device_bytes=16 * GIB
    ) == 8 * GIB
    assert default_mlx_cache_limit_bytes(
        gpu=True, cuda=True, weights_bytes=weights_8b, device_bytes=2 * GIB
    ) == 2 * GIB
    # NOTE: Metal keeps the fixed 2 GiB (no measurement says otherwise there).
    assert default_mlx_cache_limit_bytes(gpu=True, weights_bytes=weights_8b) == 2 * GIB


def test_weights_bytes_counts_every_parameter() -> None:
    """weights_bytes sums the bytes of a module's parameters, nested ones included."""

    class _Model:
        """A module's parameters() shape: nested dicts and lists of arrays."""

        def parameters(self) -> dict[str, object]:
            return {"layers": [{"weight": mx.zeros((16, 8)), "bias": mx.zeros((16,))},
                               {"weight": mx.zeros((4, 16), dtype=mx.bfloat16)}]}

    assert weights_bytes(_Model()) == (16 * 8 + 16) * 4 + 4 * 16 * 2
    assert weights_bytes(object()) == 0


def _cuda(monkeypatch: pytest.MonkeyPatch, info: dict[str, object], *, taken: int) -> None:
    """Make kernels._memory see a CUDA device reporting ``info``, with ``taken`` bytes in MLX's hands."""
    from kernels import _memory

    monkeypatch.setattr(_memory, "on_cuda", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: info)
    monkeypatch.setattr(mx, "get_active_memory", lambda: taken)
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 0)
    monkeypatch.setattr(_memory, "available_memory_bytes", lambda: 60 * GIB)


@pytest.mark.parametrize("key", ["total_memory", "memory_size"])
def test_under_cuda_the_tier_cap_is_a_quarter_of_the_device_memory_left(
    monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    """A 24 GiB card with 14 GiB taken leaves 10 GiB: the default cap is 2.5 GiB, not a quarter of
    the host's 60 GiB (clamped to 8); MLX's CUDA key (total_memory) and Metal's both read."""
    from kernels import device_memory_bytes, prompt_cache_room_bytes

    _cuda(monkeypatch, {key: 24 * GIB}, taken=14 * GIB)
    assert device_memory_bytes() == 24 * GIB
    assert prompt_cache_room_bytes() == 10 * GIB
    assert default_prompt_cache_bytes(prompt_cache_room_bytes()) == 10 * GIB // 4


def test_a_device_larger_than_the_host_leaves_the_host_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200-like device (141 GiB, 15 taken) beside 60 GiB of host memory: the host's figure
    stands; a device that reports no size changes nothing."""
    from kernels import prompt_cache_room_bytes

    _cuda(monkeypatch, {"total_memory": 141 * GIB}, taken=15 * GIB)
    assert prompt_cache_room_bytes() == 60 * GIB
    _cuda(monkeypatch, {"device_name": "x"}, taken=15 * GIB)
    assert prompt_cache_room_bytes() == 60 * GIB


def test_off_cuda_the_device_is_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (and Metal) no separate device memory is reported: the room is the host's."""
    from kernels import _memory, device_memory_bytes, prompt_cache_room_bytes

    monkeypatch.setattr(_memory, "on_cuda", lambda: False)
    monkeypatch.setattr(_memory, "available_memory_bytes", lambda: 7 * GIB)
    assert device_memory_bytes() == 0
    assert prompt_cache_room_bytes() == 7 * GIB


def test_under_cuda_the_device_in_use_is_total_less_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80 GiB card with 18 GiB free reads 62 GiB in use, whoever holds it; a device that
    reports no free figure reads ``None``, and off CUDA nothing is read."""
    from kernels import _memory, device_used_bytes

    _cuda(monkeypatch, {"total_memory": 80 * GIB, "free_memory": 18 * GIB}, taken=20 * GIB)
    assert device_used_bytes() == 62 * GIB
    _cuda(monkeypatch, {"total_memory": 80 * GIB}, taken=20 * GIB)
    assert device_used_bytes() is None
    monkeypatch.setattr(_memory, "on_cuda", lambda: False)
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 80 * GIB, "free_memory": 0})
    assert device_used_bytes() is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cudaMallocAsync(&data, size, stream) failed: out of memory", True),
        ("[malloc] Unable to allocate 17179869184 bytes.", True),
        (("[METAL] Command buffer execution failed: Insufficient Memory "
          "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"), True),
        ("forward exploded", False),
        ("[matmul] Last dimension of first input with shape (1,4) must match", False),
    ],
)
def test_the_out_of_memory_texts_of_mlxs_backends_are_told_apart(text: str, expected: bool) -> None:
    """CUDA's, the allocator's and Metal's allocation failures are out of memory; a shape error is not."""
    from kernels import device_out_of_memory

    assert device_out_of_memory(RuntimeError(text)) is expected
    assert device_out_of_memory(MemoryError()) is True
    assert device_out_of_memory(ValueError("out of memory")) is False
