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
    gb_to_bytes,
)

GIB = 1024**3


def test_default_cap_is_a_clamped_quarter_of_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cap is available/4 within [256 MiB, 8 GiB]; the env var overrides it."""
    monkeypatch.delenv("KVTIER_PROMPT_CACHE_GB", raising=False)
    assert default_prompt_cache_bytes(available=16 * GIB) == 4 * GIB
    assert default_prompt_cache_bytes(available=100 * GIB) == 8 * GIB
    assert default_prompt_cache_bytes(available=GIB // 2) == 256 * 1024**2
    monkeypatch.setenv("KVTIER_PROMPT_CACHE_GB", "0.1")
    assert default_prompt_cache_bytes(available=16 * GIB) == 100_000_000
    monkeypatch.setenv("KVTIER_PROMPT_CACHE_GB", "0")
    assert default_prompt_cache_bytes() == 0
    assert gb_to_bytes(1.5) == 1_500_000_000
    with pytest.raises(ValueError):
        gb_to_bytes(-1)


def test_configure_sets_and_reports_the_cache_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure_mlx_memory sets MLX's cache limit (env default in MiB) and returns the old one."""
    monkeypatch.setenv("KVTIER_MLX_CACHE_LIMIT_MB", "8")
    assert default_mlx_cache_limit_bytes() == 8 * 1024**2
    original = configure_mlx_memory(cache_limit_bytes=12345678)
    try:
        again = configure_mlx_memory()
        assert again.cache_limit_bytes == 12345678
        assert mx.set_cache_limit(8 * 1024**2) == 8 * 1024**2
        kept = configure_mlx_memory(cache_limit_bytes=None)
        assert kept.cache_limit_bytes == 8 * 1024**2
    finally:
        mx.set_cache_limit(original.cache_limit_bytes)


def test_default_cache_limit_is_larger_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the env var the bound is 16 MiB on the CPU and 2 GiB on a GPU; the env var wins on both."""
    monkeypatch.delenv("KVTIER_MLX_CACHE_LIMIT_MB", raising=False)
    assert default_mlx_cache_limit_bytes() == DEFAULT_MLX_CACHE_LIMIT_BYTES == 16 * 1024**2
    assert default_mlx_cache_limit_bytes(gpu=True) == GPU_MLX_CACHE_LIMIT_BYTES == 2 * GIB
    monkeypatch.setenv("KVTIER_MLX_CACHE_LIMIT_MB", "64")
    assert default_mlx_cache_limit_bytes(gpu=True) == 64 * 1024**2
