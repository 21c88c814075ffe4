"""The compiled one-token batch forward: the built step's tokens and cache, traces bounded, off unless asked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache

import kernels.model._compiled_decode as compiled_module
from kernels import cache_arrays
from kernels.engine import BatchGeneration
from kernels.model import (
    COMPILED_DECODE_ENV,
    CompiledDecode,
    compiled_decode_of,
    install_compiled_decode,
    remove_compiled_decode,
)
from tests.kernels.test_batch import assert_same_rows, drive
from tests.kernels.test_read_first import _plans
from tests.tiny_models import tiny_qwen

ROUNDING = 1e-4
"""How far a logprob or a cached value may move between the two forwards (float32 rounding, not a token)."""


@pytest.fixture
def compiled(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[CompiledDecode]:
    """The module's tiny Llama with a compiled decode installed for one test."""
    monkeypatch.setenv(COMPILED_DECODE_ENV, "1")
    assert install_compiled_decode(model)
    found = compiled_decode_of(model)
    assert found is not None
    yield found
    remove_compiled_decode(model)


def _count_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = CompiledDecode.forward

    def counted(self: CompiledDecode, tokens: mx.array, caches: list[Any]) -> mx.array:
        calls[0] += 1
        return real(self, tokens, caches)

    monkeypatch.setattr(CompiledDecode, "forward", counted)
    return calls


