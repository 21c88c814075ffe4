"""The batch lane's one-token forward as an ``mx.compile``d step: a graph replayed, not built, each token.

A decode step of the batch lane calls the model on one token per row. In
Python that builds the step's graph anew every token: ~2-3.5 ms for a
30-32 layer model on this box's CPU at any batch size
(``tools/bench/compiled_decode.py``), host time that a GPU's step waits
for when its weights' read is shorter (a lone 8B row on CUDA is
host-bound). :class:`CompiledDecode` traces the forward once per batch
size and buffer length and replays it.

The traced step is a pure function of its inputs: the tokens, the write
position as a scalar array, each layer's left padding, offsets and key and value
buffers ``(B, H, S, D)`` (mlx-lm's ``BatchKVCache`` layout); it returns the
logits, each layer's new offsets and the buffers with the token's keys and
values written at the position (``mx.slice_update``). Attention reads all
``S`` positions under a mask that hides each row's left padding and what is
not written yet, the mask ``BatchKVCache.make_mask`` gives over the first
``position + 1``; RoPE takes each row's offset as an array. Afterwards the
layers' caches hold the outputs exactly as their own ``update_and_fetch``
would have left them (``_idx`` one further, ``offset`` + 1). The old buffers'
last references are dropped before the step runs, so MLX writes the token
into them in place (a sole owner's buffer is donated), as the cache's own
slice assignment does.

It applies where every layer is a ``BatchKVCache`` whose buffer holds
arrays with room for the token and every layer is at the same position;
anything else (a buffer about to grow, quantized or rotating layers,
a prefill) runs the model as it is. A model whose forward reads anything
but these inputs and its weights cannot be traced this way: the model
types in :data:`COMPILED_MODEL_TYPES` were checked: ``llama``, ``qwen2`` and
``qwen3`` by tiny models whose tokens and caches equal the built step's
(``tests/kernels/test_compiled_decode.py``); ``mistral`` is mlx-lm's
``llama`` module under another name.

Traces are kept per (batch size, buffer length, dtype); more than
:data:`MAX_TRACES` of them drop all and start again (a long-lived server
meets many buffer lengths). ``KVTIER_COMPILED_DECODE`` switches it (default
off: in process on an H100 it took a token from 12.1 / 16.6 / 16.9 ms to
10.1 / 12.8 / 19.4 at 1 / 8 / 32 rows, and served on the CPU it gained
nothing; docs/benchmarks.md, 2026-12-07 23:41). Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from kernels._env import env_switch

__all__ = [
    "COMPILED_DECODE_ENV",
    "COMPILED_MODEL_TYPES",
    "MAX_TRACES",
    "CompiledDecode",
    "compiled_decode_enabled",
    "compiled_decode_of",
    "install_compiled_decode",
    "remove_compiled_decode",
]

COMPILED_DECODE_ENV = "KVTIER_COMPILED_DECODE"
"""Switch (default off): the batch lane's one-token forward compiled."""

COMPILED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""Model types whose forward reads only its inputs, its weights and the cache interface used here."""

MAX_TRACES = 64
"""Distinct input shapes kept traced before every trace is dropped."""


def compiled_decode_enabled() -> bool:
    """``KVTIER_COMPILED_DECODE`` (default off)."""
    return env_switch(COMPILED_DECODE_ENV, default=False)


class _Slot:
    """One layer's cache inside the trace: functional buffers written at an array position."""

    __slots__ = ("idx", "keys", "left", "offset", "values")

    def __init__(self, keys: mx.array, values: mx.array, idx: mx.array, left: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.idx, self.left = keys, values, idx, left
        # NOTE: BatchKVCache.offset as the layer holds it (RoPE's per-row positions).
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.idx.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, **_: Any) -> mx.array:
        """Each row sees its keys from its left padding to the position written now (``n`` is 1)."""
        cols = mx.arange(self.keys.shape[2])[None]
        seen = (cols >= self.left[:, None]) & (cols <= self.idx)
        return seen[:, None, None, :]


class CompiledDecode:
    """A model's one-token batch forward, compiled; :meth:`forward` runs it over ``BatchKVCache`` layers."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._shapes: set[tuple[int, int, Any]] = set()
        self._fn = self._compile()
        self.traces = 0
        """Shapes traced so far (a retrace after :data:`MAX_TRACES` counts again)."""

    def _compile(self) -> Any:
        model = self._model

        def step(tokens: mx.array, idx: mx.array, *rest: mx.array) -> tuple[mx.array, ...]:
            n = len(rest) // 4
            slots = [_Slot(rest[2 * n + 2 * i], rest[2 * n + 2 * i + 1], idx, rest[i], rest[n + i])
                     for i in range(n)]
            logits = model(tokens, cache=slots)
            return (logits, *[s.offset + 1 for s in slots], *[a for s in slots for a in (s.keys, s.values)])

        return mx.compile(step)

    @staticmethod
    def applies(tokens: mx.array, caches: list[Any]) -> bool:
        """Whether :meth:`forward` takes this call: one token per row over plain batch caches with room for it."""
        if tokens.ndim != 2 or tokens.shape[1] != 1 or not caches:
            return False
        idx = getattr(caches[0], "_idx", None)
        for c in caches:
            if type(c) is not BatchKVCache:
                return False
            keys: mx.array | None = getattr(c, "keys", None)
            if keys is None or c._idx != idx or c._idx >= keys.shape[2] or keys.shape[0] != tokens.shape[0]:
                return False
        return True

    def forward(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        """The model's logits for ``tokens`` (``(B, 1)``), the caches advanced as their own update would.

        The caller checked :meth:`applies`.
        """
        first = caches[0]
        shape = (int(first.keys.shape[0]), int(first.keys.shape[2]), first.keys.dtype)
        if shape not in self._shapes:
            if len(self._shapes) >= MAX_TRACES:
                # NOTE: a new compiled function: MLX drops the old one's traces with it.
                self._shapes.clear()
                self._fn = self._compile()
            self._shapes.add(shape)
            self.traces += 1
        args: list[mx.array] = [tokens, mx.array(first._idx, dtype=mx.int32)]
        args += [c.left_padding for c in caches]
        args += [c.offset for c in caches]
        for c in caches:
            args += [c.keys, c.values]
            # NOTE: the cache lets go of its buffers, so when the step runs
            # the graph holds their last references and MLX writes in place.
            c.keys = c.values = None
        out = self._fn(*args)
        del args
        n = len(caches)
        for i, c in enumerate(caches):
            c.offset = out[1 + i]
            c.keys, c.values = out[1 + n + 2 * i], out[2 + n + 2 * i]
            c._idx += 1
        logits: mx.array = out[0]
        return logits


_ATTR = "kvtier_compiled_decode"


def install_compiled_decode(model: Any) -> bool:
    """Give ``model`` a :class:`CompiledDecode` when the switch is on and its type was checked; whether it has one."""
    if compiled_decode_enabled() and getattr(model, "model_type", None) in COMPILED_MODEL_TYPES:
        setattr(model, _ATTR, CompiledDecode(model))
    return compiled_decode_of(model) is not None


def compiled_decode_of(model: Any) -> CompiledDecode | None:
    """The model's :class:`CompiledDecode` (:func:`install_compiled_decode`), or None."""
    found = getattr(model, _ATTR, None)
    return found if isinstance(found, CompiledDecode) else None


def remove_compiled_decode(model: Any) -> None:
    """Take the model's :class:`CompiledDecode` away (its traces go with it)."""
    if compiled_decode_of(model) is not None:
        delattr(model, _ATTR)
