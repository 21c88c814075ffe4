"""KV schemes: which bytes a token costs and which cache class holds them.

A :class:`KvScheme` is resolved once at server start from ``--kv-quant``
(``off | 4 | 8 | config``) by :func:`resolve_kv_scheme` and is immutable:

- ``bf16``: the model's own dtype, plain ``KVCache``/``RotatingKVCache``.
- ``affine-uniform``: every full-attention layer becomes a
  ``QuantizedKVCache(bits, group_size)`` after the first prefill.
- ``affine-config``: per-layer bits/group from the model directory's
  ``kv_config.json`` (format below); a layer mapped to ``null`` stays plain.

Conversion (:func:`convert_caches`) mirrors mlx-lm's ``maybe_quantize_kv_cache``
(bit-exact with ``mlx_lm.generate(kv_bits=...)``) but evaluates layer by layer
so each layer's plain source is freed before the next converts. Rotating
(sliding-window) layers stay plain: mlx-lm 0.32 has no quantized ring.

``kv_config.json``::

    {"default": {"bits": 8, "group_size": 64},      # or null: plain
     "layers": {"0": {"bits": 4, "group_size": 64}, "5": null}}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ._adapters import (
    UnsupportedCacheKind,
    adapter_for,
    declare_min_reusable_offset,
    declared_min_reusable_offset,
)
from ._contiguous_attention import install_contiguous_quantized_attention

__all__ = [
    "KV_CONFIG_FILE",
    "InvalidKvScheme",
    "KvGeometry",
    "KvScheme",
    "KvSchemeKind",
    "LayerGeometry",
    "LayerQuant",
    "check_kv_scheme",
    "convert_caches",
    "resolve_kv_scheme",
]

_log = logging.getLogger(__name__)

KV_CONFIG_FILE = "kv_config.json"
KvSchemeKind = Literal["bf16", "affine-uniform", "affine-config"]
_BITS = frozenset({2, 3, 4, 5, 6, 8})
_GROUPS = frozenset({32, 64, 128})


class InvalidKvScheme(ValueError):
    """A ``--kv-quant`` value or ``kv_config.json`` that does not describe a usable scheme."""


@dataclass(frozen=True)
class LayerQuant:
    """Affine quantization of one layer's K and V: ``bits`` per element, groups along head_dim."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in _BITS:
            raise InvalidKvScheme(f"unsupported KV bits {self.bits} (one of {sorted(_BITS)})")
        if self.group_size not in _GROUPS:
            raise InvalidKvScheme(
                f"unsupported KV group size {self.group_size} (one of {sorted(_GROUPS)})"
            )

    def bytes_per_element(self, scale_bytes: int) -> float:
        """Packed bits plus one scale and one bias (``scale_bytes`` each) per group."""
        return self.bits / 8 + 2 * scale_bytes / self.group_size


