"""KV caches: adapters over mlx-lm's cache classes, the engine-owned registry, KV schemes.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from ._adapters import (
    CacheAdapter,
    CacheNotTrimmable,
    UnsupportedCacheKind,
    adapter_for,
    cache_arrays,
    cache_signature,
    caches_min_reusable_offset,
    caches_nbytes,
    caches_offset,
    caches_trimmable,
    clone_caches,
    declare_min_reusable_offset,
    declared_min_reusable_offset,
    trim_caches,
)
from ._kv_scheme import (
    KV_CONFIG_FILE,
    InvalidKvScheme,
    KvGeometry,
    KvScheme,
    KvSchemeKind,
    LayerGeometry,
    LayerQuant,
    check_kv_scheme,
    convert_caches,
    resolve_kv_scheme,
)
from ._registry import (
    CacheOffsetMismatch,
    CacheRegistry,
    RegisteredCache,
    RegistryStats,
    UnknownCacheHandle,
)

__all__ = [
    "KV_CONFIG_FILE",
    "CacheAdapter",
    "CacheNotTrimmable",
    "CacheOffsetMismatch",
    "CacheRegistry",
    "InvalidKvScheme",
    "KvGeometry",
    "KvScheme",
    "KvSchemeKind",
    "LayerGeometry",
    "LayerQuant",
    "RegisteredCache",
    "RegistryStats",
    "UnknownCacheHandle",
    "UnsupportedCacheKind",
    "adapter_for",
    "cache_arrays",
    "cache_signature",
    "caches_min_reusable_offset",
    "caches_nbytes",
    "caches_offset",
    "caches_trimmable",
    "check_kv_scheme",
    "clone_caches",
    "convert_caches",
    "declare_min_reusable_offset",
    "declared_min_reusable_offset",
    "resolve_kv_scheme",
    "trim_caches",
]
