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
    convert_caches,
    resolve_kv_scheme,
)
from ._registry import (
    CacheRegistry,
    RegisteredCache,
    RegistryStats,
    UnknownCacheHandle,
)

__all__ = [
    "KV_CONFIG_FILE",
    "CacheAdapter",
    "CacheNotTrimmable",
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
    "clone_caches",
    "convert_caches",
    "resolve_kv_scheme",
    "trim_caches",
]