@dataclass(frozen=True)
class KvScheme:
    """The immutable KV scheme of a server (see the module docstring)."""

    kind: KvSchemeKind = "bf16"
    uniform: LayerQuant | None = None
    default: LayerQuant | None = None
    layers: tuple[tuple[int, LayerQuant | None], ...] = ()
    start: int = 0
    """Convert a layer only once it holds at least ``start`` tokens (0 for servers)."""

    def layer_quant(self, index: int) -> LayerQuant | None:
        """The quantization of layer ``index`` (``None``: keep it plain)."""
        if self.kind == "affine-uniform":
            return self.uniform
        if self.kind == "affine-config":
            for i, q in self.layers:
                if i == index:
                    return q
            return self.default
        return None

    @property
    def quantized(self) -> bool:
        """Whether any layer converts."""
        return self.kind != "bf16"

    @property
    def cache_key(self) -> str:
        """Compatibility key folded into the cold tier's fingerprint.

        ``bf16`` | ``kv<bits>`` (``kv<bits>g<group>`` off the default group) |
        ``config-<digest of the per-layer map>``.
        """
        if self.kind == "bf16":
            return "bf16"
        if self.kind == "affine-uniform":
            assert self.uniform is not None
            q = self.uniform
            return f"kv{q.bits}" if q.group_size == 64 else f"kv{q.bits}g{q.group_size}"
        canon = json.dumps(
            {
                "default": _q_json(self.default),
                "layers": [[i, _q_json(q)] for i, q in sorted(self.layers, key=lambda t: t[0])],
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return "config-" + hashlib.sha256(canon.encode()).hexdigest()[:12]


def _q_json(q: LayerQuant | None) -> dict[str, int] | None:
    return None if q is None else {"bits": q.bits, "group_size": q.group_size}


def _parse_quant(raw: object, where: str) -> LayerQuant | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("bits"), int):
        raise InvalidKvScheme(f"{where}: expected null or {{'bits': int, 'group_size': int}}")
    group = raw.get("group_size", 64)
    if not isinstance(group, int):
        raise InvalidKvScheme(f"{where}: group_size must be an integer")
    return LayerQuant(bits=raw["bits"], group_size=group)


def _load_config(path: Path) -> KvScheme:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidKvScheme(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidKvScheme(f"{path}: expected a JSON object")
    default = _parse_quant(data.get("default"), f"{path}: default")
    raw_layers = data.get("layers", {})
    if not isinstance(raw_layers, dict):
        raise InvalidKvScheme(f"{path}: 'layers' must map layer index -> quantization")
    layers: list[tuple[int, LayerQuant | None]] = []
    for key, value in raw_layers.items():
        try:
            index = int(key)
        except ValueError as exc:
            raise InvalidKvScheme(f"{path}: layer key {key!r} is not an integer") from exc
        layers.append((index, _parse_quant(value, f"{path}: layer {key}")))
    return KvScheme(kind="affine-config", default=default, layers=tuple(sorted(layers)))


def resolve_kv_scheme(
    flag: str | int | None,
    model_dir: str | Path | None = None,
    *,
    group_size: int = 64,
    missing_config: Literal["error", "bf16"] = "error",
) -> KvScheme:
    """The scheme for ``--kv-quant`` ``off | 4 | 8 | config`` (``None`` = off).

    ``config`` reads ``<model_dir>/kv_config.json``; when it is absent the
    result is :class:`InvalidKvScheme` or bf16 per ``missing_config``.
    """
    value = "off" if flag is None else str(flag).strip().lower()
    if value in {"off", "bf16", "none", "0"}:
        return KvScheme()
    if value == "config":
        path = Path(model_dir) / KV_CONFIG_FILE if model_dir is not None else None
        if path is None or not path.is_file():
            if missing_config == "bf16":
                return KvScheme()
            raise InvalidKvScheme(f"--kv-quant config needs {KV_CONFIG_FILE} in the model directory")
        scheme = _load_config(path)
        if scheme.quantized:
            install_contiguous_quantized_attention()
        return scheme
    try:
        bits = int(value)
    except ValueError as exc:
        raise InvalidKvScheme(f"--kv-quant must be off, 4, 8 or config, not {flag!r}") from exc
    if bits not in {4, 8}:
        raise InvalidKvScheme(f"--kv-quant must be off, 4, 8 or config, not {flag!r}")
    install_contiguous_quantized_attention()
    return KvScheme(kind="affine-uniform", uniform=LayerQuant(bits=bits, group_size=group_size))


_warned_rotating = False


def convert_caches(caches: MutableSequence[Any], scheme: KvScheme) -> int:
    """Convert populated plain layers of ``caches`` in place per ``scheme``; returns how many.

    Engine thread only. Called by the generation after its first prefill (and
    harmlessly after every later step): empty layers (``offset < scheme.start``
    or no tokens yet), already-quantized layers, rotating rings and recurrent
    state (and ``CacheList`` groups) are left as they are; an unknown class
    raises :class:`UnsupportedCacheKind`. Each converted layer is evaluated before the
    next one converts so its plain buffers are released first.

    A converted layer keeps the minimum reusable offset its plain form
    declared. A delayed conversion (``scheme.start > 0``) is an irreversible
    transition: a prefix shorter than the offset at conversion would have
    stayed plain in a fresh run, so the layer declares that offset as its
    minimum (the prompt cache then never trims it below).
    """
    global _warned_rotating
    if not scheme.quantized:
        return 0
    install_contiguous_quantized_attention()
    converted = 0
    for index in range(len(caches)):
        q = scheme.layer_quant(index)
        if q is None:
            continue
        cache = caches[index]
        kind = type(cache)
        if kind is KVCache:
            if cache.keys is None or cache.offset == 0 or cache.offset < scheme.start:
                continue
            quant = cache.to_quantized(group_size=q.group_size, bits=q.bits)
            # NOTE: to_quantized builds a fresh object: carry the declared bound over.
            floor = declared_min_reusable_offset(cache)
            if scheme.start > 0:
                floor = max(floor, int(cache.offset))
            declare_min_reusable_offset(quant, floor)
            caches[index] = quant
            del cache
            mx.eval(*quant.keys, *quant.values)
            converted += 1
        elif kind is RotatingKVCache:
            if not _warned_rotating:
                _warned_rotating = True
                _log.warning("KV scheme: sliding-window (rotating) layers stay unquantized")
        elif kind in (QuantizedKVCache, ArraysCache, CacheList):
            # NOTE: CacheList has no to_quantized in mlx-lm either (its
            # maybe_quantize_kv_cache leaves it), so it stays as it is.
            continue
        else:
            raise UnsupportedCacheKind(cache)
    return converted


_KNOWN_KINDS = (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, CacheList)


def check_kv_scheme(model: Any, scheme: KvScheme) -> None:
    """Refuse (:class:`InvalidKvScheme`) a quantizing ``scheme`` this model's cache cannot take.

    Engine thread only (it runs one token through ``model``). Checked per
    layer the scheme converts: the cache class must be one kvtier knows, and
    a plain ``KVCache``'s key and value head dimensions must divide into the
    layer's group size. A trial conversion of the one-token cache then
    catches anything else ``mx.quantize`` would refuse. NOTE: without this
    check the server starts and every request fails in its first prefill.
    """
    if not scheme.quantized:
        return
    caches = make_prompt_cache(model)
    for index, cache in enumerate(caches):
        if scheme.layer_quant(index) is not None and type(cache) not in _KNOWN_KINDS:
            cls = type(cache)
            raise InvalidKvScheme(
                f"--kv-quant {scheme.cache_key}: layer {index} uses the cache class "
                f"{cls.__module__}.{cls.__qualname__}, which kvtier cannot convert; "
                "serve this model with --kv-quant off"
            )
    mx.eval(model(mx.array([[0]]), cache=caches))
    for index, cache in enumerate(caches):
        q = scheme.layer_quant(index)
        if q is None or type(cache) is not KVCache:
            continue
        keys, values = cache.keys, cache.values
        if keys is None or values is None:
            continue
        dims = {"key": int(keys.shape[-1]), "value": int(values.shape[-1])}
        for name, dim in dims.items():
            if dim % q.group_size != 0:
                raise InvalidKvScheme(
                    f"--kv-quant {scheme.cache_key}: layer {index}'s {name} head dimension "
                    f"({dim}) is not divisible by the group size {q.group_size}; "
                    "choose a group size that divides it, or --kv-quant off"
                )
    try:
        convert_caches(caches, dataclasses.replace(scheme, start=0))
    except (ValueError, TypeError, RuntimeError) as exc:
        # NOTE: whatever mx.quantize refuses becomes one clear startup error.
        raise InvalidKvScheme(
            f"--kv-quant {scheme.cache_key}: this model's KV cache cannot be converted ({exc})"
        ) from exc


# --- byte accounting per layer kind -------------------------------------------


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's growth: ``full`` attention, ``sliding`` (capped at ``window``) or ``recurrent``.

    ``elements_per_token`` counts K plus V elements per token per row;
    ``state_bytes`` is the fixed size of recurrent state.
    """

    kind: Literal["full", "sliding", "recurrent"]
    elements_per_token: int = 0
    dtype_bytes: int = 2
    window: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class KvGeometry:
    """Per-layer geometry of a model's cache, for byte budgets in pure Python."""

    layers: tuple[LayerGeometry, ...]

    @classmethod
    def from_caches(cls, caches: Sequence[Any]) -> KvGeometry:
        """Read the geometry off a populated, unquantized prototype cache list (engine thread)."""
        out: list[LayerGeometry] = []
        for c in caches:
            kind = type(c)
            if kind in (KVCache, RotatingKVCache):
                if c.keys is None:
                    raise ValueError("geometry needs a populated prototype cache")
                elements = c.keys.shape[1] * c.keys.shape[3] + c.values.shape[1] * c.values.shape[3]
                if kind is KVCache:
                    out.append(LayerGeometry("full", elements, c.keys.dtype.size))
                else:
                    out.append(LayerGeometry("sliding", elements, c.keys.dtype.size, c.max_size))
            elif kind is ArraysCache:
                out.append(
                    LayerGeometry("recurrent", state_bytes=adapter_for(c).nbytes(c))
                )
            else:
                raise UnsupportedCacheKind(c)
        return cls(tuple(out))

    def bytes_at(self, tokens: int, scheme: KvScheme | None = None, *, rows: int = 1) -> int:
        """Logical bytes the cache holds after ``tokens`` tokens under ``scheme``.

        Full attention grows with every token; sliding layers stop at their
        window; recurrent state is constant. Quantized layers cost
        ``bits/8 + 2*scale_bytes/group`` per element (scales in the model dtype).
        """
        total = 0.0
        for index, layer in enumerate(self.layers):
            if layer.kind == "recurrent":
                total += layer.state_bytes * rows
                continue
            held = tokens if layer.kind == "full" else min(tokens, layer.window)
            q = scheme.layer_quant(index) if scheme is not None else None
            if layer.kind == "sliding":
                q = None  # NOTE: rings stay plain (see convert_caches).
            per_element = layer.dtype_bytes if q is None else q.bytes_per_element(layer.dtype_bytes)
            total += held * layer.elements_per_token * per_element * rows
        return math.ceil(total)