def _lively_qwen(kind: str, vocab: int) -> Any:
    """A tiny Qwen with weights scaled x2, so greedy output is varied (as ``lively_llama``)."""
    m = tiny_qwen(kind, seed=1, vocab_size=vocab)
    m.update(tree_map(lambda p: p * 2.0, m.parameters()))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_batch_rows_emit_the_built_steps_tokens(
    kind: str, model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per checked model type, staggered rows joining and leaving: every row's tokens, finish reasons and leaving cache equal the built forward's (values within rounding), and the compiled forward ran the decode steps."""
    if kind != "llama":
        model = _lively_qwen(kind, len(tok))
    assert model.model_type == kind
    monkeypatch.setenv(COMPILED_DECODE_ENV, "1")
    assert install_compiled_decode(model)
    compiled = compiled_decode_of(model)
    assert compiled is not None
    calls = _count_forwards(monkeypatch)
    try:
        with_trace = drive(BatchGeneration(model, tok, prefill_step_size=8, max_rows=4), _plans(tok))
    finally:
        # NOTE: the module's Llama serves the other tests without one.
        remove_compiled_decode(model)
    assert calls[0] >= 15
    assert compiled.traces >= 1
    taken = calls[0]
    built = drive(BatchGeneration(model, tok, prefill_step_size=8, max_rows=4), _plans(tok))
    assert calls[0] == taken
    assert_same_rows(with_trace, built, 5, rounding=ROUNDING)
    for row_id in with_trace.outputs:
        mine, theirs = with_trace.exits[row_id], built.exits[row_id]
        assert mine.cache_tokens == theirs.cache_tokens
        for a, b in zip(cache_arrays(mine.cache), cache_arrays(theirs.cache), strict=True):
            assert a.shape == b.shape
            assert mx.allclose(a, b, rtol=0, atol=ROUNDING).item(), row_id


def _batch_caches(model: Any, left: list[int], prefix: int, span: int) -> list[BatchKVCache]:
    """Every layer a BatchKVCache of ``span`` positions, ``prefix`` written (random), rows left-padded by ``left``."""
    mx.random.seed(5)
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        shape = (len(left), attn.n_kv_heads, span, attn.head_dim)
        c: Any = BatchKVCache(left)
        keys, values = mx.zeros(shape), mx.zeros(shape)
        keys[..., :prefix, :] = mx.random.normal((*shape[:2], prefix, shape[3]))
        values[..., :prefix, :] = mx.random.normal((*shape[:2], prefix, shape[3]))
        c.keys, c.values = keys, values
        c._idx = prefix
        c.offset = mx.array([prefix - p for p in left])
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def test_a_step_leaves_each_cache_as_its_own_update_would(model: Any, compiled: CompiledDecode) -> None:
    """One compiled step over left-padded rows: logits, written keys and values, position and offsets equal the built step's."""
    left = [0, 3, 7]
    tokens = mx.array([[5], [9], [2]])
    mine, theirs = _batch_caches(model, left, 20, 32), _batch_caches(model, left, 20, 32)
    assert CompiledDecode.applies(tokens, mine)
    got = compiled.forward(tokens, mine)
    want = model(tokens, cache=theirs)
    assert mx.allclose(got, want, rtol=0, atol=ROUNDING).item()
    for x, y in zip(mine, theirs, strict=True):
        a: Any = x
        b: Any = y
        assert a._idx == b._idx == 21
        assert a.offset.tolist() == b.offset.tolist() == [21, 18, 14]
        assert a.keys.shape == b.keys.shape == (3, a.keys.shape[1], 32, a.keys.shape[3])
        assert mx.allclose(a.keys[..., :21, :], b.keys[..., :21, :], rtol=0, atol=ROUNDING).item()
        assert mx.allclose(a.values[..., :21, :], b.values[..., :21, :], rtol=0, atol=ROUNDING).item()
        # NOTE: past the written position the buffer holds what it held.
        assert mx.array_equal(a.keys[..., 21:, :], b.keys[..., 21:, :]).item()


def _address(a: Any) -> int:
    """Where the array's evaluated data lives (CPU)."""
    data: tuple[int, bool] = np.asarray(memoryview(a)).__array_interface__["data"]
    return data[0]


def test_the_step_writes_the_buffers_in_place(model: Any, compiled: CompiledDecode) -> None:
    """The caches' key and value buffers keep their storage across compiled steps: the token is written into them, no layer is copied."""
    caches: list[Any] = _batch_caches(model, [0, 2], 10, 32)
    before = [(_address(c.keys), _address(c.values)) for c in caches]
    for token in (3, 4):
        mx.eval(compiled.forward(mx.array([[token], [token + 1]]), caches), [(c.keys, c.values) for c in caches])
    assert [(_address(c.keys), _address(c.values)) for c in caches] == before
    assert all(c._idx == 12 for c in caches)


def test_it_declines_what_it_cannot_trace(model: Any) -> None:
    """A prefill, a buffer with no room for the token, and layers at different positions run the model as it is."""
    caches = _batch_caches(model, [0, 1], 8, 8)
    assert not CompiledDecode.applies(mx.array([[1], [2]]), caches)  # NOTE: full buffer: it grows.
    caches = _batch_caches(model, [0, 1], 8, 16)
    assert CompiledDecode.applies(mx.array([[1], [2]]), caches)
    assert not CompiledDecode.applies(mx.array([[1, 2], [3, 4]]), caches)
    assert not CompiledDecode.applies(mx.array([[1], [2], [3]]), caches)
    caches[1]._idx += 1
    assert not CompiledDecode.applies(mx.array([[1], [2]]), caches)


def test_traces_are_bounded(model: Any, compiled: CompiledDecode, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_TRACES distinct shapes every trace is dropped and counting starts again."""
    monkeypatch.setattr(compiled_module, "MAX_TRACES", 2)
    for span in (16, 32, 48, 16):
        caches = _batch_caches(model, [0, 2], 10, span)
        mx.eval(compiled.forward(mx.array([[1], [2]]), caches))
    # NOTE: 16 and 32 traced, 48 dropped both, 16 again is new.
    assert compiled.traces == 4
    assert len(compiled._shapes) == 2


def test_off_unless_switched_on(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiled decode by default, nor for a model type not checked; the switch on gives one."""
    monkeypatch.delenv(COMPILED_DECODE_ENV, raising=False)
    assert not install_compiled_decode(model)
    monkeypatch.setenv(COMPILED_DECODE_ENV, "1")
    monkeypatch.setattr(model, "model_type", "gemma3_text")
    assert not install_compiled_decode(model)
    monkeypatch.setattr(model, "model_type", "llama")
    try:
        assert install_compiled_decode(model)
    finally:
        remove_compiled_decode(model)
